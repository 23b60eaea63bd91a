"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Each takes dense [B, D] and sparse [B, F, D] and returns [B, out_features] for the top MLP.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torchrec.models.dlrm import InteractionArch, InteractionDCNArch
from torchrec.modules.crossnet import LowRankCrossNet


class DotInteraction(InteractionArch):
    """Pairwise dots of [dense, sparse...] concatenated with the dense vector (DLRM's `dot`).

    torchrec's InteractionArch, plus the option of each vector's dot with itself.
    """

    def __init__(self, num_sparse_features: int, self_interaction: bool = False) -> None:
        super().__init__(num_sparse_features)
        if self_interaction:
            n = num_sparse_features + 1
            self.triu_indices = torch.triu_indices(n, n, offset=0)


class CatInteraction(nn.Module):
    """No interaction: the dense vector and every pooled embedding, concatenated."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        return torch.cat((dense_features, sparse_features.flatten(1)), dim=1)


def build_interaction(kind: str, num_sparse: int, dense_dim: int, embedding_dim: int,
                      self_interaction: bool = False, dcn_layers: int = 3,
                      dcn_low_rank: int = 512) -> Tuple[nn.Module, int]:
    """The interaction module and the width of its output."""
    if kind == "dot":
        n = num_sparse + 1
        pairs = n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2
        return DotInteraction(num_sparse, self_interaction), dense_dim + pairs
    if kind == "cat":
        return CatInteraction(), dense_dim + num_sparse * embedding_dim
    if kind == "dcn":
        width = (num_sparse + 1) * embedding_dim
        crossnet = LowRankCrossNet(in_features=width, num_layers=dcn_layers, low_rank=dcn_low_rank)
        return InteractionDCNArch(num_sparse, crossnet), width
    raise ValueError(f"model.interaction: unknown interaction {kind!r}")
