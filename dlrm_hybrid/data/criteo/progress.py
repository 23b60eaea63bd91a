"""Progress lines for long preprocessing runs."""

from __future__ import annotations

import sys
import time
from typing import Sequence

PROGRESS_SECONDS = 10.0


class Progress:
    """Prints `what: N rows, R rows/s` at most every PROGRESS_SECONDS, and at done()."""

    def __init__(self, what: str) -> None:
        self.what, self.rows = what, 0
        self.start = self.last = time.perf_counter()

    def add(self, rows: int) -> None:
        self.rows += rows
        if time.perf_counter() - self.last >= PROGRESS_SECONDS:
            self.done()

    def done(self) -> None:
        self.last = time.perf_counter()
        rate = self.rows / max(self.last - self.start, 1e-9)
        print(f"{self.what}: {self.rows:,} rows, {rate:,.0f} rows/s", flush=True)


class JobProgress:
    """The whole job's progress over its passes, each reading every input byte once: percent,
    rows/s and MB/s of the current pass, and an ETA for the job from the bytes left in all
    passes. On a terminal one line is rewritten; in a log a line every PROGRESS_SECONDS."""

    def __init__(self, passes: Sequence[str], total_bytes: int) -> None:
        self.passes, self.total = list(passes), max(total_bytes, 1)
        self.done_bytes = [0] * len(self.passes)  # per pass, with work earlier runs did
        self.tty = sys.stdout.isatty()
        self.start = self.last = time.perf_counter()
        self.pass_index, self.rows, self.bytes = 0, 0, 0
        self.pass_start = self.start
        self.job_bytes_start = sum(self.done_bytes)

    def begin(self, index: int) -> None:
        self.pass_index, self.rows, self.bytes = index, 0, 0
        self.pass_start = time.perf_counter()

    def add(self, rows: int, nbytes: int, fresh: bool = True) -> None:
        """A task done: by this run (`fresh`), or found done by an earlier one (not in the
        rates)."""
        self.done_bytes[self.pass_index] += nbytes
        if not fresh:
            self.job_bytes_start += nbytes
            return
        self.rows += rows
        self.bytes += nbytes
        now = time.perf_counter()
        if now - self.last >= (0.5 if self.tty else PROGRESS_SECONDS):
            self.last = now
            self._print(now, end="\r" if self.tty else "\n")

    def end(self) -> dict:
        """Print the pass's last line; its seconds, rows/s and MiB/s."""
        now = time.perf_counter()
        self._print(now, end="\n")
        seconds = now - self.pass_start
        return {"seconds": round(seconds, 3), "rows": self.rows,
                "rows_per_s": round(self.rows / max(seconds, 1e-9), 1),
                "mib_per_s": round(self.bytes / 2**20 / max(seconds, 1e-9), 1)}

    def _print(self, now: float, end: str) -> None:
        seconds = max(now - self.pass_start, 1e-9)
        done = self.done_bytes[self.pass_index] / self.total
        job_done = sum(self.done_bytes) / (self.total * len(self.passes))
        rate = (sum(self.done_bytes) - self.job_bytes_start) / max(now - self.start, 1e-9)
        left = (self.total * len(self.passes) - sum(self.done_bytes)) / rate if rate else 0.0
        print(f"pass {self.pass_index + 1}/{len(self.passes)} ({self.passes[self.pass_index]}): "
              f"{done:6.1%} {self.rows:,} rows, {self.rows / seconds:,.0f} rows/s, "
              f"{self.bytes / 1e6 / seconds:,.1f} MB/s; job {job_done:.0%}, ETA "
              f"{_clock(left)}", end=end, flush=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
