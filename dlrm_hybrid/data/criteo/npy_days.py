"""`python -m dlrm_hybrid preprocess npy`: torchrec/MLPerf Criteo day files (.npy) into the
split-binary layout.

Input folder: `day_N_dense.npy` (float [N, 13]), `day_N_sparse.npy` (integer [N, 26], ids
already made contiguous, e.g. by torchrec's `sparse_to_contiguous` or MLPerf's modulo) and
`day_N_labels.npy` ([N] or [N, 1], 0/1).
- Dense: torchrec's `BinaryCriteoUtils.tsv_to_npys` already stores log(x + 3) as float32, so the
  default `--dense-transform none` only casts to float16; `log` applies the TSV preprocessing's
  log(max(x, 0) + 3) to files of raw counts. Values not finite in float16 (torchrec does not
  clamp, so x = -3 gives log(0); raw counts above 65504 with `none`) are written as 0 and counted.
- Splits as for the TSV day files (`--split`): days (auto, the default, is days here): day
  23's first ceil(N/2) rows -> validation, the rest -> test (torchrec's and the MLPerf
  reference's rule, recorded as feature_spec.yaml's `metadata.day_23`), every other day ->
  train, and days without day 23 are refused before any writing; hash: the seeded 90/5/5 split by global
  row number. A split left with no rows is refused.
- Cardinality of a feature = 1 + its largest id over all days: one pass over the memory-mapped
  sparse files finds the maxima, a second writes; both go CHUNK_ROWS rows at a time.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo.day23 import NOT_DAYS, RULE_KEY, VALIDATION_FIRST
from dlrm_hybrid.data.criteo.budget import own_peak_rss
from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL, NUM_NUMERICAL
from dlrm_hybrid.data.criteo.preprocess_report import summary_line
from dlrm_hybrid.data.criteo.progress import Progress
from dlrm_hybrid.data.criteo.splits import (SPLIT_MODES, SplitRule, add_split_arguments,
                                            check_days, check_splits_filled, day_rule, split_codes)
from dlrm_hybrid.data.feature_spec import SPLITS
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import REPORT, SplitBinaryWriter, check_new_output
from dlrm_hybrid.errors import DataError

DAY_FILE = re.compile(r"day_(\d+)_(dense|sparse|labels)\.npy")
PARTS = ("dense", "sparse", "labels")
TRANSFORMS = ("none", "log")
CHUNK_ROWS = 1 << 20


@dataclass
class Day:
    """One day's three arrays, memory-mapped."""
    number: int
    folder: Path
    dense: np.ndarray  # [N, 13]
    sparse: np.ndarray  # [N, 26]
    labels: np.ndarray  # [N]

    def path(self, part: str) -> Path:
        return self.folder / f"day_{self.number}_{part}.npy"


def find_days(folder: Path) -> List[Day]:
    """The days in `folder`, in order, memory-mapped and shape-checked."""
    try:
        names = os.listdir(folder)
    except OSError as e:
        raise ConfigError(f"--input: cannot read the folder {folder} ({e.strerror})") from None
    days = sorted({int(m.group(1)) for m in map(DAY_FILE.fullmatch, names) if m})
    if not days:
        raise DataError(f"{folder}: no day_N_dense/sparse/labels.npy files; point --input at "
                        f"torchrec's .npy folder")
    return [_open_day(folder, day) for day in days]


def _open_day(folder: Path, day: int) -> Day:
    arrays = {}
    multi_hot = folder / f"day_{day}_sparse_multi_hot.npz"  # the reference's materialized days
    if multi_hot.exists() and not (folder / f"day_{day}_sparse.npy").exists():
        raise DataError(f"{multi_hot}: the MLPerf reference's multi-hot ids, which preprocess npy "
                        f"does not read; give the one-hot day_N_sparse.npy files, then "
                        f"`preprocess multihot` (it builds the same ids)")
    for part in PARTS:
        path = folder / f"day_{day}_{part}.npy"
        try:
            arrays[part] = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot read as .npy ({e}); every day needs dense, sparse "
                            f"and labels files") from None
    for part in ("dense", "labels"):  # text would convert until its first empty string
        if arrays[part].dtype.kind not in "biuf":
            raise DataError(f"{folder / f'day_{day}_{part}.npy'}: values of type "
                            f"{arrays[part].dtype.str}, not numbers; save the {part} array as "
                            f"numbers")
    rows = len(arrays["labels"])
    shapes = {"dense": (rows, NUM_NUMERICAL), "sparse": (rows, NUM_CATEGORICAL)}
    for part, shape in shapes.items():
        if arrays[part].shape != shape:
            raise DataError(f"{folder}/day_{day}_{part}.npy: shape {arrays[part].shape}, "
                            f"expected {shape} to match day_{day}_labels.npy")
    integer_ids = arrays["sparse"].dtype.kind in "iu"
    if arrays["labels"].shape not in ((rows,), (rows, 1)) or not integer_ids:
        raise DataError(f"{folder}: day_{day} needs labels of shape [N] or [N, 1] and integer "
                        f"sparse ids")
    return Day(day, folder, arrays["dense"], arrays["sparse"], arrays["labels"].reshape(-1))


