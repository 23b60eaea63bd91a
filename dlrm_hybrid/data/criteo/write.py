"""Pass 2: values to ids, rows to their split, straight into the dataset's files.

Pass 1 counted each task's rows, so where each task's rows of each split start is known before
any is written: the files are sized first, and each worker writes its task's rows at their place
(pwrite). No part files, no copy in the parent, the same bytes for any worker count, and a task
is redone alone after a kill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from dlrm_hybrid.data.criteo.native import parse_fast
from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL, NUM_NUMERICAL
from dlrm_hybrid.data.criteo.splits import SplitRule, split_codes
from dlrm_hybrid.data.criteo.tasks import Task, read_lines
from dlrm_hybrid.data.criteo.vocabulary import DTYPE, Vocabulary, file_name
from dlrm_hybrid.data.feature_spec import SPLITS, FeatureSpec
from dlrm_hybrid.errors import DataError


@dataclass(frozen=True)
class SplitFiles:
    """One split's files and the bytes of one row in each: label, numerical, cat_0..cat_25."""
    paths: Tuple[str, ...]
    row_bytes: Tuple[int, ...]
    dtypes: Tuple[str, ...]


def split_files(fspec: FeatureSpec) -> List[SplitFiles]:
    out = []
    for split in SPLITS:
        files = fspec.splits[split]
        dtypes = ("bool", "float16", *(d.name for d in fspec.categorical_dtypes))
        widths = (1, NUM_NUMERICAL, *([1] * NUM_CATEGORICAL))
        out.append(SplitFiles(tuple(str(p) for p in (files.label, files.numerical,
                                                     *files.categorical)),
                              tuple(np.dtype(d).itemsize * w for d, w in zip(dtypes, widths)),
                              dtypes))
    return out


def size_files(files: List[SplitFiles], rows: List[int]) -> None:
    """Create every file at its final size (sparse until written)."""
    for split, n in zip(files, rows):
        for path, row_bytes in zip(split.paths, split.row_bytes):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.truncate(n * row_bytes)


@dataclass(frozen=True)
class WriteJob:
    task: Task
    rule: SplitRule
    row0: int  # number of the task's first row (for the split rule)
    first_rows: Tuple[int, ...]  # per split, where the task's rows start in its files
    rows: Tuple[int, ...]  # per split, the task's rows (as counted in pass 1)
    files: Tuple[SplitFiles, ...]
    vocabulary: str  # folder of cat_<i>.bin
    pad_short: bool
    chunk_bytes: int


_LOOKUPS: Dict[str, object] = {}  # per worker process: the vocabulary's lookup, built once


def lookup(folder: str):
    """Ids of raw values through the vocabulary in `folder`: the C hash tables where built."""
    if folder not in _LOOKUPS:
        from dlrm_hybrid.data.criteo import native
        _LOOKUPS.clear()
        vocabulary = Vocabulary([np.fromfile(Path(folder) / file_name(i), DTYPE)
                                 for i in range(NUM_CATEGORICAL)])
        if native.available():
            values, ids = zip(*vocabulary.lookup_tables())
            _LOOKUPS[folder] = native.IdLookup(list(values), list(ids))
        else:
            _LOOKUPS[folder] = vocabulary
    return _LOOKUPS[folder]


def write_task(job: WriteJob) -> List[int]:
    """Map and write one task's rows; rows written per split."""
    ids_of = lookup(job.vocabulary).map
    fds = [[os.open(p, os.O_WRONLY) for p in split.paths] for split in job.files]
    at, row0 = list(job.first_rows), job.row0
    try:
        for data in read_lines(job.task, job.chunk_bytes):
            chunk = parse_fast(data, job.pad_short)
            ids = ids_of(chunk.cats)
            codes = split_codes(job.rule, np.arange(row0, row0 + len(ids)))
            row0 += len(ids)
            for s, split in enumerate(job.files):
                keep = codes == s
                n = int(keep.sum())
                if not n or at[s] + n > job.first_rows[s] + job.rows[s]:
                    at[s] += n
                    continue
                kept_ids = ids[keep]  # one selection, then a column per feature
                columns = [chunk.labels[keep], chunk.dense[keep],
                           *(kept_ids[:, f] for f in range(NUM_CATEGORICAL))]
                for fd, column, dtype, row_bytes in zip(fds[s], columns, split.dtypes,
                                                        split.row_bytes):
                    data_bytes = np.ascontiguousarray(column.astype(dtype)).tobytes()
                    os.pwrite(fd, data_bytes, at[s] * row_bytes)
                at[s] += n
        for split_fds in fds:
            for fd in split_fds:
                os.fdatasync(fd)
    finally:
        for fd in (fd for split_fds in fds for fd in split_fds):
            os.close(fd)
    written = [a - f for a, f in zip(at, job.first_rows)]
    if written != list(job.rows):
        raise DataError(f"{job.task.path}: has {sum(written):,} rows now and had "
                        f"{sum(job.rows):,} when counted: it changed while being preprocessed; "
                        f"run again with --restart")
    return written
