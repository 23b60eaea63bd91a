"""Optimizers: fused in-backward for the sharded embeddings (fbgemm via torchrec), the same
algorithm as a torch optimizer for the replicated ones, torch.optim for the MLPs (their gradient
norm clipped where `optim.dense_clip_norm` asks), one LR schedule (linear warmup, then
polynomial decay) driving all three.

A replicated (torchrec `data_parallel`) table is a slice of a dense table batch that DDP wraps:
torchrec gives it no fused optimizer, and its gradient, dense and averaged over ranks in the
backward, is the global-batch mean a sharded table's owner sees. The torch optimizers below do
what fbgemm's CPU/GPU kernels do to a row (`fbgemm_gpu/codegen/genscript/optimizers.py`):
SGD w -= lr g; Adagrad m += g^2, w -= lr g / (sqrt(m) + eps); row-wise Adagrad m += mean(g^2)
over the row, w -= lr g / (sqrt(m) + eps), and a row no sample touched (g = 0) keeps its value
and state. Adam would decay every row's moments: tables.REPLICABLE_OPTIMIZERS leaves it out.
fbgemm keeps that state in fp32 and computes each update in fp32 whatever the weights' precision;
a torch optimizer keeps it in the parameter's dtype and computes in it. On fp16 tables that is
NaN from the first step: eps 1e-8 is 0 in fp16, so an untouched row's update is 0 / 0, and a
small gradient's square underflows to 0 (`_Fp32Update` does fbgemm's arithmetic instead).

Checkpoints hold a replicated table's optimizer state in fbgemm's layout (`checkpoint_state`),
so that it loads into a run where the table is sharded, and back (`from_checkpoint_state`).
"""

from __future__ import annotations

import warnings
from typing import Tuple

import torch
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.optim.lr_scheduler import LambdaLR
from torchrec.distributed.composable.table_batched_embedding_slice import (
    TableBatchedEmbeddingSlice)
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.narrow_replicas import clear_fp32_grads, take_fp32_grads

EMBEDDING_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
}
DENSE_OPTIMIZERS = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "adam": torch.optim.Adam}


def _kwargs(name: str, lr: float, eps: float) -> dict:
    return {"lr": lr} if name == "sgd" else {"lr": lr, "eps": eps}


def _dense_kwargs(optim_cfg) -> dict:
    """The dense optimizer's settings; Adam's betas are `optim.dense_betas`."""
    kwargs = _kwargs(optim_cfg.dense, optim_cfg.dense_lr, optim_cfg.eps)
    if optim_cfg.dense == "adam":
        kwargs["betas"] = tuple(optim_cfg.dense_betas)
    return kwargs


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
    """After sharding: the sharded model's fused optimizer, the embedding optimizer of the
    replicated tables, the dense optimizer, and the schedule (LambdaLR scales each param
    group's own base LR: `optim.embedding_lr` for both embedding optimizers).

    The fused optimizer reads its LR from its param group in `zero_grad()`, so call
    `zero_grad()` at the start of each step for the embeddings to follow the schedule; the
    other two read theirs in `step()`, after the backward of the same step.
    """
    unfused = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    replicated = {k: p for k, p in unfused.items() if isinstance(p, TableBatchedEmbeddingSlice)}
    dense = {k: p for k, p in unfused.items() if k not in replicated}
    embedding_cls = EMBEDDING_OPTIMIZERS[optim_cfg.embedding]
    dense_cls = DENSE_OPTIMIZERS[optim_cfg.dense]
    embedding_kwargs = _kwargs(optim_cfg.embedding, optim_cfg.embedding_lr, optim_cfg.eps)
    dense_kwargs = _dense_kwargs(optim_cfg)
    if optim_cfg.dense_clip_norm:
        dense_cls = _clipped(dense_cls, optim_cfg.dense_clip_norm)
    optimizers = [dmp.fused_optimizer]
    if replicated:
        optimizers.append(KeyedOptimizerWrapper(
            replicated, lambda params: _fp32_update(embedding_cls)(params, **embedding_kwargs)))
    optimizers.append(KeyedOptimizerWrapper(dense, lambda params: dense_cls(params, **dense_kwargs)))
    optimizer = CombinedOptimizer(optimizers)
    init_lazy_state(optimizer)
    return optimizer, LambdaLR(optimizer, lambda step: lr_factor(step, optim_cfg))


def _fp32_update(optimizer_cls: type) -> type:
    """`optimizer_cls` with fbgemm's arithmetic for tables below fp32 (its class and state names
    unchanged, so checkpoints keep their layout)."""
    return _FP32_UPDATES.setdefault(optimizer_cls, type(
        f"Fp32{optimizer_cls.__name__}", (_Fp32Update, optimizer_cls), {}))


class _Fp32Update(torch.optim.Optimizer):
    """A torch optimizer whose state is fp32 and whose step runs on fp32 copies of the weights
    and gradients of a table kept in fp16, rounded back once (round to nearest), as fbgemm's
    CPU kernels update an fp16 table: fp32 momentum, fp32 arithmetic, one rounding per step.
    The gradient is the fp32 one averaged over the ranks (parallel/narrow_replicas.py)."""

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        for state in self.state.values():  # Adagrad's sums are made here, in the weights' dtype
            for name, value in state.items():
                if name != "step" and value.is_floating_point():
                    state[name] = value.float()

    def _params(self) -> list:
        return [p for group in self.param_groups for p in group["params"]]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        clear_fp32_grads(self._params())

    @torch.no_grad()
    def step(self, closure=None):
        fp32_grads = take_fp32_grads(self._params())
        narrow = [(group, i, p) for group in self.param_groups
                  for i, p in enumerate(group["params"]) if p.dtype != torch.float32
                  and (id(p) in fp32_grads or p.grad is not None)]
        wide = []
        for group, i, p in narrow:  # the base step sees fp32 tensors in the fp16 ones' places
            copy = p.detach().float()
            copy.grad = fp32_grads[id(p)] if id(p) in fp32_grads else p.grad.float()
            group["params"][i] = copy
            if p in self.state:
                self.state[copy] = self.state.pop(p)
            wide.append(copy)
        try:
            return super().step(closure)
        finally:
            for (group, i, p), copy in zip(narrow, wide):
                p.copy_(copy)
                group["params"][i] = p
                if copy in self.state:
                    self.state[p] = self.state.pop(copy)


