"""torchrun as the launch scripts and `make demo` run it: `python -m dlrm_hybrid.torchrun ARGS`
takes torchrun's own arguments. The one difference: when a signal (Ctrl-C, a scheduler's
SIGTERM) stops the job, torchrun passes it on to the ranks, waits for them (they stop at a step,
write a checkpoint and say so in one line), and then raises `SignalException`, whose ~30-line
traceback would bury that line and exit 1; here it exits with 128 + the signal's number instead,
as the ranks do, and prints nothing more."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main


def run() -> None:
    try:
        main()
    except SignalException as stopped:
        sys.exit(128 + int(stopped.sigval))


if __name__ == "__main__":
    run()
