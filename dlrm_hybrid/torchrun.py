"""torchrun as the launch scripts and `make demo` run it: `python -m dlrm_hybrid.torchrun ARGS`
takes torchrun's own arguments. The differences, all about how a job that cannot run ends:

- `-m dlrm_hybrid train|eval ...`: the config is checked once before torchrun starts
  (preflight.py); a mistake is one `error: ...` line and exit 2, as without torchrun.
- Ranks that fail: the first rank's `error: ...` line stays the last line, and the exit code is
  that rank's (2 for a user error), not torchrun's 1 after its ~45-line ChildFailedError
  traceback and notices (rank_failure.py). A rank's own traceback is its own output, kept.
- A signal (Ctrl-C, a scheduler's SIGTERM): torchrun passes it on to the ranks, waits for them
  (they stop at a step, write a checkpoint and say so in one line), and then raises
  `SignalException`, whose traceback would bury that line; here it exits with 128 + the
  signal's number instead, as the ranks do, and prints nothing more.

And threads: without OMP_NUM_THREADS each rank gets its share of the host's cores less one for
its loader thread (threads.py), where torchrun would give several ranks 1 thread each (with a
4-line notice, which setting it first also spares) and one rank every core, which another
process on one core slows 3-4x.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.preflight import check_launch
from dlrm_hybrid.threads import ENV, default_threads

# What torchrun's agent logs when a rank fails: the failure (said again at the end, or the
# rank's own output says it) and its stopping the other ranks.
AGENT_NOTICES = ("failed (exitcode: ", "Sending process ")


def run(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        check_launch(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run as torchrun

    from dlrm_hybrid.rank_failure import summary

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not str(record.msg).startswith(AGENT_NOTICES))
    try:
        args = parse_args(argv)
        set_rank_threads(args.nproc_per_node)
        torchrun(args)  # torchrun's main() less its @record, which logs the failure
    except SignalException as stopped:
        sys.exit(128 + int(stopped.sigval))
    except ChildFailedError as failed:
        line, code = summary(failed.failures)
        if line:
            print(line, file=sys.stderr)
        sys.exit(code)


def set_rank_threads(nproc_per_node: str) -> None:
    """OMP_NUM_THREADS for the ranks torchrun starts on this host, unless the user set it."""
    from torch.distributed.run import determine_local_world_size

    if os.environ.get(ENV, "").strip():
        return
    try:
        ranks = determine_local_world_size(nproc_per_node)
    except ValueError:  # torchrun says what is wrong with it
        return
    os.environ[ENV] = str(default_threads(ranks))


if __name__ == "__main__":
    run()
