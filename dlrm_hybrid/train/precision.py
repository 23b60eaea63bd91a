"""How a training step computes: fp32, tf32 matmuls, or bf16/fp16 autocast; fp16 adds a loss
scaler, counting the steps it skips.

On a CPU, bf16 and fp16 are fast only where the CPU has their dot-product instructions and
oneDNN may use them (bf16: AVX512-BF16 or AMX-BF16; fp16: AVX512-FP16 or AMX-FP16).
Elsewhere the step computes in the low precision by conversion or in torch's reference
kernels: a bf16 step measured 24x slower than fp32 on an AVX2 EPYC (799 vs 18,972 samples/s),
and 3x slower on an AVX-512 Xeon without AVX512-BF16, where oneDNN still reports bf16 support
(a 2048x1024 @ 1024x1024 bf16 matmul 71.6 ms vs 14.7 ms in fp32). There, unless
`train.precision_fallback` is false, the step computes in fp32 and says so once."""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# /proc/cpuinfo flags of the dot-product instructions oneDNN needs to be fast in each dtype.
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"),
                torch.float16: ("avx512_fp16", "amx_fp16")}
# oneDNN ISA limits (ONEDNN_MAX_CPU_ISA) that leave those instructions out; higher limits
# (AVX512_CORE_FP16, AVX10_1_512, the AMX ones, DEFAULT) and unknown names leave them in.
_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
               "AVX512_CORE_VNNI"}
ISA_LIMITS_WITHOUT = {torch.bfloat16: _BELOW_BF16,
                      torch.float16: _BELOW_BF16 | {"AVX512_CORE_BF16"}}


def emulation_reason(dtype: torch.dtype, cpuinfo: str, env: Mapping[str, str]) -> Optional[str]:
    """Why a CPU with this /proc/cpuinfo text and environment computes `dtype` slowly, or None
    where it has the instructions. Decided from the flags, not from oneDNN's own check, which
    says bf16 wherever there is AVX-512 (it converts there). Deterministic, so every rank
    reaches the same decision, where a timed probe could split them."""
    if dtype not in NATIVE_FLAGS:
        return None
    limit = (env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA") or "").upper()
    if limit in ISA_LIMITS_WITHOUT[dtype]:
        return f"ONEDNN_MAX_CPU_ISA={limit}"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])
    if not set(NATIVE_FLAGS[dtype]) & set(flags):
        return f"no {' or '.join(NATIVE_FLAGS[dtype])}"
    return None


def cpu_emulation(dtype: torch.dtype) -> Optional[str]:
    """Why this CPU would compute `dtype` slowly (see `emulation_reason`), or None."""
    reason = emulation_reason(dtype, _cpuinfo(), os.environ)
    if reason is None and not onednn_has_kernel(dtype):
        return "no oneDNN support"
    return reason


def onednn_has_kernel(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes `dtype` at all (natively or by conversion); where it does not,
    torch runs its reference kernels, 20-100x slower than fp32."""
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    return supported is None or supported()


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` at least as fast as fp32 (honours ONEDNN_MAX_CPU_ISA,
    so the other hosts can be emulated on a newer one)."""
    return cpu_emulation(dtype) is None


def cpu_capability() -> str:
    """What the CPU offers torch, for reports: e.g. "AVX2, bf16 emulated, fp16 emulated"."""
    native = {name: cpu_has_native(dtype) for name, dtype in AUTOCAST_DTYPES.items()}
    return ", ".join([torch.backends.cpu.get_cpu_capability()] + [
        f"{name} {'native' if ok else 'emulated'}" for name, ok in native.items()])


def cpu_description() -> str:
    """The CPU's model name and what it offers torch, for benchmark headers."""
    name = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                 if line.startswith("model name")), "unknown CPU")
    return f"{name}; {cpu_capability()}"


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return cpuinfo.read()
    except OSError:
        return ""


def effective_precision(name: str, device: torch.device, fallback: bool = True) -> str:
    """The precision a step computes in: `name`, or fp32 (with a one-line warning) where this
    device would emulate it and `fallback` allows."""
    if name == "tf32" and device.type != "cuda":
        _warn_once("train.precision: tf32 exists only on NVIDIA GPUs; computing in fp32")
        return "fp32"
    dtype = AUTOCAST_DTYPES.get(name)
    if not fallback or device.type != "cpu" or dtype is None:
        return name
    reason = cpu_emulation(dtype)
    if reason is not None:
        _warn_once(f"train.precision: this CPU ({torch.backends.cpu.get_cpu_capability()}, "
                   f"{reason}) has no native {name} matmul (a step 3-24x slower than fp32); "
                   f"computing in fp32 (set train.precision_fallback=false to insist)")
    if _on_any_rank(reason is not None):
        if reason is None:
            _warn_once(f"train.precision: another rank's CPU has no native {name} matmul; "
                       f"every rank computes in fp32 (set train.precision_fallback=false to "
                       f"insist)")
        return "fp32"
    return name


