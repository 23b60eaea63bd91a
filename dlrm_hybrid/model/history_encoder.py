"""A user vector from the user's recent items in order (model.user_tower.encoder history_*).

The input is the history's item vectors, looked up in the item tower's own table (one shared,
sharded table: model/two_tower.py), as [B, L, D] slots left-aligned (slot j: the j-th of the
user's last L items, oldest first) with each row's count n; slots from n on are padding and
never read.

- `history_mean`: the mean of the n vectors (zeros for an empty history).
- `history_attention` (SASRec-style, Kang & McAuley 2018): each item vector plus a learned
  embedding of its recency (0: the latest), after a learned start token, through a pre-norm
  causal transformer (torch's TransformerEncoder; position t attends to positions <= t only,
  so it never reads padding, which comes after); the output at the last item (the start
  token's for an empty history) is the user's vector.

The encoder's output goes through the user tower's MLP. Training, evaluation and the exported
tower (serve/retrieval_export.py) run this same module. No `from __future__ import
annotations`: TorchScript compiles it from its annotations.
"""

import torch
from torch import nn

ENCODERS = ("history_mean", "history_attention")


class HistoryMean(nn.Module):
    """The mean of the history's item vectors."""

    def __init__(self, length: int) -> None:
        super().__init__()
        self.length = length

    def forward(self, items: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """items [B, L, D] (slots from counts[b] on are padding), counts [B] -> [B, D]."""
        used = torch.arange(self.length, device=items.device)[None, :] < counts[:, None]
        total = (items * used[:, :, None].to(items.dtype)).sum(1)
        return total / counts.clamp(min=1)[:, None].to(items.dtype)


class HistoryAttention(nn.Module):
    """A start token and the items with their recency through a causal transformer."""

    def __init__(self, dim: int, length: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.length = length
        self.recency = nn.Embedding(length, dim)
        self.start = nn.Parameter(torch.zeros(1, 1, dim))
        nn.init.normal_(self.recency.weight, std=0.02)
        nn.init.normal_(self.start, std=0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.transformer = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        causal = torch.triu(torch.full((length + 1, length + 1), float("-inf")), diagonal=1)
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, items: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """items [B, L, D] (slots from counts[b] on are padding), counts [B] -> [B, D]."""
        slots = torch.arange(self.length, device=items.device)
        used = (slots[None, :] < counts[:, None])[:, :, None].to(items.dtype)
        recency = (counts[:, None] - 1 - slots[None, :]).clamp(min=0)
        x = (items + self.recency(recency).to(items.dtype)) * used
        x = torch.cat([self.start.expand(items.shape[0], 1, items.shape[2]).to(x.dtype), x], 1)
        x = self.norm(self.transformer(x, mask=self.causal.to(x.dtype)))
        return x[torch.arange(items.shape[0], device=items.device), counts.long()]


def history_encoder(tower_cfg, dim: int) -> nn.Module:
    """The encoder `model.user_tower` names, over `dim`-wide item vectors."""
    if tower_cfg.encoder == "history_mean":
        return HistoryMean(tower_cfg.history_length)
    return HistoryAttention(dim, tower_cfg.history_length, tower_cfg.attention_layers,
                            tower_cfg.attention_heads, tower_cfg.dropout)
