"""Checkpoints with torch.distributed.checkpoint (DCP): sharded tables, fused and dense optimizer
state, and the step (which fixes the LR schedule and the data position: batches are a function
of the step, and training draws no other random numbers).

DCP stores shards with their global offsets, so a checkpoint written by N ranks loads on M
ranks under another placement. A checkpoint is written to `.step_<n>.partial`, and published
by renaming it to `step_<n>` once every rank has finished and `meta.json` is in it: a run killed
while writing leaves the previous checkpoints as they were.

A checkpoint records the resolved config it was trained with; resuming it under settings that
change the experiment (the model, the data, the optimizer; anything but `MAY_CHANGE`) is
refused, naming the keys that differ.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dlrm_hybrid.config import Config, ConfigError, load_config
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.parallel.exchange import make_replicas_current
from dlrm_hybrid.train.checkpoint_reader import checkpoint_reader

META, CONFIG = "meta.json", "config.yaml"
NAME = re.compile(r"step_(\d+)$")
# Settings a resumed run may change: how long and how it runs, where it writes, how it is
# parallelised (checkpoints reshard), not what it trains.
MAY_CHANGE = ("train.max_steps", "train.log_every", "train.eval_every", "train.run_dir",
              "train.progress_bar", "train.rank_logs", "train.precision",
              "train.precision_fallback", "train.cuda_graphs", "train.pipeline",
              "train.evals_per_epoch", "train.target_auc", "train.mlperf_log",
              "data.loader", "data.prefetch", "parallel.", "checkpoint.")


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")


def save_checkpoint(root: Path, step: int, dmp, optimizer, env, cfg, extra: Optional[dict] = None
                    ) -> Path:
    """Collective: every rank writes its shards; rank 0 adds the resolved config (so eval and
    export need nothing else) and `extra` (small JSON state, the same on every rank) to
    `meta.json`, publishes and prunes."""
    final, partial = root / f"step_{step}", root / f".step_{step}.partial"
    if env.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    make_replicas_current(dmp, optimizer)
    dist.barrier()
    dcp.save({"model": dmp.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=partial)
    dist.barrier()
    if env.is_main:
        cfg.save(partial / CONFIG)
        (partial / META).write_text(json.dumps({"step": step, "world_size": env.world_size,
                                                **(extra or {})}))
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


def check_same_experiment(path: Path, cfg: Config) -> None:
    """Refuse to resume `path` under settings that change what is trained."""
    saved = _flat(load_config(str(path / CONFIG)).to_dict())
    here = _flat(cfg.to_dict())
    changed = [key for key in here if saved.get(key) != here[key]
               and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE)]
    if changed:
        diffs = ", ".join(f"{key} ({saved.get(key)!r} there, {here[key]!r} here)" for key in changed)
        raise ConfigError(f"checkpoint.resume: {path} was trained with other settings: {diffs}; "
                          f"resume it with its own settings, or start anew with "
                          f"checkpoint.resume=none or another train.run_dir")


def _flat(tree: dict, prefix: str = "") -> Dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_meta(path: Path) -> dict:
    """`meta.json` of a complete checkpoint: its step and the `extra` it was saved with."""
    try:
        meta = json.loads((path / META).read_text())
        int(meta["step"])
        return meta
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path / META}: unreadable ({type(e).__name__}); the checkpoint is "
                        f"corrupt, use an older one") from None


def load_checkpoint(path: Path, dmp, optimizer=None) -> dict:
    """Load into the (already sharded) model, and the optimizer if given; returns the
    checkpoint's `meta.json` (its step and extra state)."""
    meta = read_meta(path)
    reader = checkpoint_reader(path)  # a crafted file is refused here, before anything runs
    try:
        state = {"model": dmp.state_dict()}
        dcp.load(state, storage_reader=reader)
        if optimizer is not None:
            # Partial: fused SGD keeps empty state entries for column-wise shards that a
            # table-wise table has not, so resharding meets keys the checkpoint never had.
            state["optim"] = optimizer.state_dict()
            dcp.load({"optim": state["optim"]}, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=True))
    except (OSError, ValueError, KeyError, RuntimeError, CheckpointException) as e:
        raise _load_error(path, e) from None
    dmp.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optim"])
        # fbgemm's step counter (Adam's bias correction) is not in the optimizer state: it
        # counts training steps, so it is the checkpoint's step.
        optimizer.set_optimizer_step(int(meta["step"]))
    return meta


def _load_error(path: Path, error: BaseException) -> DataError:
    """A checkpoint written for another model is not a corrupt one: say which it is."""
    causes = [exc for exc, _ in error.failures.values()] if isinstance(
        error, CheckpointException) else [error]
    for cause in causes:
        text = str(cause).splitlines()[0] if str(cause) else ""
        rowwise = re.search(r"Size mismatch .* for optim\.state\..*\.(\w+)\.weight\.\w+\.momentum1", text)
        if isinstance(cause, ValueError) and rowwise and "rowwise_adagrad" in _optimizer_of(path):
            return DataError(
                f"{path}: table {rowwise.group(1)} is split into other column shards here than "
                f"in the run that wrote it, and row-wise Adagrad keeps one statistic per row of "
                f"each shard, which cannot be resharded; resume on that run's world size with "
                f"its plan (parallel.plan=<its run_dir>/plan.json)")
        if isinstance(cause, ValueError) and ("Size mismatch" in text or "Missing key" in text):
            return DataError(f"{path}: does not fit this model ({text}); it was trained with other "
                             f"model or table settings: use the config it was written with")
    cause = causes[0] if causes else error
    text = str(cause).splitlines()[0] if str(cause) else ""
    return DataError(f"{path}: cannot load checkpoint ({type(cause).__name__}: {text}); it is "
                     f"truncated or corrupt, resume from an older one or checkpoint.resume=none")


def _optimizer_of(path: Path) -> str:
    """The embedding optimizer a checkpoint was trained with ("" if unreadable)."""
    try:
        return load_config(str(path / CONFIG)).optim.embedding
    except ConfigError:
        return ""


def checkpoint_config_path(path: Path) -> Path:
    """The resolved config a checkpoint was written with."""
    if not (path / META).exists():
        raise ConfigError(f"--checkpoint: {path} is not a complete checkpoint (no {META}); give a "
                          f"step_<n> folder")
    return path / CONFIG
