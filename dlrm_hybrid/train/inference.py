"""Using a checkpoint outside training: `eval` (AUC and log loss on a split, or a two-tower
model's retrieval metrics; sharded like training, under torchrun or in one process) and
`export` (one unsharded state-dict file)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.source import open_dataset, require_samples
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.train.checkpoint import check_checkpoint, checkpoint_config_path, load_checkpoint
from dlrm_hybrid.train.checkpoint_reader import checkpoint_reader
from dlrm_hybrid.train.loop import build_sharded_model
from dlrm_hybrid.train.metrics_log import MetricsLog, metrics_text
from dlrm_hybrid.train.model_kinds import model_kind
from dlrm_hybrid.output_paths import temporary_beside


def evaluate_checkpoint(checkpoint: str, config: Optional[str], overrides: List[str], env,
                        split: str = "test") -> Optional[dict]:
    """Metrics of `split` on rank 0 (None elsewhere), printed there as `eval: ...`. The config
    defaults to the one the checkpoint was written with."""
    path = Path(checkpoint)
    cfg = load_config(config or str(checkpoint_config_path(path)), overrides, env.world_size)
    # Evaluation updates nothing: any fused kernel serves (fbgemm's CPU build has no Adam).
    cfg.optim.embedding = "sgd"
    if not any(o.strip().startswith("parallel.plan=") for o in overrides):
        cfg.parallel.plan = ""  # the training run's plan file is for its world size, not this one's
    if not any(o.strip().startswith("parallel.hsdp_shard_size=") for o in overrides):
        cfg.parallel.hsdp_shard_size = 0  # hsdp groups of this job's hosts, which divide its ranks
    log = MetricsLog(Path(cfg.train.run_dir), env.rank)
    check_checkpoint(path, log.say)  # its files are those it was written with
    dataset = open_dataset(cfg.data, cfg.model)
    require_samples(dataset, (split,), "eval")
    # eval prints its result alone: the placement is for train and plan to show
    dmp, _ = build_sharded_model(cfg, dataset.spec, env, say=lambda line: None)
    step = load_checkpoint(path, dmp)["step"]
    metrics = model_kind(cfg).evaluate(dmp, dataset, env, split)
    if metrics is not None:
        log.say(f"eval: checkpoint={path} step={step} split={split} {metrics_text(metrics)}")
    return metrics


def export_checkpoint(checkpoint: str, out: str) -> int:
    """Write the model's full (unsharded) state dict to `out`, atomically; returns its tensor
    count."""
    check_checkpoint(Path(checkpoint), print)
    state = read_model_state(Path(checkpoint))
    target = Path(out)
    partial = temporary_beside(target)
    torch.save(state, partial)
    partial.replace(target)
    return len(state)


def read_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """A checkpoint's model, unsharded, in this process. Loads the model entries only (the
    optimizer state can be twice the model's size)."""
    checkpoint_config_path(path)  # a complete checkpoint, or a one-line error
    reader = checkpoint_reader(path)  # a crafted file is refused here, before anything runs
    try:
        with warnings.catch_warnings():  # "no process group: loading in one process" (intended)
            warnings.simplefilter("ignore", UserWarning)
            state = _load_state_dict_from_keys(keys={"model"}, storage_reader=reader)["model"]
    except Exception as e:  # DCP wraps I/O and format errors in several exception types
        raise DataError(f"{path}: cannot read checkpoint ({type(e).__name__}); it is truncated "
                        f"or corrupt") from None
    return dict(state)
