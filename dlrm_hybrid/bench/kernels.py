"""`bench --profile DIR`: the step's top kernels (GPU) or ops (CPU) by time, each with the FLOP/s
or bytes/s it achieved against the device's measured peaks, so a change to the step is a
measured prediction. The profile's trace goes to DIR for a trace viewer (Perfetto, chrome)."""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from dlrm_hybrid.compat import op_input_dtypes
from dlrm_hybrid.errors import UserError

TRACE_NAME = "trace.json"
TABLE_NAME = "top_kernels.txt"
TOP = 15
# Bytes per element of the profiler's dtype names; tensors of another dtype count no bytes.
ELEMENT_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8,
                 "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


@dataclass
class Kernel:
    """One kernel name's totals per step. `flops`: the profiler's count for its op (matmuls,
    convolutions, elementwise adds); `bytes`: its op's tensor inputs (an elementwise op also
    writes about as much, so it moves roughly twice that). Its rate is given in FLOP/s where
    it does at least a FLOP per byte read, else in GB/s."""

    name: str
    ms: float = 0.0
    calls: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0

    def achieved(self, peak_flops: float, peak_bandwidth: float) -> str:
        seconds = self.ms / 1e3
        if seconds <= 0 or not (self.flops or self.bytes):
            return "-"
        if self.flops >= self.bytes:  # at least a FLOP per byte read: a matmul's kind of work
            rate = self.flops / seconds
            return f"{rate / 1e12:.2f} TFLOP/s ({rate / peak_flops:.0%} of peak)"
        rate = self.bytes / seconds
        return f"{rate / 1e9:.1f} GB/s read ({rate / peak_bandwidth:.0%} of copy)"


def check_profile_dir(path: str) -> Path:
    """DIR for `--profile`, checked before any work: a folder (made if missing) that holds no
    earlier profile, since a trace is never written over."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"bench --profile {path}: exists and is not a folder; name a new or "
                        f"empty folder")
    above = next(p for p in folder.absolute().parents if p.exists())
    if not above.is_dir():
        raise UserError(f"bench --profile {path}: {above} is a file; name a folder elsewhere")
    for name in (TRACE_NAME, TABLE_NAME):
        if (folder / name).exists():
            raise UserError(f"bench --profile {path}: {folder / name} exists from an earlier "
                            f"profile; name another folder or move it away")
    return folder


def top_kernels(prof, steps: int, device: torch.device, top: int = TOP) -> List[Kernel]:
    """The `top` kernels by time per step. On a GPU: device kernels by name, charged with the
    op that launched each (a kernel replayed from a CUDA graph has no op: no FLOPs counted).
    On a CPU: ops by their own time."""
    totals: Dict[str, Kernel] = defaultdict(lambda: Kernel(""))
    dtypes = op_input_dtypes(prof)
    for event in prof.events():
        if device.type == "cuda":
            kernels = [k for k in event.kernels if k.duration > 0]
            longest = max(kernels, key=lambda k: k.duration, default=None)
            for kernel in kernels:
                _add(totals, kernel.name, kernel.duration,
                     (event, dtypes(event)) if kernel is longest else None)
        elif event.device_type == torch.autograd.DeviceType.CPU and event.self_cpu_time_total > 0:
            _add(totals, event.name, event.self_cpu_time_total, (event, dtypes(event)))
    rows = sorted(totals.values(), key=lambda k: k.ms, reverse=True)[:top]
    for row in rows:
        row.ms, row.calls, row.flops, row.bytes = (row.ms / 1e3 / steps, row.calls / steps,
                                                   row.flops / steps, row.bytes / steps)
    return rows


def _add(totals: Dict[str, Kernel], name: str, micros: float,
         op: Optional[Tuple[object, Sequence[str]]]) -> None:
    """Charge `micros` to kernel `name`, and the FLOPs and input bytes of `op` (the launching
    event and its input dtypes), if given."""
    row = totals[name]
    row.name = name
    row.ms += micros
    row.calls += 1
    if op is not None:
        event, dtypes = op
        row.flops += event.flops or 0
        row.bytes += sum(_numel(shape) * ELEMENT_BYTES.get(dtype, 0)
                         for shape, dtype in zip(event.input_shapes, dtypes))


def _numel(shape) -> int:
    if not isinstance(shape, (list, tuple)) or not shape:
        return 0  # a scalar argument, or a list of tensors the profiler does not size
    count = 1
    for side in shape:
        if not isinstance(side, int):
            return 0
        count *= side
    return count


def kernel_table(rows: List[Kernel], step_ms: float, device: torch.device, peak_flops: float,
                 peak_bandwidth: float) -> str:
    what = "kernels (device time)" if device.type == "cuda" else "ops (own CPU time)"
    lines = [f"  top {len(rows)} {what}, per step of {step_ms:.1f} ms:"]
    for row in rows:
        name = row.name if len(row.name) <= 70 else row.name[:67] + "..."
        lines.append(f"    {row.ms:8.2f} ms {row.ms / step_ms:5.1%} x{row.calls:<5.0f} "
                     f"{row.achieved(peak_flops, peak_bandwidth):32s} {name}")
    return "\n".join(lines)


def save_profile(prof, folder: Path, table: str) -> None:
    """The chrome trace and the printed table, each written whole under a temporary name
    first, so an interrupted run leaves no half trace."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, write in ((TRACE_NAME, prof.export_chrome_trace),
                        (TABLE_NAME, lambda p: Path(p).write_text(table + "\n"))):
        partial = folder / f".{name}.partial"
        write(str(partial))
        os.replace(partial, folder / name)