_FP32_UPDATES: dict = {}


def _clipped(optimizer_cls: type, max_norm: float) -> type:
    """`optimizer_cls` whose step first scales its parameters' gradients to `max_norm` at most
    (`optim.dense_clip_norm`; its state names unchanged, so checkpoints keep their layout)."""
    return type(f"Clipped{optimizer_cls.__name__}", (_ClipGradNorm, optimizer_cls),
                {"max_norm": max_norm})


class _ClipGradNorm(torch.optim.Optimizer):
    """Clips in the step itself, so every driver of the step (the plain one, torchrec's
    pipeline, fp16's loss scaler) clips at the right moment: after DDP's all-reduce, when every
    rank holds the same averaged gradients and so computes the same global norm, and after the
    scaler's unscale (GradScaler.step unscales, then calls step, which it skips on an
    overflow). FSDP's gradients are DTensors, whose norm clip_grad_norm_ reduces over the
    shards."""

    max_norm = 0.0

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            torch.nn.utils.clip_grad_norm_(grads, self.max_norm)
        return super().step(closure)


def advance_schedule(schedule: LambdaLR, step: int) -> None:
    """Put a fresh schedule at `step` (after resuming from a checkpoint taken there)."""
    if step:
        schedule.last_epoch = step - 1
        with warnings.catch_warnings():  # "step() before optimizer.step()": intended here
            warnings.simplefilter("ignore", UserWarning)
            schedule.step()


def current_lrs(optimizer: CombinedOptimizer, schedule: LambdaLR, optim_cfg) -> dict:
    """The LRs the next step trains with, for the run's record: the dense optimizer's, and the
    embedding optimizers' (the fused one's param group, which its `zero_grad()` hands to fbgemm,
    or the replicated tables' one). A rank that holds no table has no embedding param group:
    it reports the schedule's embedding LR."""
    *embedding_optimizers, (_, dense) = optimizer.optimizers
    groups = [g for _, o in embedding_optimizers for g in o.param_groups]
    embedding = (groups[0]["lr"] if groups else
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


def init_lazy_state(optimizer: CombinedOptimizer) -> None:
    """Create now the state torch's Adam makes only at a parameter's first step (its moments
    and step count), as that first step would (zeros), so every checkpoint holds it and a
    resumed run loads into it: without it a resumed run restarted Adam from zero moments, and
    a parameter no step had reached yet (HSTU's time bias on a log without times) left a
    checkpoint that could not be resumed. One step on zero gradients (a no-op on the weights:
    the dense optimizers take no weight decay), then every state tensor zeroed."""
    for _, wrapper in optimizer.optimizers:
        if isinstance(wrapper, KeyedOptimizerWrapper):
            wrapper.init_state()
            for param in wrapper.params.values():
                param.grad = None
            for state in wrapper.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()


def checkpoint_state(optimizer: CombinedOptimizer) -> dict:
    """`optimizer.state_dict()` with each replicated table's state as the fused optimizer keeps
    a sharded one's: `<table>.momentum1`, [rows] for row-wise Adagrad (one sum per row),
    [rows, dim] for Adagrad; none for SGD. Views of the live state: DCP loads into them in
    place. The torch optimizer's step counter is left out (it is the checkpoint's step)."""
    state = optimizer.state_dict()
    for key, torch_optimizer in _replicated(optimizer).items():
        held = state["state"].get(key, {})
        state["state"][key] = ({f"{_table_of(key)}.momentum1": _fused_layout(
            held["sum"], torch_optimizer)} if "sum" in held else {})
    return state


def from_checkpoint_state(optimizer: CombinedOptimizer, state: dict, step: int) -> dict:
    """`checkpoint_state`'s layout back into what `optimizer.load_state_dict` takes."""
    live = optimizer.state_dict()["state"]
    for key in _replicated(optimizer):
        if "sum" in live.get(key, {}):
            momentum = state["state"][key][f"{_table_of(key)}.momentum1"]
            state["state"][key] = {"sum": momentum.view_as(live[key]["sum"]),
                                   "step": torch.tensor(float(step))}
        else:  # SGD keeps no state
            state["state"].pop(key, None)
    return state


def _replicated(optimizer: CombinedOptimizer) -> dict:
    """{param key: torch optimizer} of the replicated tables (build_optimizer)."""
    return {key: wrapper._optimizer for _, wrapper in optimizer.optimizers
            if isinstance(wrapper, KeyedOptimizerWrapper)
            for key, p in wrapper.params.items() if isinstance(p, TableBatchedEmbeddingSlice)}


def _table_of(param_key: str) -> str:
    return param_key.split(".")[-2]  # ...embedding_bags.<table>.weight


def _fused_layout(state_sum: torch.Tensor, torch_optimizer) -> torch.Tensor:
    return state_sum.view(-1) if isinstance(torch_optimizer, RowWiseAdagrad) else state_sum
