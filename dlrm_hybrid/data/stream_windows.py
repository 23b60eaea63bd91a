"""Streaming in time order (`data.stream_window_s`): the training split, its rows in time order
(`preprocess yambda` keeps each row's time in `<split>/timestamp.bin`), trained once, window
after window, each window evaluated on data the model has not seen and that is later than every
row it trained on, as a model in production meets tomorrow's traffic.

Step s trains rows [s*B, (s+1)*B) (B: the global batch; the loader's unshuffled stream,
data/slices.py). Window k holds the rows whose time t has floor((t - t0) / W) = k (t0: the
first row's time, W the width in the rows' units); empty windows (gaps in the log) are skipped.
Window k's training ends at step floor(r / B), r its next window's first row: the last step whose
batch lies wholly before the next window. The evaluation after it reads the next window's rows
("next": all untrained, all later) or the validation split ("heldout"); the few rows of window k
after that step (fewer than B) open the next window's steps. Several windows ending at one step
(windows smaller than a batch) are evaluated once, on the window after the last of them. The
last window's next is the validation split, which the run's final evaluation reads.

The step alone fixes the window and the position in it, so a run resumed at any step replays
exactly; its checkpoint records both (`record`), and a resume checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.errors import DataError

CHUNK = 1 << 24  # rows of timestamp.bin checked for order at a time


@dataclass(frozen=True)
class StreamWindows:
    """The training split's windows: `starts[k]` is window k's first row (`starts[-1]`: the
    split's rows), `times[k]` its window's start time, in row-time units."""

    starts: np.ndarray
    times: np.ndarray
    batch: int

    @staticmethod
    def of(row_times: np.ndarray, width_s: float, unit_s: float, batch: int) -> "StreamWindows":
        width = width_s / unit_s
        if len(row_times) == 0:
            return StreamWindows(np.zeros(1, np.int64), np.zeros(0), batch)
        t0 = int(row_times[0])
        index = np.floor((row_times.astype(np.float64) - t0) / width).astype(np.int64)
        starts = np.flatnonzero(np.diff(index, prepend=-1)).astype(np.int64)
        return StreamWindows(np.append(starts, len(row_times)), t0 + index[starts] * width,
                             batch)

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    @property
    def steps(self) -> int:
        """One pass: every full global batch of the split."""
        return int(self.starts[-1]) // self.batch

    def at(self, step: int) -> Tuple[int, int]:
        """(window, rows of it trained) after `step` steps: the window the next row is in."""
        row = step * self.batch
        k = min(int(np.searchsorted(self.starts, row, side="right")) - 1, self.count - 1)
        return k, row - int(self.starts[k])

    def next_window(self, step: int) -> Optional[int]:
        """The window evaluated after `step`, if a window's training ends at it: the one after
        the last window ending there (None: none ends, or the last window, whose next is the
        validation split)."""
        ends = self.starts[1:-1] // self.batch  # window k's end step, k < count - 1
        hits = np.flatnonzero(ends == step)
        return int(hits[-1]) + 1 if len(hits) and step > 0 else None

    def rows(self, k: int) -> Tuple[int, int]:
        return int(self.starts[k]), int(self.starts[k + 1])

    def describe(self, width_s: float, evaluated_on: str, first: int, steps: int) -> str:
        """The run's stream in a line: its windows, where it starts, what windows are evaluated
        on (`data.stream_eval`), the rows left untrained."""
        k, into = self.at(first)
        evaluated = {"next": "each on the next window", "heldout": "each on the validation "
                     "split", "none": "not evaluated"}[evaluated_on]
        rows = int(self.starts[-1])
        left = rows - steps * self.batch
        windows = f"{self.count} window{'s' if self.count != 1 else ''}"
        return (f"streaming in time order: {windows} of {width_s:g} s over the training "
                f"split's {rows:,} rows, {steps} steps of {self.batch:,} from step {first} "
                f"(window {k}, {into:,} rows into it); windows {evaluated}"
                + (f"; the last {left:,} rows are not trained" if left else ""))

    def record(self, step: int) -> Dict[str, object]:
        """A checkpoint's record of where in the stream `step` is."""
        k, into = self.at(step)
        return {"window": k, "rows_into_window": into, "next_row": step * self.batch,
                "window_start_time": float(self.times[k]), "windows": self.count}

    def check_resume(self, recorded: Optional[dict], step: int, where: Path) -> None:
        """A resumed stream must stand where its checkpoint says it stood."""
        if recorded is None:
            raise ConfigError(f"data.stream_window_s: {where} was not trained in time-ordered "
                              f"windows; resume it with data.stream_window_s=0, or start anew")
        here = self.record(step)
        if any(recorded.get(key) != here[key] for key in ("window", "rows_into_window",
                                                          "next_row")):
            raise ConfigError(f"data.stream_window_s: {where} stopped in window "
                              f"{recorded.get('window')} at {recorded.get('rows_into_window')} "
                              f"rows into it, and these data and settings put step {step} in "
                              f"window {here['window']} at {here['rows_into_window']}; resume "
                              f"it with its own dataset and settings")


def stream_windows(dataset, width_s: float, batch: int) -> StreamWindows:
    """The windows of `dataset`'s training split (a split-binary folder with row times)."""
    fspec = getattr(dataset, "fspec", None)
    notes = fspec.notes if fspec is not None else {}
    if not notes.get("row_times"):
        where = (fspec.root if fspec is not None
                 else getattr(dataset, "root", "") or "the planted synthetic data")
        raise DataError(f"data.stream_window_s: {where} has no row times to cut windows by "
                        f"(feature_spec.yaml metadata.row_times); make the dataset with "
                        f"`dlrm_hybrid preprocess yambda`, or set data.stream_window_s=0")
    path = Path(fspec.root) / notes["row_times"]["train"]
    if "time_unit_s" not in notes:
        raise DataError(f"data.stream_window_s: {fspec.root}/feature_spec.yaml does not say "
                        f"the row times' unit (metadata.time_unit_s; datasets made before it was "
                        f"recorded): preprocess it again")
    times = np.memmap(path, np.uint32, "r") if path.stat().st_size else np.zeros(0, np.uint32)
    n = dataset.num_samples("train")
    if len(times) != n:
        raise DataError(f"{path}: {len(times):,} row times for a training split of {n:,} rows; "
                        f"the dataset is damaged: preprocess it again")
    for first in range(0, n, CHUNK):
        start = max(first - 1, 0)  # each piece overlaps the last by a row
        earlier = np.diff(times[start:first + CHUNK].astype(np.int64)) < 0
        if earlier.any():
            raise DataError(f"{path}: the training rows are not in time order (row "
                            f"{start + 1 + int(np.argmax(earlier))} is earlier than the one "
                            f"before it); streaming needs them sorted by time: preprocess it "
                            f"again")
    return StreamWindows.of(times, width_s, float(notes["time_unit_s"]), batch)
