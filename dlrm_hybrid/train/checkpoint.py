"""Checkpoints with torch.distributed.checkpoint (DCP): sharded tables, fused and dense optimizer
state, and the step (which fixes the LR schedule and the data position: batches are a function
of the step, and training draws no other random numbers).

DCP stores shards with their global offsets, so a checkpoint written by N ranks loads on M
ranks under another placement, a table sharded there and replicated (data_parallel) here or the
other way round: a replicated table's weight is a plain tensor every rank holds, and its
optimizer state is written in the fused optimizer's layout (optim.checkpoint_state). A
checkpoint is written to `.step_<n>.partial`, and published by renaming it to `step_<n>` once
every rank has finished and `meta.json` is in it: a run killed while writing leaves the previous
checkpoints as they were.

`meta.json` records the run that wrote the checkpoint (pruning removes only that run's
checkpoints), the identity of its dataset (resume_rules.py) and the SHA-256 of every other file
(checkpoint_digest.py): a checkpoint is checked before it is resumed, evaluated or exported.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from dlrm_hybrid.compat import saved_files
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.parallel.exchange import make_replicas_current
from dlrm_hybrid.train.checkpoint_digest import ALGORITHM, damaged_files, file_digest, file_digests
from dlrm_hybrid.train.checkpoint_folder import (CONFIG, META, checkpoint_config_path,
                                                 complete_checkpoints, require_checkpoint)
from dlrm_hybrid.train.checkpoint_reader import METADATA, checkpoint_reader
from dlrm_hybrid.train.dataset_identity import dataset_identity
from dlrm_hybrid.train.optim import checkpoint_state, from_checkpoint_state

EARLIER_RUN = ""  # the run of a checkpoint written before runs were recorded


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.train.run_dir) / "checkpoints")


def save_checkpoint(root: Path, step: int, dmp, optimizer, env, cfg, extra: dict, run: str
                    ) -> Path:
    """Collective: every rank writes its shards and hashes its share of the files; rank 0 adds
    the resolved config (so eval and export need nothing else) and `meta.json` (the step, the
    `run` id, the dataset's identity, the digests and `extra`, small JSON state the same on every
    rank), publishes, and prunes the run's own older checkpoints to `checkpoint.keep`."""
    final, partial = root / f"step_{step}", root / f".step_{step}.partial"
    if env.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    make_replicas_current(dmp, optimizer)
    dist.barrier()
    written = dcp.save({"model": dmp.state_dict(), "optim": checkpoint_state(optimizer)},
                       checkpoint_id=partial)
    digests = file_digests(partial, {METADATA, *saved_files(written, partial)})
    if env.is_main:
        cfg.save(partial / CONFIG)
        digests[CONFIG] = file_digest(partial, CONFIG)
        meta = {"step": step, "world_size": env.world_size, "run": run, **extra,
                ALGORITHM: digests}
        if cfg.data.path:
            meta["dataset"] = dataset_identity(cfg.data.path)
        (partial / META).write_text(json.dumps(meta))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for old in run_checkpoints(root, run)[:-cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def new_run_id() -> str:
    """Collective: a fresh run's id, rank 0's on every rank."""
    run = [uuid.uuid4().hex[:12]]
    dist.broadcast_object_list(run, src=0)
    return run[0]


def run_of(meta: dict) -> str:
    return str(meta.get("run", EARLIER_RUN))


def run_checkpoints(root: Path, run: str) -> List[Path]:
    """The published checkpoints of `run` under `root`, oldest first."""
    def written_by_run(path: Path) -> bool:
        try:
            return run_of(read_meta(path)) == run
        except DataError:
            return False
    return [p for p in complete_checkpoints(root) if written_by_run(p)]


def checkpoint_to_resume(cfg) -> Optional[Path]:
    """The checkpoint `checkpoint.resume` names, unchecked (see `intact_checkpoint_to_resume`)."""
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(checkpoint_root(cfg))
        return found[-1] if found else None
    path = Path(resume)
    require_checkpoint(path, "checkpoint.resume", "auto or none")
    return path


def intact_checkpoint_to_resume(cfg, say: Callable[[str], None]) -> Optional[Path]:
    """Collective. The checkpoint to resume, its files checked against their digests: a damaged
    one that `checkpoint.resume` names is refused; under `auto` a damaged one is renamed
    `step_<n>.damaged` (kept to inspect, no longer found, pruned or named as the last good one)
    and the newest before it is tried."""
    if cfg.checkpoint.resume == "none":
        return None
    auto = cfg.checkpoint.resume == "auto"
    candidates = complete_checkpoints(checkpoint_root(cfg)) if auto else [checkpoint_to_resume(cfg)]
    for path in reversed(candidates):
        damage = damaged(path)
        if damage is None:
            note_unchecked(path, say)
            return path
        if not auto:
            raise DataError(f"checkpoint.resume: {damage}; resume from an older checkpoint")
        aside = vacant(path.with_name(path.name + ".damaged"))
        if dist.get_rank() == 0:
            path.rename(aside)
        dist.barrier()
        say(f"checkpoint.resume: {damage}; renamed {path.name} to {aside.name}, trying the "
            f"checkpoint before it")
    return None


def vacant(path: Path) -> Path:
    """`path`, or the first of `path`-2, `path`-3, ... that does not exist."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def check_checkpoint(path: Path, say: Callable[[str], None]) -> None:
    """Before `eval` or `export` read `path`: a complete checkpoint whose files are those it was
    published with, else a one-line error. Collective under a process group."""
    checkpoint_config_path(path)
    damage = damaged(path)
    if damage is not None:
        raise DataError(f"{damage}; use another checkpoint")
    note_unchecked(path, say)


def damaged(path: Path) -> Optional[str]:
    """What is damaged in published checkpoint `path` (meta.json, or files whose SHA-256 is not
    the recorded one), or None. Collective under a process group."""
    try:
        recorded = read_meta(path).get(ALGORITHM)
    except DataError as e:
        return str(e).split(";")[0]
    if recorded is None:  # an earlier version's checkpoint: nothing to check against
        return None
    bad = damaged_files(path, recorded)
    if not bad:
        return None
    more = f" (and {len(bad) - 1} more of its files)" if len(bad) > 1 else ""
    return (f"{path / bad[0]}{more} is damaged: its SHA-256 is not the one recorded when the "
            f"checkpoint was written")


def note_unchecked(path: Path, say: Callable[[str], None]) -> None:
    """One line for a checkpoint written before digests were recorded: used, but unchecked."""
    if ALGORITHM not in read_meta(path):
        say(f"note: {path} was written by an earlier version, without file digests, so its "
            f"files cannot be checked; checkpoints written from now on carry them")


def read_meta(path: Path) -> dict:
    """`meta.json` of a complete checkpoint: its step and the `extra` it was saved with."""
    try:
        meta = json.loads((path / META).read_text())
        int(meta["step"])
        digests = meta.get(ALGORITHM, {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in digests.items()):
            raise TypeError("digests")
        return meta
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path / META}: unreadable ({type(e).__name__}); the checkpoint is "
                        f"corrupt, use an older one") from None


def load_checkpoint(path: Path, dmp, optimizer=None) -> dict:
    """Load into the (already sharded) model, and the optimizer if given; returns the
    checkpoint's `meta.json` (its step and extra state)."""
    meta = read_meta(path)
    reader = checkpoint_reader(path)  # a crafted file is refused here, before anything runs
    state = {"model": dmp.state_dict()}
    if optimizer is not None:
        state["optim"] = checkpoint_state(optimizer)
        _require_optimizer_state(path, state["optim"], reader)
    try:
        dcp.load({"model": state["model"]}, storage_reader=reader)
        if optimizer is not None:
            # Partial: fused SGD keeps empty state entries for column-wise shards that a
            # table-wise table has not, so resharding meets keys the checkpoint never had
            # (a tensor it lacks was refused above, never left fresh).
            dcp.load({"optim": state["optim"]}, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=True))
    except (OSError, ValueError, KeyError, RuntimeError, CheckpointException) as e:
        raise _load_error(path, e) from None
    dmp.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(from_checkpoint_state(optimizer, state["optim"],
                                                        int(meta["step"])))
        # fbgemm's step counter (Adam's bias correction) is not in the optimizer state: it
        # counts training steps, so it is the checkpoint's step.
        optimizer.set_optimizer_step(int(meta["step"]))
    return meta


def _require_optimizer_state(path: Path, optim_state: dict, reader) -> None:
    """Every optimizer state tensor this run keeps is in the checkpoint, else a one-line error
    naming the first missing one (a partial load would leave it fresh without a word)."""
    stored = reader.read_metadata().state_dict_metadata
    for param, entries in optim_state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor) and f"optim.state.{param}.{name}" not in stored:
                raise DataError(f"{path}: holds no optimizer state {name} for {param}; it was "
                                f"trained with another optimizer or model: resume with the "
                                f"config it was written with, or checkpoint.resume=none")


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
        if (isinstance(cause, ValueError) and "Size mismatch" in text
                or isinstance(cause, (ValueError, RuntimeError)) and "Missing key" in text):
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
