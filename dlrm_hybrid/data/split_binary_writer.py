"""Writing split-binary datasets (the layout `split_binary.py` reads), atomically."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.feature_spec import SPLITS, FeatureSpec
from dlrm_hybrid.data.spec import DataSpec


class SplitBinaryWriter:
    """Appends samples to a dataset being built in a temporary folder next to `output`, and
    moves it into place only in `finish()` (or at the end of a `with` block that raised
    nothing): an interrupted run leaves no half dataset."""

    def __init__(self, output: str, spec: DataSpec, splits: Sequence[str] = SPLITS) -> None:
        self.output = Path(output)
        if self.output.exists() and any(self.output.iterdir()):
            raise ConfigError(f"--output: {output} exists and is not empty; choose a new folder")
        self.tmp = self.output.with_name(f".{self.output.name}.partial-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.fspec = FeatureSpec.default(self.tmp, spec, splits)
        self.counts = {s: 0 for s in splits}
        self._files: Dict[Path, object] = {}
        for split in splits:
            (self.tmp / split).mkdir(parents=True)

    def write(self, split: str, labels: np.ndarray, dense: np.ndarray,
              categorical: List[np.ndarray], true_prob: Optional[np.ndarray] = None) -> None:
        """`labels` [N], `dense` [N, num_dense], `categorical[i]` [N, hotness_i] (ids < rows_i)."""
        files = self.fspec.splits[split]
        self._append(files.label, labels.astype(np.bool_))
        self._append(files.numerical, dense.astype(np.float16))
        for path, ids, dtype in zip(files.categorical, categorical, self.fspec.categorical_dtypes):
            self._append(path, ids.astype(dtype))
        if true_prob is not None:
            path = self.fspec.true_prob.setdefault(split, self.tmp / split / "true_prob.bin")
            self._append(path, true_prob.astype(np.float32))
        self.counts[split] += len(labels)

    def _append(self, path: Path, array: np.ndarray) -> None:
        if path not in self._files:
            self._files[path] = open(path, "wb")
        self._files[path].write(np.ascontiguousarray(array).tobytes())

    def __enter__(self) -> "SplitBinaryWriter":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """Finish after a clean block; after any exception (Ctrl-C too) leave nothing behind."""
        if error_type is None:
            self.finish()
        else:
            self.abort()

    def add_file(self, name: str, text: str) -> None:
        """A file (a report, say) that moves into place with the dataset."""
        (self.tmp / name).write_text(text)

    def finish(self) -> None:
        for f in self._files.values():
            f.close()
        for split in self.fspec.splits:  # splits never written still get their (empty) files
            for path in [self.fspec.splits[split].label, self.fspec.splits[split].numerical,
                         *self.fspec.splits[split].categorical]:
                path.touch()
        self.fspec.save()
        _move_into_place(self.tmp, self.output)

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _move_into_place(tmp: Path, output: Path) -> None:
    # feature_spec.yaml holds paths relative to itself, so the folder can move as a whole.
    if output.exists():
        output.rmdir()  # empty (checked at the start)
    tmp.rename(output)
