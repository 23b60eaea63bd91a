"""HSTU, the Hierarchical Sequential Transduction Unit (Zhai et al., ICML 2024, "Actions Speak
Louder than Words"; meta-recsys/generative-recommenders, research/modeling/sequential/hstu.py).

Each layer, over a user's items in order (x [n, D]):

    U, V, Q, K = split(SiLU(LayerNorm(x) @ W_uvqk))           one matrix, no bias
    A = SiLU(Q K^T + rab(position, time)) / N * causal        pointwise: no softmax
    x = x + f2(Dropout(U * LayerNorm(A V)))                    the U gate, then a residual

with N the configured maximum length (a constant, so a sequence's outputs do not depend on how
much padding its batch carries), causal = 1 where key <= query, and rab a learned bias per
relative position and per log2 bucket of the time gap, one per layer, as the reference's
`RelativeBucketedTimeAndPositionBasedBias` (bucket = floor(ln(max(|dt|, 1)) / 0.301)). The input
is the item vectors scaled by sqrt(D) plus a learned absolute position (0: the oldest item),
dropout; the output at each position is L2-normalised (the reference's `l2_norm` user vector).

One deliberate difference: the reference's time bias for query i uses the time of the item
after i (the request's time); here it uses i's own time, so training, evaluation and serving
need no time beyond the history's own.

Sequences are left-aligned in [B, n, D] with each one's count (slots from count on are padding):
the layout fbgemm's `jagged_to_padded_dense` gives from (values, offsets), and the attention
never reads padding (a valid query's keys are all earlier, so valid). No `from __future__
import annotations`: TorchScript compiles it for export.
"""

import math
from typing import List, Optional

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

EPS = 1e-6  # the reference's layer-norm and L2-norm epsilon (written out where TorchScript reads)


class RelativeBias(nn.Module):
    """rab(i, j): a learned weight per relative position i - j (0 .. N-1) plus, with times, one
    per bucket of |t_i - t_j|."""

    def __init__(self, length: int, time_buckets: int) -> None:
        super().__init__()
        self.position = nn.Parameter(torch.empty(length).normal_(0.0, 0.02))
        self.time = nn.Parameter(torch.empty(time_buckets + 1).normal_(0.0, 0.02))
        self.buckets = time_buckets

    def forward(self, n: int, times: Optional[torch.Tensor],
                positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[1 or B, n, n]; `times` [B, n] seconds (any origin) or None (positions only);
        `positions` [n] each slot's position (None: 0 .. n-1)."""
        slots = torch.arange(n, device=self.position.device) if positions is None else positions
        relative = (slots[:, None] - slots[None, :]).clamp(min=0)  # above the diagonal: masked
        bias = self.position[relative][None]
        if times is not None:
            gap = (times[:, :, None] - times[:, None, :]).abs().clamp(min=1.0)
            bucket = (torch.log(gap) / 0.301).long().clamp(0, self.buckets)  # ln 2, as written
            bias = bias + self.time[bucket]
        return bias


class HSTULayer(nn.Module):
    """One HSTU layer (module docstring)."""

    def __init__(self, dim: int, length: int, heads: int, attention_dim: int, linear_dim: int,
                 dropout: float, time_buckets: int, chunk: int = 0) -> None:
        super().__init__()
        self.dim, self.length, self.heads, self.chunk = dim, length, heads, chunk
        self.attention_dim, self.linear_dim = attention_dim, linear_dim
        width = heads * (2 * linear_dim + 2 * attention_dim)
        self.uvqk = nn.Parameter(torch.empty(dim, width).normal_(0.0, 0.02))  # the reference's
        self.out = nn.Linear(heads * linear_dim, dim)
        nn.init.xavier_uniform_(self.out.weight)
        self.rab = RelativeBias(length, time_buckets)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, causal: torch.Tensor, times: Optional[torch.Tensor],
                positions: Optional[torch.Tensor] = None,
                keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, n, D]; causal [1 or B, n, n] 1.0 where the query may read the key; keys [B, n]
        1.0 where a key is a sequence's (None: all); -> [B, n, D]."""
        b, n, _ = x.shape
        h, dqk, dv = self.heads, self.attention_dim, self.linear_dim
        normed = F.layer_norm(x, [self.dim], eps=1e-6)
        u, v, q, k = torch.split(F.silu(normed @ self.uvqk), [h * dv, h * dv, h * dqk, h * dqk],
                                 dim=-1)
        q, k, v = q.reshape(b, n, h, dqk), k.reshape(b, n, h, dqk), v.reshape(b, n, h, dv)
        bias = self.rab(n, times, positions)
        if keys is None:
            keys = torch.ones(1, n, dtype=x.dtype, device=x.device)
        step = self.chunk if 0 < self.chunk < n else max(n, 1)
        blocks: List[torch.Tensor] = []
        for first in range(0, max(n, 1), step):  # queries a block at a time (attention_chunk)
            end = min(n, first + step)
            if step < n and self.training and torch.is_grad_enabled() \
                    and not torch.jit.is_scripting():
                blocks.append(self._attend_recomputed(q[:, first:end], k, v, bias[:, first:end],
                                                      causal[:, first:end], keys))
            else:
                blocks.append(self._attend(q[:, first:end], k, v, bias[:, first:end],
                                           causal[:, first:end], keys))
        attended = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 1)
        gated = u * F.layer_norm(attended.reshape(b, n, h * dv), [h * dv], eps=1e-6)
        return x + self.out(self.dropout(gated))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                causal: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Queries q [B, c, h, dqk] against every key: [B, c, h, dv]."""
        scores = torch.einsum("bnhd,bmhd->bhnm", q, k)
        weights = F.silu(scores + bias[:, None]) / self.length
        weights = weights * causal[:, None] * keys[:, None, None, :]
        return torch.einsum("bhnm,bmhd->bnhd", weights, v)

    @torch.jit.unused
    def _attend_recomputed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           bias: torch.Tensor, causal: torch.Tensor,
                           keys: torch.Tensor) -> torch.Tensor:
        """`_attend` whose [c, n] scores are not kept for the backward but made again in it: a
        block's activations live only while it is computed (activation checkpointing)."""
        return checkpoint(self._attend, q, k, v, bias, causal, keys, use_reentrant=False)


