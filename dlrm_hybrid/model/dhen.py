"""DHEN (Zhang et al. 2022, arXiv 2203.11014): a stack of layers, each running several
interaction modules on the same list of vectors X [B, l, d] (the bottom-MLP output and the F
pooled embeddings), ensembling their outputs, adding a skip connection and normalising:
X_{n+1} = LayerNorm(ensemble(u_1..u_k) + skip(X_n)). Layer n+1's modules read layer n's
ensemble, so the stack composes interactions of interactions.

Every module maps [B, l_in, d] to [B, l', d] (l' = model.dhen.width, or F + 1): the paper's W
that unifies the output sizes. The definitions (and their parameter counts, which the planner
reads) are written out in docs/dhen.md.
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dlrm_hybrid.config import DhenConfig


class ListMap(nn.Linear):
    """W X for X [B, l_in, d]: a map along the list, W in R^{l_out x l_in}, no bias."""

    def __init__(self, l_in: int, l_out: int) -> None:
        super().__init__(l_in, l_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.weight, x)


class LinearModule(nn.Module):
    """`linear`: u = W X."""

    def __init__(self, l_in: int, l_out: int, dim: int, heads: int) -> None:
        super().__init__()
        self.w = ListMap(l_in, l_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(x)


class SelfAttentionModule(nn.Module):
    """`self_attention`: u = W TransformerEncoderLayer(X), the list's vectors as the tokens."""

    def __init__(self, l_in: int, l_out: int, dim: int, heads: int) -> None:
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim,
                                                  dropout=0.0, batch_first=True)
        self.w = ListMap(l_in, l_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(self.encoder(x))


class ConvModule(nn.Module):
    """`conv`: u = W Conv2d(X), one 3x3 channel over the [l, d] plane (padding keeps its size)."""

    def __init__(self, l_in: int, l_out: int, dim: int, heads: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, kernel_size=3, padding=1)
        self.w = ListMap(l_in, l_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w(self.conv(x.unsqueeze(1)).squeeze(1))


class DotModule(nn.Module):
    """`dot` (AdvancedDLRM): the pairwise dots x_i . x_j (i < j) of the list's rows, mapped by
    one linear layer to l' * d values, read as [l', d]."""

    def __init__(self, l_in: int, l_out: int, dim: int, heads: int) -> None:
        super().__init__()
        rows, cols = torch.triu_indices(l_in, l_in, offset=1)
        self.register_buffer("flat_pairs", rows * l_in + cols, persistent=False)
        self.out = nn.Linear(len(rows), l_out * dim)
        self.l_out, self.dim = l_out, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gram = torch.bmm(x, x.transpose(1, 2)).flatten(1)
        pairs = torch.gather(gram, 1, self.flat_pairs.expand(gram.shape[0], -1))
        return self.out(pairs).view(-1, self.l_out, self.dim)


class DcnModule(nn.Module):
    """`dcn`: u = W (X^T X) + b, the paper's W (X_n X_n^T) + b with X_n in R^{d x l}: X^T X is
    the [d, d] sum over the list of the vectors' outer products. No skip inside the module."""

    def __init__(self, l_in: int, l_out: int, dim: int, heads: int) -> None:
        super().__init__()
        bound = dim ** -0.5  # as nn.Linear's default for a [d] input
        self.weight = nn.Parameter(torch.empty(l_out, dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.zeros(l_out, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.weight, torch.bmm(x.transpose(1, 2), x)) + self.bias


# model.dhen.modules -> the class, each built as (l_in, l_out, d, heads); config.DHEN_MODULES
# names the same keys (config.py imports no torch).
MODULES = {"linear": LinearModule, "self_attention": SelfAttentionModule, "conv": ConvModule,
           "dot": DotModule, "dcn": DcnModule}


class DhenLayer(nn.Module):
    """X_{n+1} = LayerNorm(ensemble(u_1..u_k) + skip(X_n)). `concat` stacks the k outputs along
    the list and maps them back to l' (P in R^{l' x k l'}); `sum` adds them. The skip maps X_n
    along the list only when its length is not l'."""

    def __init__(self, modules: List[str], l_in: int, l_out: int, dim: int, heads: int,
                 ensemble: str) -> None:
        super().__init__()
        self.interactions = nn.ModuleList([MODULES[name](l_in, l_out, dim, heads)
                                           for name in modules])
        self.project = ListMap(len(modules) * l_out, l_out) if ensemble == "concat" else None
        self.skip = nn.Identity() if l_in == l_out else ListMap(l_in, l_out)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs: List[torch.Tensor] = []
        for module in self.interactions:
            outputs.append(module(x))
        if self.project is not None:
            mixed = self.project(torch.cat(outputs, dim=1))
        else:
            mixed = torch.stack(outputs).sum(0)
        return self.norm(mixed + self.skip(x))


class DHEN(nn.Module):
    """The interaction: the list [dense, sparse_1..F] through the layers, flattened to
    [B, l' * d] for the top MLP. With `activation_checkpointing`, each layer's activations are
    recomputed in the backward instead of kept (training only)."""

    def __init__(self, num_sparse: int, dim: int, cfg: DhenConfig) -> None:
        super().__init__()
        width = cfg.width or num_sparse + 1
        self.layers = nn.ModuleList([
            DhenLayer(cfg.modules, num_sparse + 1 if i == 0 else width, width, dim, cfg.heads,
                      cfg.ensemble) for i in range(cfg.layers)])
        self.checkpointing = cfg.activation_checkpointing
        self.out_features = width * dim

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        x = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        if self.checkpointing and self.training and not torch.jit.is_scripting():
            return self._recomputed(x).flatten(1)
        for layer in self.layers:
            x = layer(x)
        return x.flatten(1)

    @torch.jit.unused
    def _recomputed(self, x: torch.Tensor) -> torch.Tensor:
        """The layers, each under checkpoint when there is a backward to recompute it for."""
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if torch.is_grad_enabled() else layer(x)
        return x
