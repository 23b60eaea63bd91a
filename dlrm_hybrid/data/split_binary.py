"""Reading split-binary datasets: one folder per split, one headerless file per column group.

`label.bin` (bool, 1 byte/sample; several labels: `label_<name>.bin`, int8 where -1 marks a
missing label), `numerical.bin` (float16, num_dense per sample, row-major),
`cat_<i>.bin` (hotness ids per sample in the smallest int type that holds the cardinality).
Sample counts come from file sizes. The files are memory-mapped, so a rank touches only the rows
of its own slices.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.batch import ClickDataset, Columns
from dlrm_hybrid.data.criteo.day23 import require_no_interrupted_upgrade
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.timeline_history import OFFSETS, TimelineHistory
from dlrm_hybrid.errors import DataError

SPLIT_NAMES = {"train": "train", "val": "validation", "test": "test"}  # ours -> folder names
# files up to this size are read into memory, not mapped: each mapping holds a descriptor, and a
# history of 4,095 slots has 8,190 files per split (24,570 in all; 20,000 descriptors here)
READ_WHOLE = 1 << 20


class SplitBinaryDataset(ClickDataset):
    """Reads a split-binary dataset; `batch(split, first, count)` as SyntheticClicks does."""

    def __init__(self, path: str) -> None:
        require_no_interrupted_upgrade(path)  # else validation and test could overlap
        self.fspec = load_feature_spec(path)
        self.spec = self.fspec.spec
        store = self.fspec.notes.get("history_store")
        self._history = (TimelineHistory(Path(path), int(self.fspec.notes["history"]["slots"]))
                         if store else None)
        self._user = (list(self.fspec.notes["categorical_features"]).index(
            self.fspec.notes.get("request_feature", "user_id")) if store else 0)
        self.label_names = self.fspec.label_names
        self._maps: Dict[str, dict] = {}
        self._rows_at: Dict[str, Tuple[str, int]] = {}  # a split's folder, its first row there
        self.sizes = {ours: self._open(folder) for ours, folder in SPLIT_NAMES.items()
                      if folder in self.fspec.splits}
        if "val" not in self.sizes and "test" in self.sizes:  # NVIDIA's datasets: train and test
            self.sizes["val"], self._maps["validation"] = self.sizes["test"], self._maps["test"]
            self._rows_at["validation"] = self._rows_at["test"]
        if "val" not in self.sizes:
            raise ConfigError(f"data.path: {path} has no validation or test split to evaluate on")
        self._maps["val"] = self._maps.pop("validation")
        self._rows_at["val"] = self._rows_at.pop("validation")

    def num_samples(self, split: str) -> int:
        return self.sizes[split]

    def add_rows(self, name: str, split: str, first: int, end: int) -> None:
        """Rows [first, end) of `split` read as a split of their own, `name` (views, no copy):
        a streamed run's next window (data/stream_windows.py)."""
        self._maps[name] = {key: [m[first:end] for m in maps] if isinstance(maps, list)
                            else maps[first:end] for key, maps in self._maps[split].items()}
        self.sizes[name] = end - first
        folder, offset = self._rows_at[split]
        self._rows_at[name] = (folder, offset + first)

    def _open(self, folder: str) -> int:
        files, spec = self.fspec.splits[folder], self.spec
        n = len(_memmap(files.label, np.int8, 1))
        maps = {"labels": [_memmap(p, np.uint8 if label.missing is None else np.int8, 1, n)
                           for p, label in zip(files.labels, self.fspec.labels)],
                "dense": _memmap(files.numerical, np.float16, spec.num_dense, n),
                "cats": [_memmap(p, d, h, n) for p, d, h in
                         zip(files.categorical, self.fspec.categorical_dtypes, spec.hotness)]}
        if self._history is not None:
            maps["offsets"] = _memmap(Path(self.fspec.root) / folder / OFFSETS, np.uint32, 1, n)
        if folder in self.fspec.true_prob:
            width = len(self.fspec.true_prob_labels) or len(self.label_names)
            maps["true_prob"] = _memmap(self.fspec.true_prob[folder], np.float32, width, n)
        for path, ids, rows in zip(files.categorical, maps["cats"], spec.cardinalities):
            if len(ids) and (ids[:1024].min() < 0 or ids[:1024].max() >= rows):
                raise DataError(f"{path}: ids outside [0, {rows}) of its cardinality in "
                                  f"feature_spec.yaml; the files do not match the spec")
        self._maps[folder] = maps
        self._rows_at[folder] = (folder, 0)
        return n

    def columns(self, split: str, first: int, count: int) -> Columns:
        """Samples [first, first + count) of `split`; indices past its end are padding (the
        last sample repeated, marked invalid). Labels [B] (one label, no tasks chosen) or
        [B, T] (the tasks `use_tasks` chose; else every label), NaN where missing."""
        maps, n = self._maps[split], self.sizes[split]
        if first + count <= n:  # one slice of each file, converted: its only copy
            take = lambda m, dtype: m[first:first + count].astype(dtype)  # noqa: E731
        else:  # padded: the last sample repeated
            index = np.minimum(np.arange(first, first + count), max(n - 1, 0))
            take = lambda m, dtype: m[index].astype(dtype)  # noqa: E731
        tasks = self.tasks or list(self.label_names)
        labels = np.concatenate([self._label(take(maps["labels"][self.label_names.index(t)],
                                                  np.float32), t, split, first)
                                 for t in tasks], axis=1)
        true_prob = (self._true_prob(take(maps["true_prob"], np.float32), tasks)
                     if "true_prob" in maps else None)
        if self.tasks is None and len(tasks) == 1:  # the one click label: [B]
            labels, true_prob = labels.reshape(-1), None if true_prob is None else true_prob.reshape(-1)
        cats = [take(m, np.int64) for m in maps["cats"]]
        if self._history is not None:  # the slots, from the timelines
            cats += [c[:, None] for c in self._history.columns(
                cats[self._user][:, 0], take(maps["offsets"], np.int64)[:, 0])]
        dense = take(maps["dense"], np.float32)
        self._require_finite(dense, split, first)
        return Columns(dense, labels, np.arange(first, first + count) < n, cats, true_prob)

    def _require_finite(self, dense: np.ndarray, split: str, first: int) -> None:
        """A nan or inf dense value (a float16 file holds at most 65504; a file made elsewhere
        may hold nan) named here: in training it would surface as a diverged loss, with advice
        to lower the learning rates. One pass over B x num_dense values: under 0.1 ms at 8,192."""
        bad = ~np.isfinite(dense)
        if bad.any():
            i, j = np.argwhere(bad)[0]
            folder, row = self._row(split, first, int(i))
            raise DataError(f"{self.fspec.splits[folder].numerical}: sample {row}'s dense value "
                            f"{j} is {dense[i, j]}, not finite; the file is damaged or was made "
                            f"by another tool: make the dataset again with `preprocess`")

    def _label(self, values: np.ndarray, task: str, split: str, first: int) -> np.ndarray:
        """A label column [B, 1] as float32, NaN where the file marks it missing. Any other
        value than 0 and 1 is named: a 2 would train as a target the loss pushes without bound,
        a stray byte of a bool file as a positive."""
        index = self.label_names.index(task)
        missing = self.fspec.labels[index].missing
        ok = (values == 0) | (values == 1) | (values == missing if missing is not None else False)
        if not ok.all():
            i = int(np.argwhere(~ok)[0, 0])
            folder, row = self._row(split, first, i)
            allowed = "0 or 1" + ("" if missing is None else f" ({missing}: missing)")
            raise DataError(f"{self.fspec.splits[folder].labels[index]}: sample {row}'s label "
                            f"is {values[i, 0]:g}, not {allowed}; the file is damaged or was "
                            f"made by another tool: make the dataset again with `preprocess`")
        return values if missing is None else np.where(values == missing, np.nan, values)

    def _row(self, split: str, first: int, i: int) -> Tuple[str, int]:
        """The folder and row there of the `i`-th sample read from `first` on (padding: the
        split's last)."""
        folder, offset = self._rows_at[split]
        return folder, offset + min(first + i, self.sizes[split] - 1)

    def _true_prob(self, table: np.ndarray, tasks: List[str]) -> np.ndarray:
        """[B, T]: each task's true probability, -1 (no oracle) for a task the file lacks."""
        order = list(self.fspec.true_prob_labels or self.label_names)
        return np.stack([table[:, order.index(t)] if t in order else np.full(len(table), -1.0,
                         np.float32) for t in tasks], axis=1)


def _memmap(path: Path, dtype, width: int, expected: Optional[int] = None) -> np.ndarray:
    size = path.stat().st_size if path.exists() else -1
    itemsize = np.dtype(dtype).itemsize * width
    if size < 0:
        raise DataError(f"{path}: missing; the dataset is incomplete")
    if size % itemsize or (expected is not None and size // itemsize != expected):
        got = size / itemsize
        want = f"{expected} samples like label.bin" if expected is not None else "whole samples"
        raise DataError(f"{path}: {size} bytes is {got:g} samples of {width} x "
                          f"{np.dtype(dtype).name}, expected {want}; the file is truncated or "
                          f"does not match feature_spec.yaml")
    if size == 0:
        return np.zeros((0, width), dtype=dtype)
    if size <= READ_WHOLE:  # read, not mapped: a mapping holds a file descriptor
        return np.fromfile(path, dtype=dtype).reshape(-1, width)
    # a plain ndarray over the mapping: np.memmap's own indexing costs ~10 us a call, per file
    # per batch (it kept the loader under 1.3M samples/s at batch 1024)
    return np.asarray(np.memmap(path, dtype=dtype, mode="r")).reshape(-1, width)
