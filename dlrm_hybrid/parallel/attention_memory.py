"""HSTU's attention activations per rank, which `plan` prints beside the tables and the dense
part: at DLRMv4's 4,096 positions they, not the tables, bound a rank's batch.

model/hstu.py materialises each layer's [heads, n, n] scores, and autograd keeps several
[n, n] tensors for the backward: per head the scores plus the fp32 relative bias (for SiLU's
backward) and the masked weights (and their bf16 copy, under autocast); per layer the bias's
[n, n] int64 bucket index; once the mask. Measured, not derived
(benchmarks/hstu_attention_memory.py: torch's saved tensors, by storage, of 1, 2 and 4 heads at
1 and 2 layers, n = 768), bytes per [n, n] pair: 8.95 a head, 8.7 a layer, 4.35 once in fp32;
6.5 a head, 8.5 a layer, 4.35 once under bf16 autocast (the bias is fp32, so the sum and SiLU
are too). The n-wide activations (a few x n x width values a layer) are left out: a few percent
at these lengths.
"""

from __future__ import annotations

from typing import Optional

# bytes kept for the backward per [n, n] pair: a head, a layer, once (measured; above)
FP32, AUTOCAST = (8.95, 8.7, 4.35), (6.5, 8.5, 4.35)
SAVED_BYTES = {"fp32": FP32, "tf32": FP32, "bf16": AUTOCAST, "fp16": AUTOCAST,
               "auto": AUTOCAST}  # auto: bf16 on a GPU


def positions(model_cfg) -> Optional[int]:
    """The longest sequence HSTU reads: the ranker's history and its candidate, or the
    sequence model's max length; None for a model without HSTU."""
    if model_cfg.kind == "dlrm":
        return model_cfg.hstu.max_length + 1 if model_cfg.sequence == "hstu" else None
    return model_cfg.hstu.max_length if model_cfg.kind == "hstu" else None


def bytes_per_sample(model_cfg, precision: str) -> int:
    n, h = positions(model_cfg), model_cfg.hstu
    head, layer, once = SAVED_BYTES[precision]
    return int(n * n * (h.layers * (head * h.heads + layer) + once))


def describe_attention(cfg, world_size: int, free_bytes: int) -> Optional[str]:
    """`plan`'s line on HSTU's attention at full-length sequences: per sample, at this rank's
    local batch, and the largest local batch that fits `free_bytes` (what the fullest rank's
    tables and the dense part leave of the device's memory)."""
    n = positions(cfg.model)
    if n is None:
        return None
    local = cfg.data.global_batch_size // world_size
    sample = bytes_per_sample(cfg.model, cfg.train.precision)
    fits = max(0, free_bytes) // sample
    verdict = ("fits" if local <= fits else
               f"does NOT fit: at most {fits:,} full-length samples a rank fit beside the "
               f"tables and the dense part; shorter sequences (model.hstu.max_length) or a "
               f"smaller batch, or a fused jagged attention that keeps no [n, n] scores "
               f"(generative-recommenders' HSTU kernels, not in this project)")
    return (f"hstu attention activations (sequences of {n:,} positions, train.precision "
            f"{cfg.train.precision}): {_gib(sample)} a sample ({cfg.model.hstu.layers} layers of "
            f"{cfg.model.hstu.heads} heads' [{n:,}, {n:,}] scores kept for the backward), "
            f"{_gib(sample * local)} at the local batch of "
            f"{local:,}, {_gib(max(0, free_bytes))} free on the fullest rank: {verdict}")


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}GiB"
