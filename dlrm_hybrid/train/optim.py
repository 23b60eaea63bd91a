"""Optimizers: fused in-backward for the embeddings (fbgemm via torchrec), torch.optim for the
MLPs, one LR schedule (linear warmup, then polynomial decay) driving both."""

from __future__ import annotations

import warnings
from typing import Tuple

import torch
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.optim.lr_scheduler import LambdaLR
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from dlrm_hybrid.config import ConfigError

EMBEDDING_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
}
DENSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def _kwargs(name: str, lr: float, eps: float) -> dict:
    return {"lr": lr} if name == "sgd" else {"lr": lr, "eps": eps}


GPU_ONLY_EMBEDDING_OPTIMIZERS = ("adam",)  # fbgemm's CPU kernels lack them


def attach_embedding_optimizer(embedding_bags: torch.nn.Module, optim_cfg,
                               device: torch.device) -> None:
    """Before sharding: torchrec's sharder reads this and fuses the update into the backward."""
    if device.type == "cpu" and optim_cfg.embedding in GPU_ONLY_EMBEDDING_OPTIMIZERS:
        raise ConfigError(f"optim.embedding: {optim_cfg.embedding} runs only on GPU in fbgemm; "
                          f"on CPU use sgd, rowwise_adagrad or adagrad")
    _apply_optimizer_in_backward(
        EMBEDDING_OPTIMIZERS[optim_cfg.embedding], embedding_bags.parameters(),
        _kwargs(optim_cfg.embedding, optim_cfg.embedding_lr, optim_cfg.eps))


def build_optimizer(dmp, optim_cfg) -> Tuple[CombinedOptimizer, LambdaLR]:
    """After sharding: the dense optimizer plus the sharded model's fused one, and the schedule.

    The fused optimizer reads its LR from its param group in `zero_grad()`, so call
    `zero_grad()` at the start of each step for the embeddings to follow the schedule.
    """
    dense_cls = DENSE_OPTIMIZERS[optim_cfg.dense]
    dense_kwargs = _kwargs(optim_cfg.dense, optim_cfg.dense_lr, optim_cfg.eps)
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: dense_cls(params, **dense_kwargs))
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return optimizer, LambdaLR(optimizer, lambda step: lr_factor(step, optim_cfg))


def advance_schedule(schedule: LambdaLR, step: int) -> None:
    """Put a fresh schedule at `step` (after resuming from a checkpoint taken there)."""
    if step:
        schedule.last_epoch = step - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": intended here
            warnings.simplefilter("ignore", UserWarning)
            schedule.step()


def current_lrs(optimizer: CombinedOptimizer, schedule: LambdaLR, optim_cfg) -> dict:
    """The LRs the next step trains with, for the run's record: the dense optimizer's, and the
    fused embedding optimizer's param group's, which its `zero_grad()` hands to fbgemm. A rank
    that holds no table has no fused param group: it reports the schedule's embedding LR."""
    (_, fused), (_, dense) = optimizer.optimizers
    embedding = (fused.param_groups[0]["lr"] if fused.param_groups else
                 optim_cfg.embedding_lr * lr_factor(schedule.last_epoch, optim_cfg))
    return {"lr_dense": dense.param_groups[0]["lr"], "lr_embedding": embedding}


def lr_factor(step: int, optim_cfg) -> float:
    """Multiplier of the base LR at (0-based) `step`: warmup, hold, polynomial decay, floor."""
    c = optim_cfg
    if step < c.warmup_steps:
        return (step + 1) / c.warmup_steps
    if c.decay_steps <= 0 or step < c.decay_start_step:
        return 1.0
    progress = min(1.0, (step - c.decay_start_step) / c.decay_steps)
    return c.decay_end_factor + (1.0 - c.decay_end_factor) * (1.0 - progress) ** c.decay_power
