"""Writing split-binary datasets (the layout `split_binary.py` reads), atomically."""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.feature_spec import LABEL, MISSING, SPLITS, FeatureSpec, check_label_names
from dlrm_hybrid.data.spec import DataSpec

REPORT = "preprocess_report.json"  # what the preprocess commands say about a dataset, beside it
# files kept open at once: a history of 4,095 slots has 8,190 columns per split, more than a
# process may open (20,000 on the machine that found it); the rest are closed, reopened to append
MAX_OPEN = 1024


def check_new_output(output) -> None:
    """`output` is free for a new dataset: missing, or an empty folder (not a file)."""
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output: {output} exists and is not empty; choose a new folder")
    check_output_folders(output)


def check_output_folders(output) -> None:
    """No folder `output` would be made in is a file (else a traceback, maybe after the work)."""
    above = next((p for p in Path(output).absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise ConfigError(f"--output: {output} cannot be made: {above} is a file; choose a "
                          f"folder")


class SplitBinaryWriter:
    """Appends samples to a dataset being built in a temporary folder next to `output`, and
    moves it into place only in `finish()` (or at the end of a `with` block that raised
    nothing): an interrupted run leaves no half dataset. `labels`: the label names (one: NVIDIA's
    single `label`, read as the task click); a label with a missing value (NaN) anywhere is
    declared int8 with missing -1 (its bytes are those of a bool label otherwise)."""

    def __init__(self, output: str, spec: DataSpec, splits: Sequence[str] = SPLITS,
                 labels: Sequence[str] = (LABEL,)) -> None:
        self.output = Path(output)
        check_label_names(labels, "--output")
        check_new_output(output)
        remove_stale_partials(self.output)
        self.tmp = self.output.with_name(partial_name(self.output.name))
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.fspec = FeatureSpec.default(self.tmp, spec, splits, labels)
        if len(labels) > 1:
            self.fspec.true_prob_labels = tuple(labels)
        self.counts = {s: 0 for s in splits}
        self._files: Dict[Path, object] = {}  # open, least recently used first
        self._written: Set[Path] = set()
        for split in splits:
            (self.tmp / split).mkdir(parents=True)

    def write(self, split: str, labels: np.ndarray, dense: np.ndarray,
              categorical: List[np.ndarray], true_prob: Optional[np.ndarray] = None) -> None:
        """`labels` [N] (one label) or [N, labels] (NaN: missing), `dense` [N, num_dense],
        `categorical[i]` [N, hotness_i] (ids < rows_i), `true_prob` [N] or [N, labels]."""
        files = self.fspec.splits[split]
        labels = np.asarray(labels, dtype=np.float32)
        labels = labels[:, None] if labels.ndim == 1 else labels
        if labels.shape[1] != len(files.labels):
            raise ValueError(f"{labels.shape[1]} label columns for {len(files.labels)} labels")
        missing = np.isnan(labels)
        for column, (path, label) in enumerate(zip(files.labels, self.fspec.labels)):
            if missing[:, column].any():
                label.missing = MISSING
            self._append(path, np.where(missing[:, column], MISSING, labels[:, column] != 0
                                        ).astype(np.int8))
        self._append(files.numerical, dense.astype(np.float16))
        for path, ids, dtype in zip(files.categorical, categorical, self.fspec.categorical_dtypes):
            self._append(path, ids.astype(dtype))
        if true_prob is not None:
            path = self.fspec.true_prob.setdefault(split, self.tmp / split / "true_prob.bin")
            self._append(path, true_prob.astype(np.float32))
        self.counts[split] += len(labels)

    def _append(self, path: Path, array: np.ndarray) -> None:
        if path not in self._files:
            if len(self._files) >= MAX_OPEN:  # the longest unused first (dicts keep order)
                self._files.pop(next(iter(self._files))).close()
            self._files[path] = open(path, "ab" if path in self._written else "wb")
            self._written.add(path)
        else:
            self._files[path] = self._files.pop(path)  # the most recently used last
        self._files[path].write(np.ascontiguousarray(array).tobytes())

    def __enter__(self) -> "SplitBinaryWriter":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """Finish after a clean block; after any exception (Ctrl-C too) leave nothing behind."""
        if error_type is None:
            self.finish()
        else:
            self.abort()

    def note(self, key: str, value) -> None:
        """A fact about the data (e.g. how day 23 was split), kept in feature_spec.yaml's
        metadata."""
        self.fspec.notes[key] = value

    def add_file(self, name: str, text: str) -> None:
        """A file (a report, say) that moves into place with the dataset."""
        (self.tmp / name).write_text(text, encoding="utf-8")

    def finish(self) -> None:
        for f in self._files.values():
            f.close()
        for split in self.fspec.splits:  # splits never written still get their (empty) files
            for path in [*self.fspec.splits[split].labels, self.fspec.splits[split].numerical,
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


def partial_name(name: str) -> str:
    """`.NAME.partial-HOST-PID`: the host too, because the folder may sit on storage that
    several machines share, and whether a PID is alive can be told only on its own machine."""
    return f".{name}.partial-{socket.gethostname()}-{os.getpid()}"


def remove_stale_partials(output: Path) -> None:
    """Remove the temporary folders of earlier writers of `output` on this host whose process is
    gone (killed by SIGKILL or a crash of the machine, nothing could clean up); a live writer's
    folder and another host's stay. Folders named `.NAME.partial-PID` (no host) come from older
    versions, which ran on this host as far as anyone can tell."""
    pattern = re.compile(rf"\.{re.escape(output.name)}\.partial-(?:(?P<host>.+)-)?(?P<pid>\d+)")
    try:
        siblings = list(output.parent.iterdir())
    except OSError:
        return  # no parent folder yet: nothing stale in it
    for path in siblings:
        match = pattern.fullmatch(path.name)
        if match and match["host"] in (None, socket.gethostname()) and \
                not _alive(int(match["pid"])) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            print(f"removed {path}: left by process {match['pid']}, which is gone", flush=True)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except OverflowError:
        return False  # no such PID can exist
    return True
