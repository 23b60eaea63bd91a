"""Replicated (data_parallel) tables kept in fp16: their gradient stays in fp32.

fbgemm's dense table batch (a replicated table's lookup) computes its weights' gradient in fp32,
but autograd casts it to the fp16 weights' dtype, and torchrec's DDP around the lookup averages
it in fp16, divided by the world size first. A row few samples touch gets a subnormal gradient
a few percent off; a sharded fp16 table's fused update (fbgemm) uses the fp32 gradient. Measured
(configs/demo.yaml, three tables replicated on 2 ranks against 1 rank with all tables sharded,
row-wise Adagrad, dense SGD; AMD EPYC): with the gradient averaged in fp16 the losses part by
2.9e-6 at step 9 and 7e-5 at step 14; averaged in fp32, by at most 6e-8 up to step 21.

So here such a lookup runs on an fp32 copy of its weights: the copy's gradient is the fp32 one,
kept on the weights as `fp32_grad` instead of `.grad`; the replicated tables' optimizer
(train/optim.py) averages it over the ranks in fp32 and updates from it (`take_fp32_grads`).
torchrec's DDP around that lookup would average a gradient that no longer comes: it is taken
off. fp32 tables are left as they are.

One step of a replicated fp16 table is then its fp32 twin's step rounded to fp16 (to nearest):
with row-wise Adagrad bit for bit fbgemm's fused CPU update of the same table sharded. fbgemm's
fp16 SGD and Adagrad CPU kernels land one unit in the last place from that on 1.6% and 25% of
the weights they move (one step of 1,000 x 16 rows, 512 ids; their cause not traced here).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen)
from torch.nn.parallel import DistributedDataParallel


def keep_fp32_grads(model: torch.nn.Module) -> int:
    """Make every fp16 replicated table batch of the sharded `model` keep its gradient in fp32,
    and take torchrec's DDP off their lookups; how many table batches."""
    count = 0
    for collection in _collections(model):
        lookups: Any = getattr(collection, "_lookups")
        for index, lookup in enumerate(lookups):
            inner = lookup.module if isinstance(lookup, DistributedDataParallel) else lookup
            dense = [m for m in inner.modules() if type(m) is DenseTableBatchedEmbeddingBagsCodegen]
            narrow = [m for m in dense if m.weights.dtype != torch.float32]
            if not narrow or len(narrow) < len(dense):  # a lookup mixing precisions (no config
                continue  # makes one) stays as it is: DDP averages its fp16 gradient
            for tbe in narrow:
                tbe.__class__ = Fp32GradTBE  # same state, another forward
            lookups[index] = inner
            count += len(narrow)
    return count


def _collections(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The sharded collections in `module`: those with torchrec's `_lookups` (a plain list,
    outside `modules()`)."""
    for child in module.modules():
        if isinstance(getattr(child, "_lookups", None), (list, torch.nn.ModuleList)):
            yield child


class Fp32GradTBE(DenseTableBatchedEmbeddingBagsCodegen):
    """A dense (replicated) table batch whose lookup reads an fp32 copy of its fp16 weights,
    so that its gradient arrives in fp32 (`fp32_grad` of the weights). Instances come from
    `keep_fp32_grads`."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        weights = self._parameters["weights"]
        # fbgemm's forward reads `self.weights`: for this call, the differentiable fp32 copy.
        self._parameters["weights"] = _Fp32Copy.apply(weights)  # type: ignore[assignment]
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._parameters["weights"] = weights


class _Fp32Copy(torch.autograd.Function):
    """weights.float(), whose backward keeps the fp32 gradient on the weights (summed, as
    `.grad` would be) and gives them none."""

    @staticmethod
    def forward(ctx, weights: torch.Tensor) -> torch.Tensor:
        ctx.weights = weights
        return weights.detach().float()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weights = ctx.weights
        held = getattr(weights, "fp32_grad", None)
        weights.fp32_grad = grad.clone() if held is None else held + grad
        return None


def take_fp32_grads(params: Sequence[torch.Tensor]) -> Dict[int, torch.Tensor]:
    """{id(param): fp32 gradient averaged over the ranks} of each of `params` (table slices of
    an `Fp32GradTBE`, torchrec's TableBatchedEmbeddingSlice) whose table batch holds one, now
    taken from it. Every rank calls this with the same params in the same order (one all-reduce
    per table batch), as DDP would average them."""
    batches: List[Any] = []
    for p in params:
        weights = _batch_weights(p)
        if weights is not None and getattr(weights, "fp32_grad", None) is not None:
            if not any(weights is b for b in batches):
                batches.append(weights)
    world = dist.get_world_size() if dist.is_initialized() else 1
    grads = {}
    for weights in batches:
        grad, weights.fp32_grad = weights.fp32_grad, None
        if world > 1:
            dist.all_reduce(grad)
            grad /= world
        grads[id(weights)] = grad
    return {id(p): _slice(p, grads[id(w)]) for p in params
            for w in [_batch_weights(p)] if w is not None and id(w) in grads}


def clear_fp32_grads(params: Sequence[torch.Tensor]) -> None:
    """Drop the fp32 gradients of `params`' table batches (the optimizer's `zero_grad`)."""
    for p in params:
        weights = _batch_weights(p)
        if getattr(weights, "fp32_grad", None) is not None:
            weights.fp32_grad = None  # type: ignore[union-attr]


def _batch_weights(param: torch.Tensor) -> Optional[torch.Tensor]:
    """The table batch's flat weights a table slice views, or None for another parameter."""
    return getattr(param, "_original_tensor", None)


def _slice(param, flat: torch.Tensor) -> torch.Tensor:
    """`param`'s (a TableBatchedEmbeddingSlice's) part of its table batch's flat `flat`."""
    return flat[param._start_offset:param._end_offset].view(param.shape)
