"""Which split each row goes to.

`--split` (default auto: days when every input is named `day_N[.gz]`, else hash):
- days (Criteo 1TB): day 23's first ceil(N/2) rows -> validation, the rest -> test (the MLPerf
  reference's and torchrec's rule, recorded as feature_spec.yaml's `metadata.day_23`; see
  day23.py), every other day -> train;
- hash: each row goes by a splitmix64 hash of (seed, global row number): < 0.90 train, < 0.95
  validation, else test.
Rows keep input order within a split. Training evaluates on validation and `eval` on test, so a
dataset with an empty split is refused: day inputs without day 23 before any reading, too few rows
after counting.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo.tasks import Task
from dlrm_hybrid.data.criteo.day23 import validation_rows
from dlrm_hybrid.data.feature_spec import SPLITS
from dlrm_hybrid.errors import DataError

TRAIN, VALIDATION, TEST = range(3)  # indices into SPLITS
SPLIT_MODES = ("auto", "days", "hash")
LAST_DAY = 23
DAY_FILE = re.compile(r"day_(\d+)(\.gz)?")
COUNT_BLOCK = 1 << 18  # row numbers hashed at once when counting a task's rows per split


class SplitRule(NamedTuple):
    """How a task's rows go to splits. kind "train": all rows; "halves": row numbers within the
    day below `value` -> validation, the rest test; "hash": global row numbers hashed with seed
    `value`, 90/5/5."""
    kind: str
    value: int = 0


def day_number(path: str) -> Optional[int]:
    match = DAY_FILE.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def day_rule(day: int, rows_of_day: int) -> SplitRule:
    if day == LAST_DAY:
        return SplitRule("halves", validation_rows(rows_of_day))
    return SplitRule("train")


def resolve_split(mode: str, inputs: Sequence[str]) -> str:
    """"days" or "hash" for `--split mode`: auto is days when every input is a `day_N` file."""
    if mode not in SPLIT_MODES:
        raise ConfigError(f"--split: {mode!r} is not one of {', '.join(SPLIT_MODES)}")
    not_days = [p for p in inputs if day_number(p) is None]
    if mode == "days" and not_days:
        raise ConfigError(f"--split days: {not_days[0]} is not named day_N; rename the Criteo "
                          f"1TB day files or use --split hash")
    return mode if mode != "auto" else "hash" if not_days else "days"


def describe_split(given: str, split: str, seed: int, inputs: Sequence[str]) -> str:
    """The line saying which rule `preprocess criteo` splits by, and why where auto chose it: a
    day file named otherwise (`day_0.tsv`) made auto hash the days' rows together, silently."""
    not_days = [p for p in inputs if day_number(p) is None]
    why = "" if given != "auto" else (f" (auto: {not_days[0]} is not named day_N[.gz])"
                                      if not_days else " (auto: every input is named day_N)")
    rule = {"days": "day 23's first half validation, its second test, the other days train",
            "hash": f"rows by a hash seeded {seed}: 90% train, 5% validation, 5% test"}
    return f"split: {split}{why}: {rule[split]}"


def check_days(days: Sequence[int], add_day_23: str) -> None:
    """Day 23 alone makes validation and test, the other days train: refuse a set of days that
    leaves a split empty before reading them, not when training first evaluates."""
    if LAST_DAY not in days:
        listed = ",".join(map(str, sorted(set(days))))
        raise ConfigError(f"--input: no day_23 among days {listed}, and its halves make the test "
                          f"and validation splits; {add_day_23} or use --split hash (a seeded "
                          f"90/5/5 split by row)")
    if not set(days) - {LAST_DAY}:
        raise ConfigError("--input: only day_23, whose halves make test and validation, so "
                          "train would be empty; add days 0..22 or use --split hash")


def check_splits_filled(counts: dict, mode: str) -> None:
    """Refuse, before the dataset is moved into place, one whose split got no rows: training
    evaluates on validation and `eval` on test (tiny inputs, a day 23 of one row)."""
    empty = [split for split in SPLITS if not counts[split]]
    if empty:
        how = ("day 23 makes test and validation" if mode == "days"
               else "the seeded split sends 90/5/5% of rows to train/validation/test")
        rows = " ".join(f"{split}={counts[split]}" for split in SPLITS)
        raise DataError(f"--input: the {' and '.join(empty)} split{'s' * (len(empty) > 1)} "
                        f"would be empty ({rows}; {how}); give more rows")


def split_codes(rule: SplitRule, rows: np.ndarray) -> np.ndarray:
    """TRAIN/VALIDATION/TEST for each row number in `rows`."""
    if rule.kind == "train":
        return np.full(len(rows), TRAIN, np.int8)
    if rule.kind == "halves":
        return np.where(rows < rule.value, VALIDATION, TEST).astype(np.int8)
    seed = _mix64(np.full(len(rows), rule.value % 2**64, np.uint64))
    unit = (_mix64(rows.astype(np.uint64) ^ seed) >> 11) / 2.0**53
    return np.select([unit < 0.90, unit < 0.95], [TRAIN, VALIDATION], TEST).astype(np.int8)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-mixed uint64 hash (array arithmetic wraps)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


def split_jobs(mode: str, tasks: List[Task], task_rows: List[int],
                seed: int) -> List[Tuple[SplitRule, int]]:
    """(rule, number of its first row) per task: within its day file for the days split, global
    for the hash split."""
    if mode == "days":
        day_rows: dict = defaultdict(int)
        for task, rows in zip(tasks, task_rows):
            day_rows[day_number(task.path)] += rows
        row0, jobs = defaultdict(int), []
        for task, rows in zip(tasks, task_rows):
            day = day_number(task.path)
            jobs.append((day_rule(day, day_rows[day]), row0[day]))
            row0[day] += rows
        return jobs
    starts = np.cumsum([0, *task_rows[:-1]]) if tasks else []
    return [(SplitRule("hash", seed), int(s)) for s in starts]


def split_counts(rule: SplitRule, row0: int, rows: int) -> List[int]:
    """Rows per split among row numbers row0 .. row0 + rows - 1 under `rule`."""
    counts = np.zeros(len(SPLITS), np.int64)
    for lo in range(row0, row0 + rows, COUNT_BLOCK):
        codes = split_codes(rule, np.arange(lo, min(lo + COUNT_BLOCK, row0 + rows)))
        counts += np.bincount(codes, minlength=len(SPLITS))
    return counts.tolist()


def add_split_arguments(parser) -> None:
    """`--split` and `--split-seed`, the same for TSV and .npy day files."""
    parser.add_argument("--split", choices=SPLIT_MODES, default="auto",
                        help="days: day_23's first ceil(N/2) rows validation and the rest test "
                             "(the MLPerf reference's rule), other days train; hash: a seeded "
                             "90/5/5 split by row; auto (default): days if every input is a "
                             "day_N file, else hash")
    parser.add_argument("--split-seed", type=int, default=0, metavar="S",
                        help="seed of the hash split")
