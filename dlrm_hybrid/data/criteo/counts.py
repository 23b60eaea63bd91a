"""Exact counts of every categorical value, in bounded memory: an external hash aggregation.

A value of feature f is counted under the key `value << 5 | f`, so one sorted uint64 array
orders the keys by value, then feature. Each worker counts its task's keys in a counter of fixed
capacity; when the counter is full, or the task ends, its keys go to disk as a sorted *run*
(`<stem>.keys` uint64, `<stem>.counts` uint32). Runs are then summed range of keys by range of
keys, each range holding no more run entries than the memory plan allows (`plan_ranges`).

Criteo's values are already 32-bit hashes, so ranges of values are a hash partition; ranges are
used rather than a second hash because the ids' ties go by value (see numbering.py): a range
holds, for each feature, a contiguous stretch of the sorted values. A range too full for memory
is cut in two until it fits, so skewed values cost more ranges, never more memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence, Tuple

import numpy as np

from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL

FEATURE_BITS = 5  # key = value << 5 | feature
KEY_SPACE = 1 << (32 + FEATURE_BITS)
FEATURE_MASK = (1 << FEATURE_BITS) - 1
GRID_CELLS = 1 << 12  # key ranges measured at once when planning the aggregation's ranges
MAX_RUN_COUNT = np.iinfo(np.uint32).max  # counts are stored as uint32: drain before more rows
RUN_ENTRY_BYTES = 12  # a uint64 key and a uint32 count


def keys_of(cats: np.ndarray) -> np.ndarray:
    """The keys of a [n, 26] int64 block's present (>= 0) values."""
    features = np.arange(cats.shape[1], dtype=np.uint64)
    return ((cats.astype(np.uint64) << np.uint64(FEATURE_BITS)) | features)[cats >= 0]


