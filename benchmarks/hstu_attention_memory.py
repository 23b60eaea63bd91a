"""What HSTU's attention keeps for the backward per [n, n] position pair: a head, a layer,
once. torch's saved tensors (autograd.graph.saved_tensors_hooks, counted by storage) of
model/hstu.py's HSTU over one sample of n positions, in fp32 and under bf16 autocast, at 1, 2
and 4 heads and 1 and 2 layers, beside the constants `plan` uses (parallel/attention_memory.py).

    .venv/bin/python benchmarks/hstu_attention_memory.py [--length 768]
"""

from __future__ import annotations

import argparse

import torch

from dlrm_hybrid.model.hstu import HSTU
from dlrm_hybrid.parallel.attention_memory import SAVED_BYTES
from dlrm_hybrid.train.precision import cpu_description


def saved_bytes(n: int, layers: int, heads: int, autocast: bool) -> int:
    """Bytes autograd keeps for the backward of one sample through `layers` layers."""
    model = HSTU(64, n, layers, heads, 16, 16, 0.0, 0)
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(1, n, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, torch.full((1,), n))
    return sum(storages.values())


def coefficients(n: int, autocast: bool) -> tuple:
    """Bytes per [n, n] pair (a head, a layer, once), fitted to the storages kept."""
    kept = {(h, layers): saved_bytes(n, layers, h, autocast) / n ** 2
            for h in (1, 2, 4) for layers in (1, 2)}
    per_layer = {h: kept[h, 2] - kept[h, 1] for h in (1, 2, 4)}
    head = (per_layer[4] - per_layer[1]) / 3
    layer = per_layer[1] - head
    return head, layer, kept[1, 1] - head - layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=768)
    n = parser.parse_args().length
    print(f"host: {cpu_description()}, torch {torch.__version__}")
    for name, autocast in (("fp32", False), ("bf16", True)):
        head, layer, once = coefficients(n, autocast)
        used = SAVED_BYTES[name]
        print(f"hstu_attention_memory: precision={name} n={n} bytes_per_pair_head={head:.2f} "
              f"layer={layer:.2f} once={once:.2f} plan_uses={used[0]}/{used[1]}/{used[2]}")


if __name__ == "__main__":
    main()
