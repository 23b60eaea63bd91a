"""How a training step computes: fp32, tf32 matmuls, or bf16/fp16 autocast; fp16 adds a loss
scaler, counting the steps it skips."""

from __future__ import annotations

import contextlib
import warnings

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, name: str, device: torch.device, cuda_graphs: bool = False) -> None:
        """`cuda_graphs`: autocast must not cache casts across a graph capture."""
        self.name, self.device = name, device
        self.dtype = AUTOCAST_DTYPES.get(name)
        self._cache_casts = not cuda_graphs
        if name == "tf32":
            if device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = True
                torch.backends.cudnn.allow_tf32 = True
            else:
                warnings.warn("train.precision: tf32 exists only on NVIDIA GPUs; computing in fp32")
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=self._cache_casts)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer) -> None:
        """The optimizer step; with fp16, skipped (and the scale lowered) on inf/NaN gradients."""
        if self.scaler is None:
            optimizer.step()
            return
        scale = self.scaler._get_scale_async().clone()  # the scaler only lowers it on a skip
        self.scaler.step(optimizer)
        self.scaler.update()
        self._skipped += self.scaler._get_scale_async() < scale

    def unscale_embedding_grads(self, pooled: torch.Tensor) -> torch.Tensor:
        """Identity forward; backward divides by the loss scale before the gradient reaches the
        embeddings' fused update, and zeroes it when not finite so those tables skip the step."""
        return _UnscaleGrad.apply(pooled, self.scaler)

    def skipped_steps(self) -> int:
        return int(self._skipped.item())

    def log_fields(self) -> dict:
        """For metrics.jsonl: with fp16, the steps the loss scaler has skipped so far."""
        return {} if self.scaler is None else {"skipped_steps": self.skipped_steps()}


class _UnscaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pooled: torch.Tensor, scaler: torch.amp.GradScaler) -> torch.Tensor:
        ctx.scaler = scaler
        return pooled.view_as(pooled)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        unscaled = grad * ctx.scaler._get_scale_async().double().reciprocal().float()
        finite = torch.isfinite(unscaled).all()
        return torch.where(finite, unscaled, torch.zeros_like(unscaled)), None
