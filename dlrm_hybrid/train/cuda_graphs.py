"""`train.cuda_graphs`: the dense part of a training step (bottom MLP, interaction, top MLP,
loss, and their backward) replayed as a CUDA graph, so its ~100 small kernels cost one launch.

The sparse part stays eager: the id all-to-all and the embedding lookups have data-dependent
shapes. torch's `make_graphed_callables` captures the forward and backward as one autograd
node; the gradients it returns for the MLP weights are accumulated eagerly, so DDP's
all-reduce hooks still fire, and the pooled embeddings' gradient flows on into the exchange.

Capture runs in CUDA's "global" stream-capture mode, where an unsafe CUDA call (an allocation,
an event query, a synchronize) from any other thread breaks it: the loader pinning a batch, DALI's
executor copying one. torch 2.13's `make_graphed_callables` has no `capture_error_mode`
parameter: it captures each pass with `torch.cuda.graph(graph, pool=mempool)`, whose default is
"global". "thread_local" would mean copying that function (its autograd Function included) or
patching torch's default, and would still not allow a device-wide synchronize from another
thread, which fails during any capture (NVIDIA/DALI#6259). So the loader pauses instead: the
capture runs inside `capture_guard()`, which the training step sets to its loader's `quiesced`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

if TYPE_CHECKING:  # the model module imports torchrec: seconds, needed here for types only
    from dlrm_hybrid.model.dlrm import DLRM

WARMUP_STEPS = 10  # eager steps first: the allocator, DDP's buckets and autotuning settle


class DenseGraph:
    """Takes over `model.dense_loss`: eager for `warmup` steps, then captured at that step's
    batch shapes and replayed; batches of other shapes (a short last batch) run eagerly. If
    capture is impossible it warns once with the reason and the run stays eager."""

    def __init__(self, model: DLRM, device: torch.device, warmup: int = WARMUP_STEPS,
                 capture: Optional[Callable] = None) -> None:
        self.eager: Callable[..., torch.Tensor] = model.dense_loss
        self.warmup, self.steps = warmup, 0
        self.graphed: Optional[Callable] = None
        self.shapes: Optional[Tuple] = None
        self.eager_reason: Optional[str] = None
        self._capture_fn = capture or torch.cuda.make_graphed_callables
        # Entered around the capture; the training step sets its loader's `quiesced` here.
        self.capture_guard: Callable[[], ContextManager] = contextlib.nullcontext
        self._dense_layers = _DenseLayers(model)
        if capture is None and device.type != "cuda":
            self._stay_eager(f"needs a CUDA device, this run is on {device.type}")
        setattr(model, "dense_loss", self)  # an instance attribute over the method

    def __call__(self, dense: torch.Tensor, pooled: torch.Tensor,
                 labels: torch.Tensor) -> torch.Tensor:
        if self.eager_reason is None and self.graphed is None:
            self.steps += 1
            if self.steps > self.warmup:
                self._capture(dense, pooled, labels)
        if self.graphed is not None and _shapes(dense, pooled, labels) == self.shapes:
            return self.graphed(dense, pooled, labels)
        return self.eager(dense, pooled, labels)

    def _capture(self, *args: torch.Tensor) -> None:
        # The graph reads its inputs from these tensors on every replay: private copies.
        static = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        with self.capture_guard():
            try:
                self.graphed = self._capture_fn(self._dense_layers, static)
                self.shapes = _shapes(*args)
            except Exception as e:  # noqa: BLE001 - any capture failure means: run eagerly
                self._stay_eager(f"capture failed ({type(e).__name__}: {str(e).splitlines()[0]})")

    def _stay_eager(self, reason: str) -> None:
        self.eager_reason = reason
        if not dist.is_initialized() or dist.get_rank() == 0:  # every rank has the same reason
            warnings.warn(f"train.cuda_graphs: {reason}; running the dense part eagerly")


class _DenseLayers(nn.Module):
    """The model's dense layers as one module, so the capture sees (only) their parameters."""

    def __init__(self, model: DLRM) -> None:
        super().__init__()
        self.dense_arch, self.interaction, self.over_arch = (
            model.dense_arch, model.interaction, model.over_arch)
        self._dense_loss: Callable[..., torch.Tensor] = model.dense_loss

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        return self._dense_loss(dense, pooled, labels)


def graphs_wanted(setting: str, model: nn.Module, device: torch.device) -> bool:
    """`train.cuda_graphs` for this step: true, false, or auto: on a GPU where the dense part
    can be captured (a DLRM with the pooled exchange and unsharded dense layers: des and FSDP
    run collectives inside it)."""
    if setting != "auto":
        return setting == "true"
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    return (device.type == "cuda" and hasattr(model, "dense_loss")
            and getattr(model, "exchange", None) == "pooled" and not sharded)


def _shapes(*tensors: torch.Tensor) -> Tuple:
    return tuple((t.shape, t.dtype, t.requires_grad) for t in tensors)
