"""HSTU's attention activations per rank, which `plan` prints beside the tables and the dense
part: at DLRMv4's 4,096 positions they, not the tables, bound a rank's batch.

model/hstu.py materialises each layer's [heads, c, n] scores for a block of c queries (c = n
unless `model.hstu.attention_chunk`). Measured, not derived (benchmarks/hstu_attention_memory.py:
torch's saved tensors by storage, fitted over batches of 1 and 2, 1 and 4 heads, 1 and 2 layers,
n = 768), bytes per [n, n] position pair:
- all queries at once: 8.95 a head and a sample in each layer in fp32, 6.48 under bf16 autocast
  (the scores plus the fp32 bias, kept for SiLU's backward, and the masked weights, kept for the
  value product); 8.0 a layer for the whole batch (the bias's int64 bucket index); 4.0 once (the
  causal mask);
- in blocks (`attention_chunk`): a block's scores are made again in the backward, so a sample
  keeps no [n, n] values (0.5-0.95 a head at n = 768: the n-wide tensors); 12.0 a layer for the
  batch (the index and the fp32 bias) and 4.0 once. What a block holds while it is computed,
  c / n of a layer's scores, is what a sample then costs (`head` x heads x c x n).
The n-wide activations (the layer's inputs, its U, V, Q, K and their SiLU, the gated output:
tens of values a position at DLRMv4's widths) are measured for the configured widths when `plan`
runs (`positionwise_bytes`: one layer's saved tensors at three short lengths), since in blocks
they are most of what a sample keeps.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

HEAD = {"fp32": 8.95, "tf32": 8.95, "bf16": 6.5, "fp16": 6.5, "auto": 6.5}  # auto: bf16 on a GPU
LAYER_BATCH, LAYER_BATCH_CHUNKED, ONCE = 8.0, 12.0, 4.0


def positions(model_cfg) -> Optional[int]:
    """The longest sequence HSTU reads: the ranker's history and its candidate, or the
    sequence model's max length; None for a model without HSTU."""
    if model_cfg.kind == "dlrm":
        return model_cfg.hstu.max_length + 1 if model_cfg.sequence == "hstu" else None
    return model_cfg.hstu.max_length if model_cfg.kind == "hstu" else None


def queries(model_cfg) -> int:
    """The query positions one block computes (all of them unless attention_chunk)."""
    n, chunk = positions(model_cfg), model_cfg.hstu.attention_chunk
    return chunk if 0 < chunk < n else n


def bytes_per_sample(model_cfg, precision: str) -> int:
    """What a sample adds: every layer's scores kept for the backward (or, in blocks, one
    block's while it is computed) and every layer's n-wide activations; with
    `checkpoint_layers`, every layer's input (fp32) and one layer's activations at a time."""
    n, h = positions(model_cfg), model_cfg.hstu
    c = queries(model_cfg)
    scores = HEAD[precision] * h.heads * c * n  # one layer's, or one block's
    layer = positionwise_bytes(model_cfg, precision) * n
    if h.checkpoint_layers:
        return int(h.layers * 4 * model_cfg.embedding_dim * n + layer + scores)
    return int(scores * (h.layers if c == n else 1) + layer * h.layers)


def positionwise_bytes(model_cfg, precision: str) -> float:
    """Bytes one layer keeps per position of a sample besides its [n, n] scores, for the
    configured widths: its saved tensors at 16, 32 and 64 positions in blocks of 4 queries,
    fitted as constant (the weights) + a n + b n^2 (the bias and mask): a."""
    import torch  # not at import: `plan` of a model without HSTU needs none (tests/test_start.py)

    from dlrm_hybrid.model.hstu import HSTULayer, head_widths

    h = model_cfg.hstu
    dqk, dv = head_widths(model_cfg.embedding_dim, h.heads, h.attention_dim, h.linear_dim)
    layer = HSTULayer(model_cfg.embedding_dim, 64, h.heads, dqk, dv, h.dropout, 0, 4)
    kept = {}
    for n in (16, 32, 64):
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, n, model_cfg.embedding_dim, requires_grad=True)
        with torch.autocast("cpu", torch.bfloat16, enabled=HEAD[precision] < HEAD["fp32"]), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, torch.ones(1, n, n), None)
        kept[n] = sum(storages.values())
    lengths = np.array([16.0, 32.0, 64.0])
    fit = np.linalg.solve(np.stack([np.ones(3), lengths, lengths ** 2], 1),
                          np.array([kept[16], kept[32], kept[64]], np.float64))
    return float(fit[1])


def bytes_per_batch(model_cfg) -> int:
    """What the batch shares: each layer's bias index (and bias, in blocks) and the mask."""
    n, h = positions(model_cfg), model_cfg.hstu
    layer = LAYER_BATCH if queries(model_cfg) == n else LAYER_BATCH_CHUNKED
    return int(n * n * (h.layers * layer + ONCE))


def describe_attention(cfg, world_size: int, free_bytes: int) -> Optional[str]:
    """`plan`'s line on HSTU's attention at full-length sequences: per sample, at this rank's
    local batch, and the largest local batch that fits `free_bytes` (what the fullest rank's
    tables and the dense part leave of the device's memory)."""
    n = positions(cfg.model)
    if n is None:
        return None
    m, local = cfg.model, cfg.data.global_batch_size // world_size
    sample, shared = bytes_per_sample(m, cfg.train.precision), bytes_per_batch(m)
    fits = max(0, free_bytes - shared) // sample
    c = queries(m)
    how = (f"{m.hstu.layers} layers of {m.hstu.heads} heads' [{n:,}, {n:,}] scores kept for "
           f"the backward" if c == n else f"one block of {c:,} queries x {n:,} keys at a time, "
           f"model.hstu.attention_chunk {c:,}, made again in the backward")
    if m.hstu.checkpoint_layers:
        how += "; layers run again in the backward (model.hstu.checkpoint_layers)"
    remedy = ("set model.hstu.attention_chunk (e.g. 256), or " if c == n else
              "set model.hstu.checkpoint_layers, or " if not m.hstu.checkpoint_layers else "")
    remedy += ("more ranks or a smaller global batch (a local batch of at most that), or "
               "shorter sequences (model.hstu.max_length)")
    verdict = ("fits" if local <= fits else
               f"does NOT fit: at most {fits:,} full-length samples a rank fit beside the "
               f"tables and the dense part; {remedy}")
    return (f"hstu attention activations (sequences of {n:,} positions, train.precision "
            f"{cfg.train.precision}): {_gib(sample)} a sample ({how}) and {_gib(shared)} for "
            f"the batch, {_gib(sample * local + shared)} at the local batch of {local:,}, "
            f"{_gib(max(0, free_bytes))} free on the fullest rank: {verdict}")


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f}GiB" if n >= 2**30 else f"{n / 2**20:,.0f}MiB"
