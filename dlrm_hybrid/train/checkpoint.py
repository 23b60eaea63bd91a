"""Checkpoints with torch.distributed.checkpoint (DCP): sharded tables, fused and dense optimizer
state, and the step (which fixes the LR schedule and the data position: batches are a function
of the step, and training draws no other random numbers).

DCP stores shards with their global offsets, so a checkpoint written by N ranks loads on M
ranks under another placement. A checkpoint is written to `.step_<n>.partial`, and published
by renaming it to `step_<n>` once every rank has finished and `meta.json` is in it: a run killed
while writing leaves the previous checkpoints as they were.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.errors import DataError

META, CONFIG = "meta.json", "config.yaml"
NAME = re.compile(r"step_(\d+)$")


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")


def save_checkpoint(root: Path, step: int, dmp, optimizer, env, cfg) -> Path:
    """Collective: every rank writes its shards; rank 0 adds the resolved config (so eval and
    export need nothing else), publishes and prunes."""
    final, partial = root / f"step_{step}", root / f".step_{step}.partial"
    if env.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save({"model": dmp.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=partial)
    dist.barrier()
    if env.is_main:
        cfg.save(partial / CONFIG)
        (partial / META).write_text(json.dumps({"step": step, "world_size": env.world_size}))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in complete_checkpoints(root)[:-cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def complete_checkpoints(root: Path):
    """Published checkpoints under `root`, oldest first."""
    found = [p for p in root.glob("step_*") if NAME.search(p.name) and (p / META).exists()]
    return sorted(found, key=lambda p: int(NAME.search(p.name).group(1)))


def checkpoint_to_resume(cfg) -> Optional[Path]:
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        return found[-1] if found else None
    path = Path(resume)
    if not (path / META).exists():
        raise ConfigError(f"checkpoint.resume: {resume} is not a complete checkpoint (no {META}); "
                          f"give a step_<n> folder, auto or none")
    return path


def load_checkpoint(path: Path, dmp, optimizer=None) -> int:
    """Load into the (already sharded) model, and the optimizer if given; returns the step it
    was taken at."""
    try:
        step = int(json.loads((path / META).read_text())["step"])
        state = {"model": dmp.state_dict()}
        dcp.load(state, checkpoint_id=path)
        if optimizer is not None:
            # Partial: fused SGD keeps empty state entries for column-wise shards that a
            # table-wise table has not, so resharding meets keys the checkpoint never had.
            state["optim"] = optimizer.state_dict()
            dcp.load({"optim": state["optim"]}, checkpoint_id=path,
                     planner=DefaultLoadPlanner(allow_partial_load=True))
    except (OSError, ValueError, KeyError, RuntimeError, CheckpointException) as e:
        raise DataError(f"{path}: cannot load checkpoint ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); it is truncated or corrupt, "
                        f"resume from an older one or checkpoint.resume=none") from None
    dmp.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    return step


def checkpoint_config_path(path: Path) -> Path:
    """The resolved config a checkpoint was written with."""
    if not (path / META).exists():
        raise ConfigError(f"--checkpoint: {path} is not a complete checkpoint (no {META}); give a "
                          f"step_<n> folder")
    return path / CONFIG
