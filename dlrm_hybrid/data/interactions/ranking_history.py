"""`preprocess interactions --labels ... --history L`: each ranking row's history with its
actions, for the ranker's sequence feature (model/sequence_feature.py, `model.sequence: hstu`).

- A row's history is its user's last L engagements strictly before the row's engagement in
  time (timestamp, then file order), over every split the dataset keeps: nothing at or after
  the engagement, so nothing it predicts. Its sampled negatives share it (one request).
- Each history item carries its action: 1 + the bits of its labels (label t sets bit t), so
  `watched,liked:rating>=4` gives 2 (watched) or 4 (watched and liked); 0 marks an empty slot.
- Stored as features `user_history0..L-1` (item ids; 0 in an empty slot, never read) and
  `user_action0..L-1`, left-aligned, oldest first.
- `timelines.npz` keeps every user's whole timeline (items, actions and times, in time order):
  serving reads a request's history from it, the latest engagements, or those before the
  request's time (the log's timestamps; a log without them: its row numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.data.interactions.interaction_meta import ACTION, HISTORY
from dlrm_hybrid.errors import DataError, UserError

TIMELINES = "timelines.npz"
MAX_LABELS = 8  # actions are 1 + a label bitmask: 257 rows at most


@dataclass
class Histories:
    """Every kept engagement in (user, time) order: its item and action, and where each user's
    timeline starts (`starts[u]` .. `starts[u + 1]`)."""

    items: np.ndarray
    actions: np.ndarray
    times: np.ndarray
    starts: np.ndarray
    place: np.ndarray  # each log row's index in that order (-1: a row in no split)

    def before(self, rows: np.ndarray, users: np.ndarray, length: int
               ) -> Tuple[np.ndarray, np.ndarray]:
        """(items [N, L], actions [N, L]): the last `length` engagements of each log row's user
        before the row, left-aligned (item 0, action 0 past the history's end)."""
        at = self.place[rows]
        return self._window(at, at - self.starts[users], length)

    def latest(self, user: int, length: int, before: Optional[float] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
        """(items [L], actions [L]): the user's last `length` engagements (strictly before time
        `before`, if given), as `before` lays them out."""
        first, end = self.starts[user], self.starts[user + 1]
        if before is not None:
            end = first + np.searchsorted(self.times[first:end], before, side="left")
        end = np.array([end])
        items, actions = self._window(end, end - first, length)
        return items[0], actions[0]

    def _window(self, end: np.ndarray, earlier: np.ndarray, length: int
                ) -> Tuple[np.ndarray, np.ndarray]:
        count = np.minimum(earlier, length)
        slot = np.arange(length)
        used = slot[None, :] < count[:, None]
        index = np.where(used, end[:, None] - count[:, None] + slot[None, :], 0)
        return (np.where(used, self.items[index] if len(self.items) else 0, 0),
                np.where(used, self.actions[index] if len(self.actions) else 0, 0))

    def save(self, folder: Path) -> None:
        np.savez(folder / TIMELINES, items=self.items, actions=self.actions, times=self.times,
                 starts=self.starts)


def check_slots(slots: int) -> None:
    """`--history L` of the commands that write a history: 0 (none) or more."""
    if slots < 0:
        raise UserError(f"--history: the slots of each row's history, 0 (none) or more; got "
                        f"{slots}")


def action_rows(labels: int) -> int:
    """The action table's rows for `labels` labels: empty, then 1 + every bitmask."""
    return (1 << labels) + 1


def engagement_histories(positions: np.ndarray, users: np.ndarray, items: np.ndarray,
                         label_values: np.ndarray, num_users: int,
                         times: Optional[np.ndarray] = None) -> Histories:
    """Histories of the log rows with a user (>= 0): `positions` each row's place in time,
    `label_values` [rows, T] its labels (0/1), `times` its time (None: its position)."""
    if label_values.shape[1] > MAX_LABELS:
        raise UserError(f"--history: {label_values.shape[1]} labels give "
                        f"{action_rows(label_values.shape[1]):,} actions; keep at most "
                        f"{MAX_LABELS} labels")
    kept = np.flatnonzero(users >= 0)
    order = kept[np.lexsort((positions[kept], users[kept]))]
    bits = (label_values[order] > 0.5) @ (1 << np.arange(label_values.shape[1]))
    place = np.full(len(users), -1, np.int64)
    place[order] = np.arange(len(order))
    starts = np.concatenate([[0], np.cumsum(np.bincount(users[order], minlength=num_users))])
    when = (positions if times is None else times)[order].astype(np.float64)
    return Histories(items[order].astype(np.int64), (1 + bits).astype(np.int64), when, starts,
                     place)


def history_features(length: int) -> List[str]:
    """The features a history of `length` slots adds: its items, then its actions."""
    return [f"{HISTORY}{j}" for j in range(length)] + [f"{ACTION}{j}" for j in range(length)]


def read_timelines(folder: str, option: str) -> Histories:
    """A ranking dataset's `timelines.npz` (checked), for serving."""
    path = Path(folder) / TIMELINES
    try:
        with np.load(path) as f:
            items, actions, times, starts = f["items"], f["actions"], f["times"], f["starts"]
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{option}: {path}: cannot read the users' timelines ({e}); make the "
                        f"dataset again with `preprocess interactions --labels ... --history L`")
    if len(starts) < 1 or starts[-1] != len(items) or not len(actions) == len(times) == len(items):
        raise DataError(f"{option}: {path}: its timelines do not add up; make the dataset again")
    return Histories(items, actions, times, starts, np.zeros(0, np.int64))


def history_columns(histories: Histories, rows: np.ndarray, users: np.ndarray,
                    engagement: np.ndarray, length: int) -> List[np.ndarray]:
    """The history features' columns of a split's samples: sample k is a row of engagement
    `engagement[k]` (an index into the split's log `rows` and `users`)."""
    items, actions = histories.before(rows, users, length)
    return [*items[engagement].T, *actions[engagement].T]


def history_note(length: int, rules: Sequence) -> Dict[str, object]:
    """feature_spec.yaml's note on the history."""
    return {"slots": length,
            "items": f"{HISTORY}0..{length - 1}: the user's last {length} engagements before "
                     f"the row's (any split), oldest first, left-aligned; item 0 in an empty slot",
            "actions": f"{ACTION}0..{length - 1}: 0 empty, else 1 + the labels' bits ("
                       + ", ".join(f"{r.name} {1 << t}" for t, r in enumerate(rules)) + ")",
            "timelines": f"{TIMELINES}: every user's engagements in time order (serving)"}
