"""The Criteo preprocessing kernels in C (csrc/criteo.c, loaded with ctypes): parsing lines,
counting keys, mapping values to ids, with the same results as the numpy code (parse.py,
np.unique, criteo_tsv.map_ids). Where setup.py did not build the library (an install without a
C compiler), `available()` is False and the numpy code runs instead.

`benchmarks/preprocess_stages.py` measures both, one core, per row.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from dlrm_hybrid.data.criteo import parse
from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL, NUM_NUMERICAL, Chunk

LUT_SIZE = 1 << 16  # csrc/criteo.c's: integers below it take their float16 from a table
FEATURE_BITS = 5  # a key is value << 5 | feature


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """csrc/criteo.c as setup.py built it next to the package; None where it was not."""
    package = Path(__file__).resolve().parents[2]
    path = next((p for p in (package / f"_criteo{s}" for s in EXTENSION_SUFFIXES) if p.exists()),
                None)
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    pointer, integer, int32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.parse_lines.argtypes = ([pointer, integer, int32] + [pointer] * 10
                                    + [integer, pointer])
    library.parse_lines.restype = integer
    library.id_insert.argtypes = [pointer, int32, pointer, pointer, integer]
    library.id_insert.restype = None
    library.id_map.argtypes = [pointer] * 4 + [integer, pointer]
    library.id_map.restype = None
    library.count_keys.argtypes = [pointer, integer, integer, integer, pointer, integer]
    library.count_keys.restype = integer
    library.drain_keys.argtypes = [pointer, integer] + [pointer] * 4
    library.drain_keys.restype = None
    return library


def available() -> bool:
    return _library() is not None


def _address(array: np.ndarray) -> int:
    return array.ctypes.data


@lru_cache(maxsize=None)
def _log_table() -> np.ndarray:
    """float16 bits of log(x + 3) for x < LUT_SIZE, by parse.py's very numpy expression, so the
    C parser's dense values are bit for bit numpy's (C's log may round otherwise)."""
    return _log1p3(np.arange(LUT_SIZE, dtype=np.int64))


def _log1p3(x: np.ndarray) -> np.ndarray:
    return np.log(x + 3.0).astype(np.float16).view(np.uint16)


def parse_fast(data: bytes, pad_short: bool = False) -> Chunk:
    """`parse.parse_lines`, in C where the library was built (the same result, faster)."""
    return (parse_lines if available() else parse.parse_lines)(data, pad_short)


def parse_lines(data: bytes, pad_short: bool = False) -> Chunk:
    """parse.parse_lines in C: the same Chunk. Integers of LUT_SIZE and more (rare) get their
    log here, from the positions C lists."""
    size = data.rfind(b"\n") + 1  # as parse.py: text after the last newline is no line
    lines = data.count(b"\n", 0, size)
    labels = np.empty(lines, np.uint8)
    dense = np.empty((lines, NUM_NUMERICAL), np.uint16)
    cats = np.empty((lines, NUM_CATEGORICAL), np.int64)
    skipped, crlf = np.empty(lines, np.int8), np.empty(lines, np.bool_)
    short = np.empty(lines, np.int64)
    counts = np.zeros(2, np.int64)  # short rows, large integers
    for big_capacity in (2 * lines, NUM_NUMERICAL * lines):  # the second always suffices
        big_at, big_value = np.empty(big_capacity, np.int64), np.empty(big_capacity, np.int64)
        rows = _library().parse_lines(
            _address(np.frombuffer(data, np.uint8)), size, int(pad_short), _address(_log_table()), _address(labels),
            _address(dense), _address(cats), _address(skipped), _address(crlf),
            _address(short), _address(counts), _address(big_at), _address(big_value),
            big_capacity, _address(counts[1:]))
        if rows >= 0:
            break
    big = int(counts[1])
    dense.reshape(-1)[big_at[:big]] = _log1p3(big_value[:big])
    return Chunk(labels[:rows], dense[:rows].view(np.float16), cats[:rows], skipped, crlf,
                 short[:counts[0]].copy())


class IdLookup:
    """The id of each categorical value, per feature: an open-addressing hash table per feature
    of 2^k slots, 8 bytes each (id << 32 | value, 0 where empty), at most half full: 16 to 32
    bytes per entry (a Criteo 1TB vocabulary of ~40M values: ~0.6 to 1.3 GB per process)."""

    def __init__(self, values: List[np.ndarray], ids: List[np.ndarray]):
        if len(values) != NUM_CATEGORICAL or len(ids) != NUM_CATEGORICAL:
            raise ValueError(f"IdLookup needs {NUM_CATEGORICAL} value and id arrays, got "
                             f"{len(values)} and {len(ids)}")
        self._bits = np.array([max(int(2 * len(v) - 1).bit_length(), 1) for v in values],
                              np.int32)
        sizes = 1 << self._bits.astype(np.int64)
        self._offset = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)
        self._slots = np.zeros(int(sizes.sum()), np.uint64)
        for f, (v, i) in enumerate(zip(values, ids)):
            v, i = np.ascontiguousarray(v, np.uint32), np.ascontiguousarray(i, np.uint32)
            if len(v) != len(i):
                raise ValueError(f"IdLookup feature {f}: {len(v)} values but {len(i)} ids")
            _library().id_insert(_address(self._slots[self._offset[f]:]), int(self._bits[f]),
                                 _address(v), _address(i), len(v))

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    def map(self, cats: np.ndarray) -> np.ndarray:
        """[n, 26] uint32 ids of [n, 26] int64 values: 0 for -1 and for values not held."""
        cats = np.ascontiguousarray(cats, np.int64)
        out = np.empty(cats.shape, np.uint32)
        _library().id_map(_address(self._slots), _address(self._offset), _address(self._bits),
                          _address(cats), len(cats), _address(out))
        return out


class KeyCounter:
    """Exact counts of the keys value << 5 | feature of [n, 26] cats, in a fixed hash table:
    1.5 slots of 16 bytes (key, count) per key of `capacity`, 24 bytes each."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slots = np.full((capacity * 3 // 2 + 1, 2), np.iinfo(np.uint64).max, np.uint64)
        self.size = 0

    def add(self, cats: np.ndarray) -> bool:
        """Count the keys of `cats` (-1 is missing); False, adding nothing, when they might not
        fit (size + their number > capacity): drain, then add again."""
        cats = np.ascontiguousarray(cats, np.int64).reshape(-1, NUM_CATEGORICAL)
        size = _library().count_keys(_address(self._slots), len(self._slots), self.size,
                                     self.capacity, _address(cats), len(cats))
        if size == -2:
            raise ValueError("KeyCounter.add: categorical values must be -1 or in [0, 2^32)")
        if size == -1:
            if not self.size:
                raise ValueError(f"KeyCounter.add: {int((cats >= 0).sum()):,} keys can never fit "
                                 f"a capacity of {self.capacity:,}; add fewer rows at a time")
            return False
        self.size = size
        return True

    def drain(self) -> Tuple[np.ndarray, np.ndarray]:
        """(keys ascending, their counts), both uint64; the counter is empty after."""
        keys, counts = np.empty(self.size, np.uint64), np.empty(self.size, np.uint64)
        spare = np.empty((2, self.size), np.uint64)
        _library().drain_keys(_address(self._slots), len(self._slots), _address(keys),
                              _address(counts), _address(spare[0]), _address(spare[1]))
        self.size = 0
        return keys, counts
