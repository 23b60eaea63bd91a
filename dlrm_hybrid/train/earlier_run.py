"""A fresh run into a run directory that holds an earlier run: the earlier run's record and
checkpoints are moved into a folder of their own before the new run writes anything. Otherwise
the two runs' files would mix: `metrics.jsonl` overwritten, the new run's checkpoints pruned
in favour of the earlier run's higher steps, and a later `resume: auto` continuing the earlier
run. Nothing is deleted: re-running a job (e.g. `make demo`) keeps each earlier run, named by
when it last wrote. The run directory is one run's at a time (`RunDirLock`).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch.distributed as dist

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.train.checkpoint import checkpoint_root, vacant

RECORD = ("metrics.jsonl", "config.yaml", "plan.json", "sharding.json", "rank_*.jsonl",
          "tensorboard", "curves.png")


def set_aside_earlier_run(cfg, say: Callable[[str], None]) -> None:
    """Collective: rank 0 moves the earlier run's files, if any, and says where in one line."""
    if dist.get_rank() == 0:
        _set_aside(Path(cfg.train.run_dir), checkpoint_root(cfg), say)
    dist.barrier()


def _set_aside(run_dir: Path, root: Path, say: Callable[[str], None]) -> None:
    checkpoints = sorted([*root.glob("step_*"), *root.glob(".step_*.partial")])
    record = [p for pattern in RECORD for p in run_dir.glob(pattern)]
    if not checkpoints and not (run_dir / "metrics.jsonl").exists():
        return
    last_write = max(p.stat().st_mtime for p in [*checkpoints, *record])
    aside = vacant(run_dir / time.strftime("earlier_run_%Y%m%d-%H%M%S", time.localtime(last_write)))
    in_run_dir = root == run_dir / "checkpoints"
    checkpoints_aside = aside / "checkpoints" if in_run_dir else vacant(root / aside.name)
    _move(record, aside)
    _move(checkpoints, checkpoints_aside)
    elsewhere = "" if in_run_dir or not checkpoints else f" and its checkpoints to {checkpoints_aside}"
    say(f"{run_dir} held an earlier run: moved its files to {aside}{elsewhere}; this run starts "
        f"afresh")


def _move(paths: List[Path], folder: Path) -> None:
    if paths:
        folder.mkdir(parents=True)
        for path in paths:
            path.rename(folder / path.name)


class RunDirLock:
    """Rank 0's exclusive flocks on the run directory (and `checkpoint.dir`, where set) from just
    before the run first touches them (a run refused while planning leaves no directory) to its
    end: a second run into either (a job started twice, or again while the ranks of a SIGKILLed
    torchrun train on) stops in one line before it sets anything aside or writes. A file system
    without flock on folders (some network ones) leaves them unlocked."""

    def __init__(self) -> None:
        self._fds: List[int] = []

    def take(self, cfg) -> None:
        """Collective: every rank raises the UserError when another run holds one of them."""
        folders = [("train.run_dir", Path(cfg.train.run_dir))]
        if cfg.checkpoint.dir and (os.path.realpath(cfg.checkpoint.dir)
                                   != os.path.realpath(cfg.train.run_dir)):  # one lock a folder
            folders.append(("checkpoint.dir", Path(cfg.checkpoint.dir)))
        problem: List[Optional[str]] = [None]
        if dist.get_rank() == 0:
            problem = [next(filter(None, (self._lock(key, f) for key, f in folders)), None)]
        dist.broadcast_object_list(problem, src=0)
        if problem[0]:
            raise UserError(problem[0])

    def _lock(self, key: str, folder: Path) -> Optional[str]:
        """Why `folder` cannot be this run's (None: it is now)."""
        if folder.exists() and not folder.is_dir():
            return f"{key}: {folder} is a file; give a folder's path"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._fds.append(os.open(folder, os.O_RDONLY))
        except OSError as e:  # a file above it, say
            return f"{key}: {folder} cannot be made a folder ({e.strerror}); give a folder's path"
        try:
            fcntl.flock(self._fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return (f"{key}: {folder} is in use by another training run; wait for it to end "
                    f"(or stop its ranks), or use another {key}")
        except OSError:
            pass
        return None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        while self._fds:
            os.close(self._fds.pop())
