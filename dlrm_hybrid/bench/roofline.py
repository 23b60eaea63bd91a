"""The speed a model could reach on this device: embedding bytes moved per sample over the
memory bandwidth, dense FLOPs per sample over the matmul rate, both peaks measured here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

OPTIMIZER_STATE_BYTES = {"sgd": lambda dim: 0, "rowwise_adagrad": lambda dim: 4,
                         "adagrad": lambda dim: 4 * dim, "adam": lambda dim: 8 * dim}
WEIGHT_BYTES = {"fp32": 4, "fp16": 2}
ID_BYTES, POOLED_BYTES = 8, 4
# One timed matmul stays about this short, so measuring the peaks takes ~1 s on any CPU.
MATMUL_SECONDS = 0.25
SMALLEST_MATMUL, LARGEST_MATMUL = 256, {"cuda": 4096, "cpu": 2048}  # a GPU peaks only at 4096


@dataclass(frozen=True)
class Roofline:
    embedding_bytes: float  # per sample and training step
    dense_flops: float  # per sample and training step (forward and backward)
    bandwidth: float  # bytes/s, measured
    flops_per_s: float  # measured

    @property
    def samples_per_s(self) -> float:
        """Upper bound: the slower of the two resources, with perfect overlap."""
        return 1.0 / max(self.embedding_bytes / self.bandwidth, self.dense_flops / self.flops_per_s)

    @property
    def bound_by(self) -> str:
        memory = self.embedding_bytes / self.bandwidth
        return "memory" if memory >= self.dense_flops / self.flops_per_s else "compute"


def embedding_bytes_per_sample(spec, dim: int, weight: str, optimizer: str) -> float:
    """Every id's row read in the forward, read and written by the fused update, its optimizer
    state read and written; pooled vectors and their gradients; the ids. No cache reuse."""
    row, state = dim * WEIGHT_BYTES[weight], OPTIMIZER_STATE_BYTES[optimizer](dim)
    ids = sum(spec.mean_hotness)
    return ids * (3 * row + 2 * state + 2 * ID_BYTES) + len(spec.cardinalities) * 2 * dim * POOLED_BYTES


def dense_flops_per_sample(model, interaction: str, num_vectors: int, dim: int) -> float:
    """Forward and backward (3x the forward). Each dense weight takes one multiply-add per
    sample in the MLPs and the low-rank cross net; `dot` adds the batched Gram matrix."""
    weights = sum(p.numel() for name, p in model.named_parameters()
                  if "embedding" not in name and not name.endswith("bias"))
    gram = 2 * num_vectors * num_vectors * dim if interaction == "dot" else 0
    return 3 * (2 * weights + gram)


@dataclass(frozen=True)
class Peaks:
    bandwidth: float  # bytes/s of a large copy
    flops_per_s: float  # of `x @ w.T` in `dtype`, both n x n
    matmul_size: int  # n
    dtype: torch.dtype


def measure_peaks(device: torch.device, dtype: torch.dtype,
                  seconds: float = MATMUL_SECONDS) -> Peaks:
    """The copy bandwidth and the matmul rate in `dtype` (what the step computes in), best of a
    few runs. The matmul is `x @ w.T`, nn.Linear's forward: where a CPU emulates `dtype` (bf16
    without AVX512-BF16 or AMX, fp16 without AVX512-FP16 or AMX-FP16) that layout is its
    fastest (bf16, 512^2, an EPYC limited to AVX2: 29 GFLOP/s, `x @ w` 2), so the bound stays a
    bound. Its side grows from 256 only while one run stays within `seconds`: there a 2048^2
    matmul takes 15-40 s."""
    src = torch.empty(64 * 2**20, device=device)  # 256 MiB
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / _best_time(lambda: dst.copy_(src), device)
    n = _matmul_size(device, dtype, seconds)
    x, w = _matrices(n, device, dtype)
    flops = 2 * n**3 / _best_time(lambda: x @ w.T, device)
    return Peaks(bandwidth, flops, n, dtype)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a timer sees all of it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_time(work: Callable, device: torch.device, runs: int = 5) -> float:
    work()
    best = float("inf")
    for _ in range(runs):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _matmul_size(device: torch.device, dtype: torch.dtype, seconds: float) -> int:
    """The largest side, doubling from 256 up to the device's cap, whose matmul should stay
    within `seconds` (time grows 8x per doubling)."""
    n, largest = SMALLEST_MATMUL, LARGEST_MATMUL.get(device.type, LARGEST_MATMUL["cpu"])
    while n < largest:
        x, w = _matrices(n, device, dtype)
        if 8 * _best_time(lambda: x @ w.T, device, runs=1) > seconds:
            break
        n *= 2
    return n


def _matrices(n: int, device: torch.device, dtype: torch.dtype) -> tuple:
    return tuple(torch.randn(n, n, device=device).to(dtype) for _ in range(2))
