"""What `preprocess yambda` makes of events, held or bounded alike: the listen_plus label, the
action bits of a history, the time split, a listen row's columns, and `Prepared`, the dataset
about to be written (its ids, counts and rows in order)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from dlrm_hybrid.data.interactions.ranking_history import Histories
from dlrm_hybrid.data.yambda.events import EVENT_TYPES, LISTEN, Events
from dlrm_hybrid.errors import DataError

LABEL = "listen_plus"
ACTIONS = (LABEL, "like", "dislike", "unlike", "undislike")  # action bit t: ACTIONS[t]
DENSE = ("is_organic", "log1p_track_length_seconds")
CHUNK_IDS = 50 << 16  # history slots made at a time: 65,536 rows of 50 slots, 52 MiB of ids
# a split's chunk of rows: (split, label [N], dense [N, 2], categorical columns [N] each, times,
# each row's count of its user's earlier events: the history's place in the timelines)
Chunk = Tuple[str, np.ndarray, np.ndarray, List[np.ndarray], np.ndarray, np.ndarray]


def listen_plus(kind: np.ndarray, played: np.ndarray, threshold: int) -> np.ndarray:
    """The label: a listen played at least `threshold` percent; False for any other event."""
    return (kind == LISTEN) & (played >= threshold)


def action_bits(kind: np.ndarray, plus: np.ndarray) -> np.ndarray:
    """[events, len(ACTIONS)] 0/1: listen_plus, then one column per other event type."""
    columns = [plus] + [kind == EVENT_TYPES.index(name) for name in ACTIONS[1:]]
    return np.stack(columns, axis=1).astype(np.uint8)


def time_splits(times: np.ndarray, cuts: list, gap: float) -> np.ndarray:
    """Each time's split (0 train, 1 validation, 2 test; -1 in a gap), Yambda's Global
    Temporal Split: test from cuts[1] on, validation from cuts[0] to `gap` before test, train
    until `gap` before validation."""
    val_start, test_start = cuts
    split = np.full(len(times), -1, np.int8)
    split[times < val_start - gap] = 0
    split[(times >= val_start) & (times < test_start - gap)] = 1
    split[times >= test_start] = 2
    return split


def listen_rows(events: Events, rows: np.ndarray, users: np.ndarray, items: np.ndarray,
                plus: np.ndarray, histories: Optional[Histories], slots: int
                ) -> Tuple[np.ndarray, np.ndarray, List[np.ndarray]]:
    """(label, dense, categorical columns) of the listens `rows` (indices into `events` and its
    dense `users`, `items`; `histories` made over the same events)."""
    dense = np.stack([events.organic[rows].astype(np.float32),
                      np.log1p(events.length[rows].astype(np.float32))], axis=1)
    past = (histories.before(rows, users[rows], slots) if slots else
            (np.zeros((len(rows), 0), np.int64),) * 2)
    return plus[rows], dense, [users[rows], items[rows], *past[0].T, *past[1].T]


def chunk_rows(args) -> int:
    """Rows made at a time: 65,536, fewer for a history of more than 50 stored slots (at
    4,095, 65,536 rows would hold 4.3 GB of ids)."""
    return max(256, CHUNK_IDS // max(50, stored_slots(args)))


def stored_slots(args) -> int:
    """History slots written as columns: all of them, or none when the reader takes them from
    the timelines (`--history-store timelines`)."""
    return args.history if args.history_store == "slots" else 0


def split_cuts(args, end: int) -> list:
    """[validation's first time, test's first time] for a log whose last time is end - 1:
    test the last --test-days, validation the --val-days before the gap before it."""
    day, gap = 86400 / args.time_unit, gap_units(args)
    test = end - args.test_days * day
    return [test - gap - args.val_days * day, test]


def gap_units(args) -> float:
    """--gap-minutes in the timestamps' units."""
    return args.gap_minutes * 60 / args.time_unit


def check_splits(args, rows: Dict[str, int], end: int, first: int) -> None:
    """Refuse, before writing, a split without a listen."""
    for name, n in rows.items():
        if not n:
            raise DataError(f"--input: {args.input}: no listen falls in {name} (the log spans "
                            f"{(end - first) * args.time_unit / 86400:.2f} days; validation "
                            f"{args.val_days:g} and test {args.test_days:g} before its end, "
                            f"gaps of {args.gap_minutes:g} minutes; timestamps in "
                            f"{args.time_unit:g}-second units); give smaller --val-days/"
                            f"--test-days, the right --time-unit, or a longer log")


def no_listen(folder: str, read: int) -> DataError:
    return DataError(f"--input: {folder} holds no listen (events read: {read:,}); give a Yambda "
                     f"log with listens")


@dataclass
class Prepared:
    """The dataset before it is written: raw ids in id order, what the report says, the rows
    (`chunks()`: every split's in time order, split after split) and the users' timelines."""

    raw_users: np.ndarray
    raw_items: np.ndarray
    rows: Dict[str, int]
    rates: Dict[str, float]
    by_type: Dict[str, int]
    kept: int
    played_over_100: int
    in_gaps: int  # listens in the gaps between the splits: in no split
    cuts: List[float]
    chunks: Callable[[], Iterator[Chunk]]
    save_timelines: Callable[[Path], None]
    close: Callable[[], None] = lambda: None  # removes the work files, if any