class HSTU(nn.Module):
    """The stacked, causal HSTU encoder over a user's item vectors."""

    def __init__(self, dim: int, length: int, layers: int, heads: int, attention_dim: int,
                 linear_dim: int, dropout: float, time_buckets: int, chunk: int = 0,
                 checkpoint_layers: bool = False) -> None:
        super().__init__()
        self.dim, self.length, self.checkpoint_layers = dim, length, checkpoint_layers
        self.position = nn.Embedding(length, dim)
        nn.init.trunc_normal_(self.position.weight, std=math.sqrt(1.0 / dim))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList([
            HSTULayer(dim, length, heads, attention_dim, linear_dim, dropout, time_buckets, chunk)
            for _ in range(layers)])

    def forward(self, items: torch.Tensor, counts: torch.Tensor,
                times: Optional[torch.Tensor] = None) -> torch.Tensor:
        """items [B, n, D] (n <= length; slots from counts[b] on are padding), counts [B],
        times [B, n] or None -> [B, n, D], L2-normalised at each sequence's positions, 0 past
        its end. Position t reads positions <= t only."""
        b, n, _ = items.shape
        slots = torch.arange(n, device=items.device)
        used = (slots[None, :] < counts[:, None]).to(items.dtype)  # [B, n]
        causal = (slots[:, None] >= slots[None, :]).to(items.dtype)[None]  # [1, n, n]: no batch
        x = items * math.sqrt(self.dim) + self.position.weight[:n][None].to(items.dtype)
        x = self.dropout(x) * used[:, :, None]
        for layer in self.layers:
            if self.checkpoint_layers and self.training and torch.is_grad_enabled() \
                    and not torch.jit.is_scripting():
                x = self._layer_recomputed(layer, x, causal, times, used)
            else:
                x = layer(x, causal, times, None, used)
            x = x * used[:, :, None]
        return F.normalize(x, dim=-1, eps=1e-6)

    @torch.jit.unused
    def _layer_recomputed(self, layer: nn.Module, x: torch.Tensor, causal: torch.Tensor,
                          times: Optional[torch.Tensor], used: torch.Tensor) -> torch.Tensor:
        """`layer` keeping only its input for the backward, run again in it
        (`model.hstu.checkpoint_layers`; dropout draws the same masks again)."""
        return checkpoint(layer, x, causal, times, None, used, use_reentrant=False)

    def after_history(self, history: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[N, D]: each candidate's output as `forward` gives it at the last position of the
        history followed by that candidate alone, for all N in one pass (DLRMv3's layout):
        the history [c, D] once, every candidate at position c reading the history and itself,
        none reading another. Positions only (no times)."""
        c, n = history.shape[0], history.shape[0] + candidates.shape[0]
        slots = torch.arange(n, device=history.device)
        positions = slots.clamp(max=c)
        reads = ((slots[None, :] < c) & (slots[:, None] >= slots[None, :])) | (
            slots[:, None] == slots[None, :])
        x = torch.cat([history, candidates], 0) * math.sqrt(self.dim)
        x = self.dropout(x + self.position.weight[positions].to(x.dtype))[None]
        for layer in self.layers:
            x = layer(x, reads.to(x.dtype)[None], None, positions)
        return F.normalize(x[0, c:], dim=-1, eps=1e-6)


def last_positions(outputs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """[B, D]: each sequence's output at its last item (zeros for an empty one): the user's
    vector for the next item."""
    last = outputs[torch.arange(outputs.shape[0], device=outputs.device),
                   (counts - 1).clamp(min=0)]
    return last * (counts > 0)[:, None].to(outputs.dtype)


def head_widths(dim: int, heads: int, attention_dim: int, linear_dim: int) -> List[int]:
    """(attention_dim, linear_dim) per head: 0 means dim / heads (the reference's ML settings:
    dqk = dv = 50 with one head at width 50; 25 with two)."""
    return [attention_dim or dim // heads, linear_dim or dim // heads]
