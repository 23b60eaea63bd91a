"""Feature interactions between the bottom-MLP output and the pooled embeddings.

Each takes dense [B, D] and sparse [B, F, D] and returns [B, out_features] for the top MLP.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

from dlrm_hybrid.config import DcnConfig, DhenConfig
from dlrm_hybrid.model.alignment import aligned
from dlrm_hybrid.model.cross import dcn_interaction
from dlrm_hybrid.model.dhen import DHEN


class PairwiseDots(torch.autograd.Function):
    """For each sample's vectors z = [dense, sparse_1..F], the dots z_i . z_j of the Gram
    matrix entries `flat_pairs` (i * n + j, i <= j); `mirrored` holds j * n + i.

    Autograd through cat + bmm + gather (torchrec's InteractionArch) copies the vectors into
    place, casts them (twice, one copy strided) under autocast, and runs two bmm backward.
    Here they are written once, already cast, and the symmetric Gram matrix needs one bmm
    back: dZ = (G + G^T) Z, G the output gradient scattered to (i, j) and (j, i). Measured on 2
    CPU cores, batch 2048, 27 vectors of 64, forward + backward: benchmarks/interactions.py.
    """

    @staticmethod
    def forward(ctx, dense: torch.Tensor, sparse: torch.Tensor, flat_pairs: torch.Tensor,
                mirrored: torch.Tensor) -> torch.Tensor:
        device = sparse.device.type
        dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                 else sparse.dtype)
        batch, features, dim = sparse.shape
        vectors = torch.empty(batch, features + 1, dim, dtype=dtype, device=sparse.device)
        vectors[:, 0] = dense
        vectors[:, 1:] = sparse
        ctx.save_for_backward(vectors, flat_pairs, mirrored)
        ctx.dtypes = dense.dtype, sparse.dtype
        gram = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)
        return torch.gather(gram, 1, flat_pairs.expand(batch, -1))  # index_select: 1.3-4x slower

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        vectors, flat_pairs, mirrored = ctx.saved_tensors
        batch, n, _ = vectors.shape
        grad = grad.float()  # index_add_ in bf16 is 2x slower than in fp32 and a cast
        symmetric = grad.new_zeros(batch, n * n).index_add_(1, flat_pairs, grad)
        symmetric.index_add_(1, mirrored, grad)  # a diagonal (self) pair gets 2g, as it should
        grad_vectors = torch.bmm(symmetric.view(batch, n, n).to(vectors.dtype), vectors)
        dense_dtype, sparse_dtype = ctx.dtypes
        return (grad_vectors[:, 0].to(dense_dtype), grad_vectors[:, 1:].to(sparse_dtype),
                None, None)


class DotInteraction(nn.Module):
    """Pairwise dots of [dense, sparse...] concatenated with the dense vector (DLRM's `dot`),
    optionally with each vector's dot with itself. Same outputs as torchrec's InteractionArch,
    followed by `padding` zero columns (model/alignment.py)."""

    def __init__(self, num_sparse_features: int, self_interaction: bool = False,
                 padding: int = 0) -> None:
        super().__init__()
        n = num_sparse_features + 1
        rows, cols = torch.triu_indices(n, n, offset=0 if self_interaction else 1)
        self.register_buffer("flat_pairs", rows * n + cols, persistent=False)
        self.register_buffer("mirrored", cols * n + rows, persistent=False)
        self.padding = padding

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # a served model (serve/): no autograd, plain ops
            vectors = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
            gram = torch.bmm(vectors, vectors.transpose(1, 2)).flatten(1)
            pairs = torch.gather(gram, 1, self.flat_pairs.expand(gram.shape[0], -1))
        else:
            pairs = _pairwise_dots(dense_features, sparse_features, self.flat_pairs, self.mirrored)
        if self.padding:
            zeros = pairs.new_zeros(pairs.shape[0], self.padding)
            return torch.cat((dense_features, pairs, zeros), dim=1)
        return torch.cat((dense_features, pairs), dim=1)


@torch.jit.unused
def _pairwise_dots(dense: torch.Tensor, sparse: torch.Tensor, flat_pairs: torch.Tensor,
                   mirrored: torch.Tensor) -> torch.Tensor:
    return PairwiseDots.apply(dense, sparse, flat_pairs, mirrored)


class CatInteraction(nn.Module):
    """No interaction: the dense vector and every pooled embedding, concatenated."""

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        return torch.cat((dense_features, sparse_features.flatten(1)), dim=1)


class FactorizationMachine(nn.Module):
    """`fm`: a factorization machine over the features' vectors e_t and first-order weights w_t
    (the FM part of DeepFM; Rendle 2010 with one-hot fields): first order sum_t w_t, second
    order sum_{s<t} e_s . e_t = 1/2 (||sum_t e_t||^2 - sum_t ||e_t||^2). Its output, the
    bottom-MLP output followed by those two numbers, feeds the top MLP.

    Both terms need only per-sample sums over the tables, [sum_t e_t, sum_t ||e_t||^2,
    sum_t w_t] (`fm_sums`): with `parallel.exchange: des` the tables' owners add up their share
    of them (parallel/exchange.py) and `from_sums` takes it from there."""

    def __init__(self, num_features: int, dim: int) -> None:
        super().__init__()
        self.num_features, self.dim = num_features, dim

    def forward(self, dense_features: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """`pooled`: [B, F * D + F * 4], the vectors, then each first-order table's 4 columns."""
        split = self.num_features * self.dim
        vectors = pooled[:, :split].unflatten(1, (self.num_features, self.dim))
        first_order = pooled[:, split:].unflatten(1, (self.num_features, -1))[:, :, 0]
        return self.from_sums(dense_features, fm_sums(vectors, first_order))

    def from_sums(self, dense_features: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
        vector_sum, squares, first = sums[:, :self.dim], sums[:, self.dim], sums[:, self.dim + 1]
        second = 0.5 * ((vector_sum * vector_sum).sum(1) - squares)
        return torch.cat((dense_features, first[:, None], second[:, None]), dim=1)


def fm_sums(vectors: torch.Tensor, first_order: torch.Tensor) -> torch.Tensor:
    """[B, F, D] vectors and [B, F] first-order weights -> [B, D + 2]: their sums over F."""
    squares = (vectors * vectors).sum((1, 2))
    return torch.cat((vectors.sum(1), squares[:, None], first_order.sum(1)[:, None]), dim=1)


def build_interaction(kind: str, num_sparse: int, dense_dim: int, embedding_dim: int,
                      self_interaction: bool = False, dcn: DcnConfig = DcnConfig(),
                      dhen: DhenConfig = DhenConfig(), align: bool = False
                      ) -> Tuple[nn.Module, int]:
    """The interaction module and the width of its output (`dcn`, `dhen`: those interactions'
    settings, read only). `align`: `dot` pads its output to an aligned width (the others'
    widths are multiples of the embedding dimension already, or tiny)."""
    if kind == "dot":
        n = num_sparse + 1
        width = dense_dim + (n * (n + 1) // 2 if self_interaction else n * (n - 1) // 2)
        padding = aligned(width) - width if align else 0
        return DotInteraction(num_sparse, self_interaction, padding), width + padding
    if kind == "cat":
        return CatInteraction(), dense_dim + num_sparse * embedding_dim
    if kind == "dcn":
        return dcn_interaction(num_sparse, embedding_dim, dcn)
    if kind == "fm":
        return FactorizationMachine(num_sparse, embedding_dim), dense_dim + 2
    if kind == "dhen":
        dhen_module = DHEN(num_sparse, embedding_dim, dhen)
        return dhen_module, dhen_module.out_features
    raise ValueError(f"model.interaction: unknown interaction {kind!r}")
