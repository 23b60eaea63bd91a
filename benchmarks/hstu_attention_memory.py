"""What HSTU's attention keeps for the backward per [n, n] position pair: a head and a sample,
a layer and a sample, a layer (the whole batch), a sample, the batch. torch's saved tensors
(autograd.graph.saved_tensors_hooks, counted by storage) of model/hstu.py's HSTU over batches
of 1 and 2 sequences of n positions, 1 and 4 heads, 1 and 2 layers, in fp32 and under bf16
autocast, with all queries at once and with `model.hstu.attention_chunk`; beside the constants
`plan` uses (parallel/attention_memory.py).

    .venv/bin/python benchmarks/hstu_attention_memory.py [--length 768] [--chunk 128]
"""

from __future__ import annotations

import argparse

import torch

from dlrm_hybrid.model.hstu import HSTU
from dlrm_hybrid.parallel.attention_memory import HEAD, LAYER_BATCH, LAYER_BATCH_CHUNKED, ONCE
from dlrm_hybrid.train.precision import cpu_description


def saved_bytes(n: int, layers: int, heads: int, autocast: bool, batch: int = 1,
                chunk: int = 0, checkpoint_layers: bool = False) -> int:
    """Bytes autograd keeps for the backward of `batch` sequences through `layers` layers."""
    model = HSTU(64, n, layers, heads, 16, 16, 0.0, 0, chunk, checkpoint_layers)
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(batch, n, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, torch.full((batch,), n))
    return sum(storages.values())


def coefficients(n: int, autocast: bool, chunk: int = 0) -> dict:
    """Bytes per [n, n] pair, fitted to the storages kept: per layer L(b, h) = b h H + b S + P,
    once O(b) = b s + p."""
    kept = {(b, h, layers): saved_bytes(n, layers, h, autocast, b, chunk) / n ** 2
            for b, h in ((1, 1), (1, 4), (2, 1)) for layers in (1, 2)}
    layer = {(b, h): kept[b, h, 2] - kept[b, h, 1] for b, h in ((1, 1), (1, 4), (2, 1))}
    head = (layer[1, 4] - layer[1, 1]) / 3
    sample = layer[2, 1] - layer[1, 1] - head
    batch = layer[1, 1] - head - sample
    once = {b: kept[b, 1, 1] - layer[b, 1] for b in (1, 2)}
    return {"head": head, "layer_sample": sample, "layer_batch": batch,
            "sample": once[2] - once[1], "batch": 2 * once[1] - once[2]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=768)
    parser.add_argument("--chunk", type=int, default=128)
    args = parser.parse_args()
    print(f"host: {cpu_description()}, torch {torch.__version__}")
    for name, autocast in (("fp32", False), ("bf16", True)):
        for chunk in (0, args.chunk):
            c = coefficients(args.length, autocast, chunk)
            layer = LAYER_BATCH_CHUNKED if chunk else LAYER_BATCH
            print(f"hstu_attention_memory: precision={name} n={args.length} chunk={chunk} "
                  + " ".join(f"{k}={v:.2f}" for k, v in c.items())
                  + f" plan_uses: head={HEAD[name] if not chunk else 'n-wide'} "
                    f"layer_batch={layer} batch={ONCE}")


if __name__ == "__main__":
    main()
