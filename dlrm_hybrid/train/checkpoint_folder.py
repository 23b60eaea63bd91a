"""A checkpoint folder's file names, the published checkpoints beside it and the config it was
written with, without torch: the CLI and the launcher check a `--checkpoint` before paying for
torch and torchrec."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

from dlrm_hybrid.config import ConfigError

META, CONFIG = "meta.json", "config.yaml"
NAME = re.compile(r"step_(\d+)$")
LISTED = 8  # published checkpoints named in full in an error; more: the first and last few


def complete_checkpoints(root: Path) -> List[Path]:
    """Published checkpoints under `root`, oldest first."""
    found = [p for p in root.glob("step_*") if NAME.search(p.name) and (p / META).exists()]
    return sorted(found, key=lambda p: int(NAME.search(p.name).group(1)))


def require_checkpoint(path: Path, key: str, otherwise: str = "") -> None:
    """A one-line error unless `path` is a published checkpoint: one that does not exist (a
    mistyped step), is incomplete or is a file of one is named with the checkpoints that do exist beside it (or
    in it: a checkpoints folder or a run folder given for one of its steps). `otherwise`: the
    key's other values (checkpoint.resume: auto or none)."""
    if (path / META).exists():
        return
    if path.is_dir():
        what = f"{path} is not a complete checkpoint (no {META})"
        roots = [path, path / "checkpoints", path.parent]
    elif path.exists():  # a file of a checkpoint (its meta.json, a shard)
        what = f"{path} is a file, not a checkpoint folder"
        roots = [path.parent.parent, path.parent]
    else:
        what = f"{path} does not exist"
        roots = [path.parent]
    found = next(((root, steps) for root in roots if (steps := complete_checkpoints(root))),
                 None)
    alternatives = f", {otherwise}" if otherwise else ""
    if found is None:
        raise ConfigError(f"{key}: {what}, and no checkpoint is published beside it; give a "
                          f"step_<n> folder of a run (train.run_dir/checkpoints){alternatives}")
    root, steps = found
    names = [p.name for p in steps]
    if len(names) > LISTED:
        names = [*names[:3], f"... ({len(names)} in all)", *names[-3:]]
    raise ConfigError(f"{key}: {what}; {root} holds {', '.join(names)}: give one of "
                      f"them{alternatives}")


def checkpoint_config_path(path: Path) -> Path:
    """The resolved config a checkpoint was written with."""
    require_checkpoint(path, "--checkpoint")
    return path / CONFIG
