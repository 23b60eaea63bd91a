"""DCN-v2 (`model.interaction: dcn`): the cross network over x_0 = [dense, sparse_1..F]
flattened (width N = (F + 1) * d), stacked under the top MLP or parallel to its hidden layers.

`parallel` keeps the model's forward one line for every interaction: its interaction returns
[cross(x_0); x_0] and its over-arch (`ParallelOverArch`) splits that again.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn
from torchrec.models.dlrm import InteractionDCNArch, OverArch
from torchrec.modules.crossnet import LowRankCrossNet, LowRankMixtureCrossNet
from torchrec.modules.mlp import MLP

from dlrm_hybrid.config import DcnConfig


def dcn_interaction(num_sparse: int, embedding_dim: int, dcn: DcnConfig
                    ) -> Tuple[nn.Module, int]:
    """The cross network on x_0 (and with `parallel` x_0 beside it), and its output width."""
    width = (num_sparse + 1) * embedding_dim
    if dcn.experts > 1:  # relu between the factors: rank is a hidden width, not a bound
        crossnet: nn.Module = LowRankMixtureCrossNet(width, dcn.layers, num_experts=dcn.experts,
                                                     low_rank=dcn.rank)
    else:
        crossnet = LowRankCrossNet(in_features=width, num_layers=dcn.layers, low_rank=dcn.rank)
    if dcn.structure == "parallel":
        return InteractionDCNArch(num_sparse, WithInput(crossnet)), 2 * width
    return InteractionDCNArch(num_sparse, crossnet), width


def dcn_over_arch(width: int, top_mlp: List[int], dcn: DcnConfig) -> nn.Module:
    """The top MLP on `dcn_interaction`'s output, `width` wide (parallel: [c; x_0], 2 N)."""
    if dcn.structure == "parallel":
        return ParallelOverArch(width // 2, top_mlp)
    return OverArch(width, top_mlp)


def rank_above_width(dcn: DcnConfig, num_sparse: int, embedding_dim: int) -> Optional[str]:
    """The line a run prints (rank 0, under its plan) where a linear cross layer's rank is above
    its width: W = U V has rank <= N = (F + 1) * d whatever `rank` is, so above N the factors
    only add 2 N (rank - N) parameters and their multiplies per layer. Not refused: checkpoints
    written with the default rank (512) on narrower models must still resume and export. None
    where the rank fits, or with experts (their relu makes the rank a hidden width)."""
    width = (num_sparse + 1) * embedding_dim
    if dcn.experts > 1 or dcn.rank <= width:
        return None
    return (f"warning: model.dcn.rank: {dcn.rank} is above the cross network's width (F + 1) * d "
            f"= {width}, the most rank its layers can have: the extra factors only cost time "
            f"and memory; train with model.dcn.rank={width} or less")


class WithInput(nn.Module):
    """`parallel`'s interaction: the cross network's output, then its input x_0."""

    def __init__(self, crossnet: nn.Module) -> None:
        super().__init__()
        self.crossnet = crossnet

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.crossnet(x0), x0), dim=1)


class ParallelOverArch(nn.Module):
    """`parallel`'s top MLP on [c; x_0] (c the cross network's output, both of width N): the
    hidden layers (top_mlp[:-1], ReLU, as torchrec's OverArch has them) on x_0 give h, the last
    layer reads [c; h]. With no hidden layer (top_mlp == [1]) h is x_0."""

    def __init__(self, cross_width: int, top_mlp: List[int]) -> None:
        super().__init__()
        self.cross_width = cross_width
        hidden = top_mlp[:-1]
        self.hidden: nn.Module = (MLP(cross_width, hidden, bias=True, activation="relu")
                                  if hidden else nn.Identity())
        self.last = nn.Linear(cross_width + (hidden[-1] if hidden else cross_width), top_mlp[-1])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        cross, x0 = features[:, :self.cross_width], features[:, self.cross_width:]
        return self.last(torch.cat((cross, self.hidden(x0)), dim=1))
