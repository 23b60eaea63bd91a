"""How a training step computes: fp32, tf32 matmuls, or bf16/fp16 autocast; fp16 adds a loss
scaler, counting the steps it skips.

On a CPU, bf16 and fp16 are fast only where oneDNN has a matmul for them (bf16: AVX512-BF16,
AMX or at least AVX-512; fp16: AVX512-FP16 or AMX-FP16). Elsewhere (an AVX2-only host) torch
runs its reference kernels: a bf16 training step measured 24x slower than fp32 on an AVX2 EPYC
(799 vs 18,972 samples/s). There, unless `train.precision_fallback` is false, the step computes
in fp32 and says so once."""

from __future__ import annotations

import contextlib
import warnings

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether oneDNN has a vectorized matmul for `dtype` on this CPU (honours
    ONEDNN_MAX_CPU_ISA, so an AVX2 host can be emulated on a newer one)."""
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def cpu_capability() -> str:
    """What the CPU offers torch, for reports: e.g. "AVX2, bf16 emulated, fp16 emulated"."""
    native = {name: cpu_has_native(dtype) for name, dtype in AUTOCAST_DTYPES.items()}
    return ", ".join([torch.backends.cpu.get_cpu_capability()] + [
        f"{name} {'native' if ok else 'emulated'}" for name, ok in native.items()])


def effective_precision(name: str, device: torch.device, fallback: bool = True) -> str:
    """The precision a step computes in: `name`, or fp32 (with a one-line warning) where this
    device would emulate it and `fallback` allows."""
    if name == "tf32" and device.type != "cuda":
        warnings.warn("train.precision: tf32 exists only on NVIDIA GPUs; computing in fp32")
        return "fp32"
    dtype = AUTOCAST_DTYPES.get(name)
    if fallback and device.type == "cpu" and dtype is not None and not cpu_has_native(dtype):
        warnings.warn(f"train.precision: this CPU ({torch.backends.cpu.get_cpu_capability()}) has "
                      f"no native {name} matmul (20-100x slower than fp32); computing in fp32 "
                      f"(set train.precision_fallback=false to insist)")
        return "fp32"
    return name


class Precision:
    def __init__(self, name: str, device: torch.device, cuda_graphs: bool = False,
                 fallback: bool = True) -> None:
        """`name` as asked; `self.name` is what runs (see `effective_precision`).
        `cuda_graphs`: autocast must not cache casts across a graph capture."""
        self.requested, self.device = name, device
        self.name = name = effective_precision(name, device, fallback)
        self.dtype = AUTOCAST_DTYPES.get(name)
        self._cache_casts = not cuda_graphs
        if name == "tf32":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
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
