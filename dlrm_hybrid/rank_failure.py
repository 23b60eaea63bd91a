"""A rank's one-line error handed to the launcher, and what the launcher says when ranks fail.

torchrun gives each worker a file to describe its failure in (TORCHELASTIC_ERROR_FILE) and
reads it back when the worker exits non-zero; a rank that stops on a UserError writes its
`error: ...` line there, so `dlrm_hybrid.torchrun` knows which rank failed first and why, and
exits with that rank's code instead of torchrun's 1 and its ChildFailedError traceback.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Optional, Tuple

if TYPE_CHECKING:  # torch is the launcher's import, not the CLI's at start
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

KIND = "dlrm_hybrid user error"


def record(line: str) -> None:
    """Under torchrun, leave `line` in this worker's error file (torchrun's plain-message
    format: the message is a string); elsewhere nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with open(path, "w") as file:
            json.dump({"message": line, "timestamp": int(time.time()), "kind": KIND}, file)


def peer_error() -> Optional[str]:
    """Under torchrun, the user-error line another rank of this attempt recorded (its error file
    beside this rank's), or None. A rank whose collective broke because a peer stopped on a user
    error (a data file only it reads, mid-run) says that line instead of gloo's 80-line
    traceback, which would otherwise end the output below the cause."""
    own = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not own:
        return None
    for other in sorted(Path(own).parent.parent.glob(f"*/{Path(own).name}")):
        try:
            data = json.loads(other.read_text()) if other != Path(own) else {}
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("kind") == KIND:
            return str(data.get("message"))
    return None


def summary(failures: Dict[int, ProcessFailure]) -> Tuple[Optional[str], int]:
    """(the line to end with, or None where the ranks' output already ends with it; the exit
    code) for the failed ranks of one torchrun job: global rank -> ProcessFailure, in the order
    torchrun saw them end (those it stopped itself come last).

    The first rank that recorded a user error is the cause (the others were stopped or repeat
    it); it printed its line, which is repeated only where another rank crashed too and may have
    buried it under a traceback. Without a recorded error, the first rank that ended is named
    (its own output, a traceback, says why), with its exit code or 128 + its signal."""
    said = [f for f in failures.values() if _recorded(f)]
    if said:
        crashed = any(f.exitcode > 0 and not _recorded(f) for f in failures.values())
        return (said[0].message if crashed else None), said[0].exitcode
    rank, first = next(iter(failures.items()))
    if first.exitcode > 0:
        return f"error: rank {rank} exited with code {first.exitcode}", first.exitcode
    return f"error: rank {rank} was killed by {first.signal_name()}", 128 - first.exitcode


def _recorded(failure: ProcessFailure) -> bool:
    return failure.error_file_data.get("kind") == KIND
