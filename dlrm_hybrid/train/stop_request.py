"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send before they
preempt a job; torchrun passes either on to its workers).

The first signal asks for a stop: every rank finishes its step, the ranks agree on the step to
stop after, the loop writes a checkpoint and raises `RunStopped`, and the process exits with
128 + the signal's number (130, 143), the shell's code for "ended by this signal": a scheduler
sees a run that did not finish, and the same command resumes it.

One rank may get the signal a step later than another, so they agree through a one-number
all-reduce on a gloo group (the CPU: no GPU sync), started at each step boundary and read at the
next, while a step trains: waiting for it at each boundary cost ~0.2 ms per step (median, 2
loaded CPU ranks), starting it and reading the one before ~0.07 ms. The stop comes a step later.

A second Ctrl-C ends the process at once, as does `train.stop_grace_s` running out (a stop that
cannot finish before the scheduler's SIGKILL, e.g. a peer that died). A thread watches the
signals through `signal.set_wakeup_fd`, so this works while the main thread waits in a
collective. Under torchrun a second Ctrl-C reaches the workers as SIGTERM (torchrun's shutdown
after the SIGINT it passed on), so SIGTERM after SIGINT counts as a second Ctrl-C. A repeated
SIGTERM is ignored: SLURM signals every process of a job step and torchrun passes the signal on
as well, so one preemption arrives twice.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import NoReturn, Optional, Tuple

import torch
import torch.distributed as dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(Exception):
    """The run stopped on a signal after writing a checkpoint; exit with `exit_code`."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"stopped at step {step} ({signal.Signals(signum).name})")
        self.step, self.exit_code = step, 128 + signum


MLPERF_HINT = ("an MLPerf run is not resumed: start anew with another train.mlperf_log and "
               "checkpoint.resume=none")


def resume_hint(resume: str, mlperf: bool = False) -> str:
    """How to continue a stopped run: `checkpoint.resume` auto finds the newest checkpoint; an
    MLPerf run (train.mlperf_log) refuses to resume one."""
    if mlperf:
        return MLPERF_HINT
    if resume == "auto":
        return "resume with the same command"
    return "resume with the same command and --set checkpoint.resume=auto"


class StopRequest:
    """Signal handling for one training run, as a context manager (on leaving, the handlers it
    replaced are back); `agreed` at each step boundary."""

    def __init__(self, grace_s: float, is_main: bool, resume: str, mlperf: bool = False) -> None:
        self.grace_s, self.is_main, self.resume, self.mlperf = grace_s, is_main, resume, mlperf
        self.signum: Optional[int] = None  # the first signal received on this rank
        self.step = 0  # the last finished step, for the line of a stop at once
        # (work, flag) of the all-reduce started at the last boundary
        self._pending: Optional[Tuple[dist.Work, torch.Tensor]] = None

    def __enter__(self) -> "StopRequest":
        """Collective (it makes the agreement's group); main thread only."""
        self._group = dist.new_group(backend="gloo")  # a CPU all-reduce even on NCCL runs
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._saved = {sig: signal.signal(sig, _ignore) for sig in SIGNALS}
        self._saved_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="stop-request", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, error, *exc) -> None:
        if self._pending is not None and error is None:  # every rank started it: it ends
            self._pending[0].wait()
        signal.set_wakeup_fd(self._saved_fd)
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._writer.send(b"\0")  # not a signal: the watcher's cue to end
        self._thread.join()
        self._reader.close()
        self._writer.close()
        dist.destroy_process_group(self._group)

    def agreed(self) -> int:
        """Collective, at each step boundary: the signal some rank had received by the boundary
        before (the highest number if several), or 0 to go on."""
        signum = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            signum = int(flag.item())
        self._pending = None
        if not signum:
            flag = torch.tensor([self.signum or 0], dtype=torch.int32)
            self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group,
                                             async_op=True), flag)
        return signum

    def _watch(self) -> None:
        first, deadline = 0, None  # the first signal and when the stop must be over
        while True:
            self._reader.settimeout(None if deadline is None else
                                    max(deadline - time.monotonic(), 0.0))
            try:
                received = self._reader.recv(64)
            except socket.timeout:
                self._exit_now(first, f"not stopped within train.stop_grace_s={self.grace_s:g}")
            for signum in received:
                if signum == 0:
                    return
                if signum not in SIGNALS:
                    continue
                if not first:
                    first, deadline = signum, time.monotonic() + self.grace_s
                    self.signum = signum
                    self._say_stopping(signum)
                elif signal.SIGINT in (signum, first):
                    self._exit_now(signum, "a second Ctrl-C")

    def _say_stopping(self, signum: int) -> None:
        """A user who pressed Ctrl-C sees at once that it was heard and what comes next."""
        if self.is_main:
            print(f"{signal.Signals(signum).name}: stopping after the step the ranks agree on, "
                  f"with a checkpoint (within train.stop_grace_s={self.grace_s:g}; Ctrl-C again "
                  f"to stop at once)", flush=True)

    def _exit_now(self, signum: int, why: str) -> NoReturn:
        """End the process from the watcher thread: the newest complete checkpoint is kept."""
        if self.is_main:
            hint = (MLPERF_HINT if self.mlperf else
                    f"{resume_hint(self.resume)}: it continues from the newest checkpoint")
            print(f"stopped at once after step {self.step} ({why}), without a checkpoint of "
                  f"it; {hint}", flush=True)
        sys.stderr.flush()
        os._exit(128 + signum)


def _ignore(signum, frame) -> None:
    """A Python-level handler, so that the signal reaches the wakeup fd (the watcher acts)."""
