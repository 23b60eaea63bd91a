"""What a history user tower reads (model.user_tower.encoder history_*): each user's items in
time order, and for every sample the items its user engaged with before it, with no leak.

- A training row (u, i) sees u's training items strictly before i in u's timeline (the order
  the split used: timestamp, ties by file order), so training never reads the item it predicts
  or a later one. The dataset folder records each training row's place in its user's timeline
  (`train_position.npy`: 0 for the user's first training item).
- Validation sees all of u's training items; test, those and u's validation items (the
  history `recommend` is given); serving, the history given at request time.

A history is the last `length` of those items, oldest first, as [n, length] ids left-aligned
(slot j the j-th item; past the history's end 0, unused) with each row's count: the model
reads slots [0, count). Plain numpy.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

History = Tuple[np.ndarray, np.ndarray]  # ids [n, length] int64, counts [n] int64

POSITION_FILE = "train_position.npy"


def timeline_positions(users: np.ndarray, chronology: np.ndarray) -> np.ndarray:
    """Each row's 0-based place among its user's rows, where `chronology` holds the rows
    oldest first: position[chronology[k]] counts the rows of that user before k."""
    ordered = users[chronology]
    order = np.argsort(ordered, kind="stable")  # by user, oldest first within one
    counts = np.bincount(ordered, minlength=int(ordered.max(initial=-1)) + 1)
    starts = np.cumsum(counts) - counts
    place = np.empty(len(chronology), np.int64)
    place[order] = np.arange(len(order)) - starts[ordered[order]]
    position = np.empty(len(users), np.int64)
    position[chronology] = place
    return position


def window_rows(users: np.ndarray, position: np.ndarray, length: int) -> np.ndarray:
    """The training rows the sequence model (model.kind hstu) trains on: per user, the rows at
    timeline positions last, last - length, last - 2 length, ... down to 1. Each row's history
    is the `length` items before it and predicts every next item up to the row's own, so every
    training item but a user's first is predicted exactly once, and no window repeats another."""
    users, position = np.asarray(users, np.int64), np.asarray(position, np.int64)
    last = np.zeros(int(users.max(initial=-1)) + 1, np.int64)
    np.maximum.at(last, users, position)
    back = last[users] - position
    return np.flatnonzero((position >= 1) & (back % length == 0))


def _slots(starts: np.ndarray, ends: np.ndarray, length: int
           ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(where [n, length]: the CSR index of each slot's value, used [n, length], counts [n]) of
    the last `length` values of [starts, ends) per row, left-aligned, oldest first."""
    starts = np.maximum(starts, ends - length)
    counts = (ends - starts).astype(np.int64)
    slots = np.arange(length)
    used = slots[None, :] < counts[:, None]
    return np.where(used, starts[:, None] + slots[None, :], 0), used, counts


def last_items(indptr: np.ndarray, items: np.ndarray, starts: np.ndarray, ends: np.ndarray,
               length: int) -> History:
    """The last `length` items of `items[starts:ends]` per row (left-aligned, oldest first)."""
    where, used, counts = _slots(starts, ends, length)
    ids = np.where(used, items[where] if len(items) else 0, 0).astype(np.int64)
    return ids, counts


class Histories:
    """Every user's training items in time order (CSR), and the validation items after them,
    for the histories of training rows (`of_rows`) and of a held-out split's users (`before`);
    where the log had timestamps, each slot's time too (`times_of_rows`, `times_before`)."""

    def __init__(self, users: int, train: Tuple[np.ndarray, np.ndarray], position: np.ndarray,
                 later: Dict[str, Tuple[np.ndarray, np.ndarray]], length: int,
                 times: Optional[Dict[str, np.ndarray]] = None) -> None:
        """`train`: (users, items) of the training rows, `position` each one's place in its
        user's timeline; `later`: the held-out splits' (users, items), each user's rows in time
        order (as the split stores them); `times`: each split's engagement times in the same
        row order as those pairs (None: the log had none)."""
        self.length = length
        self.train_users = np.asarray(train[0], np.int64)
        self.position = np.asarray(position, np.int64)
        order = np.lexsort((self.position, self.train_users))
        self.indptr = _indptr(self.train_users, users)
        self.items = np.asarray(train[1], np.int64)[order]
        # test's history: training items, then validation's
        test_indptr, after = _appended(self.indptr, later.get("val"), users)
        self.timelines = {"val": (self.indptr, self.items),
                          "test": (test_indptr, _concat(self.items, later.get("val"), after, 1))}
        self.times = None
        if times is not None:
            train_times = np.asarray(times["train"], np.float64)[order]
            val = (None if "val" not in later else (later["val"][0], times["val"]))
            self.times = {"val": train_times, "test": _concat(train_times, val, after, 1)}

    def of_rows(self, rows: np.ndarray) -> History:
        """Histories of training rows: their user's training items before them."""
        starts, ends = self._row_bounds(rows)
        return last_items(self.indptr, self.items, starts, ends, self.length)

    def times_of_rows(self, rows: np.ndarray) -> Optional[np.ndarray]:
        """[n, length] the times of `of_rows`' slots (0 past a history's end), or None."""
        return None if self.times is None else self._times(self.times["val"],
                                                           *self._row_bounds(rows))

    def before(self, split: str, users: np.ndarray) -> History:
        """Histories of `users` for a held-out split: everything they did before it."""
        indptr, items = self.timelines[split]
        users = np.asarray(users, np.int64)
        return last_items(indptr, items, indptr[users], indptr[users + 1], self.length)

    def times_before(self, split: str, users: np.ndarray) -> Optional[np.ndarray]:
        """[n, length] the times of `before`'s slots, or None."""
        if self.times is None:
            return None
        indptr, _ = self.timelines[split]
        users = np.asarray(users, np.int64)
        return self._times(self.times[split], indptr[users], indptr[users + 1])

    def timeline(self, split: str, user: int) -> np.ndarray:
        """`user`'s items before `split` (all of them), oldest first."""
        indptr, items = self.timelines[split]
        return items[indptr[user]:indptr[user + 1]]

    def timeline_times(self, split: str) -> Optional[np.ndarray]:
        """The times of the `split` timelines' items (CSR as `timelines[split]`), or None."""
        return None if self.times is None else self.times[split]

    def _row_bounds(self, rows: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        starts = self.indptr[self.train_users[rows]]
        return starts, starts + self.position[rows]

    def _times(self, values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        where, used, _ = _slots(starts, ends, self.length)
        return np.where(used, values[where] if len(values) else 0.0, 0.0)


def _indptr(users: np.ndarray, count: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.bincount(users, minlength=count))]).astype(np.int64)


def _appended(indptr: np.ndarray, extra, count: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """(the CSR indptr with `extra`'s (users, ...) rows after each user's, the order that puts
    [timeline values, extra values] in it); (indptr, None) without `extra`."""
    if extra is None:
        return indptr, None
    users = np.concatenate([np.repeat(np.arange(count), np.diff(indptr)),
                            np.asarray(extra[0], np.int64)])
    return _indptr(users, count), np.argsort(users, kind="stable")  # training first, then later


def _concat(values: np.ndarray, extra, order: Optional[np.ndarray], column: int) -> np.ndarray:
    """`values` with `extra[column]` placed by `_appended`'s order."""
    if order is None:
        return values
    return np.concatenate([values, np.asarray(extra[column], values.dtype)])[order]