def sum_equal_keys(keys: np.ndarray, counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(unique keys ascending, summed counts) of possibly repeated keys."""
    order = np.argsort(keys, kind="stable")  # a k-way merge where `keys` are sorted runs
    keys, counts = keys[order], counts[order]
    if not len(keys):
        return keys, counts.astype(np.uint64)
    first = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[first], np.add.reduceat(counts.astype(np.uint64), first)


class NumpyKeyCounter:
    """Exact key counts in at most `capacity` entries, with numpy: np.unique per block, blocks
    summed when they reach the capacity. `add` returns False (adding nothing) when the block
    might not fit; the caller drains to a run and adds again."""

    BYTES_PER_ENTRY = 64  # kept blocks (16 B) and the sum's temporaries

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: List[Tuple[np.ndarray, np.ndarray]] = []
        self.size = 0

    def add(self, cats: np.ndarray) -> bool:
        keys, counts = np.unique(keys_of(cats), return_counts=True)
        if self.size + len(keys) > self.capacity:
            self._sum()
            if self.size and self.size + len(keys) > self.capacity:
                return False
        self._blocks.append((keys, counts.astype(np.uint64)))
        self.size += len(keys)
        return True

    def drain(self) -> Tuple[np.ndarray, np.ndarray]:
        self._sum()
        keys, counts = self._blocks[0] if self._blocks else (np.empty(0, np.uint64),) * 2
        self._blocks, self.size = [], 0
        return keys, counts

    def _sum(self) -> None:
        if len(self._blocks) > 1:
            self._blocks = [sum_equal_keys(np.concatenate([k for k, _ in self._blocks]),
                                           np.concatenate([c for _, c in self._blocks]))]
            self.size = len(self._blocks[0][0])


def key_counter(capacity: int):
    """The C counter where the library was built, else numpy's."""
    from dlrm_hybrid.data.criteo import native
    return native.KeyCounter(capacity) if native.available() else NumpyKeyCounter(capacity)


def counter_bytes_per_entry() -> int:
    """Peak bytes per entry of capacity: the C counter's 1.5 slots of 16 bytes and its drain's
    four arrays of 8; numpy's blocks and their sum's temporaries."""
    from dlrm_hybrid.data.criteo import native
    return 24 + 32 if native.available() else NumpyKeyCounter.BYTES_PER_ENTRY


# ---- runs ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """A sorted run of (key, count) on disk."""
    stem: str  # path without the .keys/.counts suffix
    entries: int


def write_run(stem: Path, keys: np.ndarray, counts: np.ndarray) -> Run:
    """Write a run durably (fsync: a task is recorded as counted only once its runs are)."""
    for suffix, array in ((".keys", keys.astype(np.uint64)), (".counts", counts.astype(np.uint32))):
        with open(f"{stem}{suffix}", "wb") as f:
            array.tofile(f)
            f.flush()
            os.fsync(f.fileno())
    return Run(str(stem), len(keys))


def run_complete(run: Run) -> bool:
    """Both files there with the sizes the run's record says (a resumed job checks its runs)."""
    try:
        return (os.path.getsize(run.stem + ".keys") == 8 * run.entries
                and os.path.getsize(run.stem + ".counts") == 4 * run.entries)
    except OSError:
        return False


def _keys(run: Run) -> np.ndarray:
    return np.memmap(run.stem + ".keys", np.uint64, "r") if run.entries else np.empty(0, np.uint64)


def read_range(runs: Sequence[Run], lo: int, hi: int) -> Tuple[np.ndarray, np.ndarray]:
    """All runs' entries with lo <= key < hi, summed: (unique keys ascending, counts)."""
    keys, counts = [], []
    for run in runs:
        mapped = _keys(run)
        a, b = np.searchsorted(mapped, np.array([lo, hi], np.uint64))
        if b > a:
            keys.append(np.array(mapped[a:b]))
            counts.append(np.fromfile(run.stem + ".counts", np.uint32, b - a, offset=4 * int(a)))
        del mapped
    if not keys:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    return sum_equal_keys(np.concatenate(keys), np.concatenate(counts))


def plan_ranges(runs: Sequence[Run], max_entries: int) -> List[Tuple[int, int]]:
    """Consecutive key ranges covering every key, each holding at most `max_entries` run entries
    (or a single key). The entries of a grid of ranges are measured run by run, adjacent cells
    joined while they fit, and a cell over the limit is measured again on a finer grid."""
    ranges: List[Tuple[int, int]] = []
    pending = [(0, KEY_SPACE)]
    while pending:
        cells = []
        for lo, hi in pending:
            edges = np.unique(np.linspace(lo, hi, GRID_CELLS + 1).astype(np.uint64))
            edges[-1] = hi
            cells.append(edges)
        entries = [np.zeros(len(e) - 1, np.int64) for e in cells]
        for run in runs:
            mapped = _keys(run)
            for edges, total in zip(cells, entries):
                total += np.diff(np.searchsorted(mapped, edges))
            del mapped
        pending = []
        for edges, total in zip(cells, entries):
            ranges_here, too_big = _join_cells(edges, total, max_entries)
            ranges += ranges_here
            pending += too_big
    return sorted(ranges)


def _join_cells(edges: np.ndarray, entries: np.ndarray, max_entries: int):
    """Greedy joining of adjacent cells into ranges of at most max_entries; cells over the limit
    (wider than one key) come back to be measured finer."""
    ranges, too_big = [], []
    start, held = int(edges[0]), 0
    for i, n in enumerate(entries.tolist()):
        lo, hi = int(edges[i]), int(edges[i + 1])
        if n > max_entries and hi - lo > 1:
            if start < lo:
                ranges.append((start, lo))
            too_big.append((lo, hi))
            start, held = hi, 0
        elif held and held + n > max_entries:
            ranges.append((start, lo))
            start, held = lo, n
        else:
            held += n
    if start < int(edges[-1]):
        ranges.append((start, int(edges[-1])))
    return ranges, too_big


def feature_of(keys: np.ndarray) -> np.ndarray:
    return (keys & np.uint64(FEATURE_MASK)).astype(np.int64)


def value_of(keys: np.ndarray) -> np.ndarray:
    return (keys >> np.uint64(FEATURE_BITS)).astype(np.int64)


def count_histograms(keys: np.ndarray, counts: np.ndarray) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per feature: (distinct counts ascending, how many values have each)."""
    features = feature_of(keys)
    return [np.unique(counts[features == f], return_counts=True) for f in range(NUM_CATEGORICAL)]