def _on_any_rank(flag: bool) -> bool:
    """`flag` of any rank: ranks on hosts of other CPUs (a multi-node job) must fall back
    together, as fp16's loss scaler runs a collective every step that all ranks must join."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _warn_once(message: str) -> None:
    """From rank 0 only: every rank reaches the same conclusion."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message)


class Precision:
    def __init__(self, name: str, device: torch.device, cuda_graphs: bool = False,
                 fallback: bool = True, dense_params: Sequence[torch.Tensor] = ()) -> None:
        """`name` as asked (auto: bf16 on a GPU, fp32 on a CPU); `self.name` is what runs
        (see `effective_precision`).
        `cuda_graphs`: autocast must not cache casts across a graph capture. `dense_params`:
        the MLP parameters, whose gradients take part in fp16's overflow check."""
        if name == "auto":
            name = "bf16" if device.type == "cuda" else "fp32"
        self.requested, self.device = name, device
        self.name = name = effective_precision(name, device, fallback)
        self.dtype = AUTOCAST_DTYPES.get(name)
        self._cache_casts = not cuda_graphs
        if device.type == "cuda":  # torch's defaults differ: cuDNN convolutions would be tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = (
                name == "tf32")
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None
        self._skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._dense_params = list(dense_params)
        self._pooled: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._overflow = False

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=self._cache_casts)

    def split_at_embeddings(self, pooled: torch.Tensor) -> torch.Tensor:
        """fp16: the dense part of the step starts from a detached copy of the pooled
        embeddings, so `backward` can decide the skip before the tables' fused update runs."""
        leaf = pooled.detach().requires_grad_()
        self._pooled = (pooled, leaf)
        return leaf

    def backward(self, loss: torch.Tensor) -> None:
        """fp16, in two phases. The dense backward gives the MLP gradients (all-reduced) and the
        pooled embeddings' gradient; one all-reduced flag says whether any rank's gradients
        overflowed; only if none did, the unscaled gradient goes on into the exchange and the
        fused table update. So a skipped step changes neither tables nor MLPs on any rank."""
        if self.scaler is None:
            loss.backward()
            return
        self.scaler.scale(loss).backward()
        assert self._pooled is not None, "fp16: split_at_embeddings runs in the forward"
        (pooled, leaf), self._pooled = self._pooled, None
        grad = leaf.grad
        assert grad is not None
        self._overflow = _any_rank_non_finite(
            [grad, *[p.grad for p in self._dense_params if p.grad is not None]])
        if not self._overflow:
            pooled.backward(grad * self._scale().double().reciprocal().float())

    def step(self, optimizer) -> None:
        """The optimizer step; with fp16, skipped (and the scale lowered) where `backward`
        found an overflow on any rank."""
        if self.scaler is None:
            optimizer.step()
            return
        if self._overflow:  # perhaps on another rank only: this rank's scaler must see it too
            next(p.grad for p in self._dense_params if p.grad is not None).fill_(float("inf"))
        scale = self._scale().clone()  # the scaler only lowers it on a skip
        self.scaler.step(optimizer)
        self.scaler.update()
        self._skipped += self._scale() < scale

    def _scale(self) -> torch.Tensor:
        """The loss scale on the device, read without a sync (set once the first loss was scaled)."""
        assert self.scaler is not None
        scale = self.scaler._get_scale_async()
        assert scale is not None, "the scaler has scaled a loss by now"
        return scale

    def skipped_steps(self) -> int:
        return int(self._skipped.item())

    def log_fields(self) -> dict:
        """For metrics.jsonl: with fp16, the steps the loss scaler has skipped so far."""
        return {} if self.scaler is None else {"skipped_steps": self.skipped_steps()}

    def state_dict(self) -> dict:
        """What an exact resume needs (JSON): the loss scaler's state and the skipped steps."""
        if self.scaler is None:
            return {}
        return {"loss_scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps()}

    def load_state_dict(self, state: dict) -> None:
        """From `state_dict()`; a checkpoint of another precision leaves a fresh scaler."""
        if self.scaler is not None and "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])
            self._skipped.fill_(int(state["skipped_steps"]))


def _any_rank_non_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """One flag for the job: a non-finite value in `tensors` on any rank."""
    flag = torch.stack([~torch.isfinite(_local(t)).all() for t in tensors]).any().to(torch.int32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: of a DTensor (an FSDP2-sharded parameter's gradient) its shard."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