def cardinalities(days: List[Day]) -> List[int]:
    """1 + the largest id of each feature over all days."""
    top = np.full(NUM_CATEGORICAL, -1, np.int64)
    for day in days:
        for lo in range(0, len(day.sparse), CHUNK_ROWS):
            chunk = np.asarray(day.sparse[lo:lo + CHUNK_ROWS])
            if chunk.min() < 0:
                raise DataError(f"{day.path('sparse')}: negative ids in rows from {lo}; ids must "
                                f"be 0.. (make them contiguous first)")
            top = np.maximum(top, chunk.max(axis=0))
    return (top + 1).clip(min=1).tolist()


def split_jobs(days: List[Day], mode: str, seed: int) -> List[Tuple[SplitRule, int]]:
    """(rule, number of its first row) per day: 0 for the days split, the global row number of
    the day's first row for the hash split."""
    if mode == "days":
        return [(day_rule(day.number, len(day.labels)), 0) for day in days]
    starts = np.cumsum([0] + [len(day.labels) for day in days[:-1]])
    return [(SplitRule("hash", seed), int(start)) for start in starts]


def _write_day(writer: SplitBinaryWriter, day: Day, rule: SplitRule, row0: int, transform: str,
               progress: Progress) -> int:
    """Append one day to its splits; returns how many dense values were not finite."""
    nonfinite = 0
    for lo in range(0, len(day.labels), CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, len(day.labels))
        labels = np.asarray(day.labels[lo:hi])
        if ((labels != 0) & (labels != 1)).any():
            raise DataError(f"{day.path('labels')}: a label other than 0 or 1 in rows "
                            f"{lo}..{hi - 1}")
        dense = np.asarray(day.dense[lo:hi], np.float32)
        if transform == "log":
            dense = np.log(np.maximum(dense, 0) + np.float32(3))
        dense = dense.astype(np.float16)
        bad = ~np.isfinite(dense)
        dense[bad], nonfinite = 0, nonfinite + int(bad.sum())
        sparse = np.asarray(day.sparse[lo:hi])
        codes = split_codes(rule, np.arange(row0 + lo, row0 + hi))
        for code, split in enumerate(SPLITS):
            keep = codes == code
            writer.write(split, labels[keep], dense[keep], [sparse[keep][:, i:i + 1] for i in range(sparse.shape[1])])
        progress.add(hi - lo)
    return nonfinite


def convert_npy_days(input_dir, output, dense_transform: str = "none", split: str = "auto",
                     split_seed: int = 0) -> dict:
    """Day .npy files in `input_dir` -> split-binary dataset at `output`; returns the report it
    also writes to `output/preprocess_report.json`. `split`: one of SPLIT_MODES (all inputs are
    day files, so auto is days)."""
    if dense_transform not in TRANSFORMS:
        raise ConfigError(f"--dense-transform: {dense_transform!r} is not one of "
                          f"{', '.join(TRANSFORMS)}")
    if split not in SPLIT_MODES:
        raise ConfigError(f"--split: {split!r} is not one of {', '.join(SPLIT_MODES)}")
    split = "days" if split == "auto" else split
    check_new_output(output)
    start = time.perf_counter()
    days = find_days(Path(input_dir))
    if split == "days":
        check_days([day.number for day in days], "add day_23_{dense,sparse,labels}.npy")
    spec = DataSpec(NUM_NUMERICAL, cardinalities(days), [1] * NUM_CATEGORICAL)
    with SplitBinaryWriter(str(output), spec) as writer:
        progress = Progress("write")
        nonfinite = sum(_write_day(writer, day, rule, row0, dense_transform, progress)
                        for day, (rule, row0) in zip(days, split_jobs(days, split, split_seed)))
        progress.done()
        check_splits_filled(writer.counts, split)
        day_23 = VALIDATION_FIRST if split == "days" else NOT_DAYS
        writer.note(RULE_KEY, day_23)
        report = {"input": str(input_dir), "days": [d.number for d in days],
                  **speed_report(start, writer.counts), "cardinalities": spec.cardinalities,
                  "dense_transform": dense_transform, "nonfinite_dense": nonfinite,
                  "split": split, RULE_KEY: day_23}
        writer.add_file(REPORT, json.dumps(report, indent=2) + "\n")
    return report


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True, metavar="DIR",
                        help="folder of day_N_dense.npy, day_N_sparse.npy, day_N_labels.npy")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--dense-transform", choices=TRANSFORMS, default="none",
                        help="none: dense is torchrec's log(x + 3) already (default); "
                             "log: raw counts, apply log(max(x, 0) + 3)")
    add_split_arguments(parser)


def run(args) -> None:
    report = convert_npy_days(args.input, args.output, args.dense_transform, args.split,
                              args.split_seed)
    if report["nonfinite_dense"]:
        print(f"warning: {report['nonfinite_dense']} dense values were not finite in float16 and "
              f"were written as 0 (raw counts need --dense-transform log)")
    print(f"wrote {args.output} (report: {REPORT})")
    print(summary_line(report))


def speed_report(start: float, counts: dict) -> dict:
    """Rows written (total and per split), seconds since `start`, rows/s and peak memory."""
    seconds, total = time.perf_counter() - start, sum(counts.values())
    return {"rows_written": {"total": total, **counts}, "seconds": round(seconds, 3),
            "rows_per_s": round(total / max(seconds, 1e-9), 1), "peak_rss_bytes": own_peak_rss()}
