"""The `dot` interaction alone, forward + backward: ours (dlrm_hybrid.model.interactions)
against torchrec's InteractionArch, in fp32 and under bf16 autocast.

    .venv/bin/python benchmarks/interaction.py [--batch 2048] [--features 26] [--dim 64]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torchrec.models.dlrm import InteractionArch

from dlrm_hybrid.model.interactions import DotInteraction


def ms_per_call(module, dense, sparse, dtype, reps: int = 30) -> float:
    def once():
        context = (torch.autocast(dense.device.type, dtype=dtype) if dtype
                   else contextlib.nullcontext())
        with context:
            out = module(dense, sparse)
        out.float().sum().backward()

    for _ in range(3):
        once()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--features", type=int, default=26)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    dense = torch.randn(args.batch, args.dim, requires_grad=True)
    sparse = torch.randn(args.batch, args.features, args.dim, requires_grad=True)
    print(f"dot interaction, batch {args.batch}, {args.features + 1} vectors of {args.dim}, "
          f"{torch.get_num_threads()} threads: ms per forward + backward")
    print(f"{'precision':>9} {'torchrec':>9} {'ours':>9} {'speedup':>8}")
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        ref = ms_per_call(InteractionArch(args.features), dense, sparse, dtype)
        ours = ms_per_call(DotInteraction(args.features), dense, sparse, dtype)
        print(f"{name:>9} {ref:>9.2f} {ours:>9.2f} {ref / ours:>7.2f}x")


if __name__ == "__main__":
    main()
