"""The DLRM: bottom MLP over dense features, embedding bags over categorical ones, an
interaction, and a top MLP giving the click logit."""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.functional import binary_cross_entropy_with_logits
from torchrec.models.dlrm import DenseArch, OverArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_hybrid.model.embeddings import embedding_tables
from dlrm_hybrid.model.interactions import build_interaction


class DLRM(nn.Module):
    def __init__(self, num_dense: int, tables: List[EmbeddingBagConfig], bottom_mlp: List[int],
                 top_mlp: List[int], interaction: str = "dot", self_interaction: bool = False,
                 dcn_layers: int = 3, dcn_low_rank: int = 512,
                 embedding_device: torch.device = torch.device("meta")) -> None:
        """Embedding tables start on `embedding_device`; "meta" allocates nothing, because
        sharding materialises each table only on the rank that owns it."""
        super().__init__()
        self.feature_names = [f for t in tables for f in t.feature_names]
        self.dense_arch = DenseArch(num_dense, bottom_mlp)
        self.embedding_bags = EmbeddingBagCollection(tables=tables, device=embedding_device)
        self.interaction, width = build_interaction(
            interaction, len(self.feature_names), bottom_mlp[-1], tables[0].embedding_dim,
            self_interaction, dcn_layers, dcn_low_rank)
        self.over_arch = OverArch(width, top_mlp)
        # Set by the training step: fp16 loss scaling cuts the backward in two here, and
        # CUDA Graphs replace `dense_loss` by its captured version.
        self.embedding_grad_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self._feature_order: Optional[torch.Tensor] = None
        self._pooled_keys: Optional[List[str]] = None

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Click logits [B]; given `labels`, the step's mean log loss instead (training)."""
        if is_fx_symbolic_tracing():  # torchrec's train pipeline: it looks for the lookup's input
            return self.embedding_bags(sparse)
        pooled = self.pooled_embeddings(sparse)
        if labels is None:
            return self.logits(dense, pooled)
        if self.embedding_grad_transform is not None and pooled.requires_grad:
            pooled = self.embedding_grad_transform(pooled)
        return self.dense_loss(dense, pooled, labels)

    def pooled_embeddings(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """[B, F, D] in feature order. A sharded collection returns features grouped by owner
        rank: one gather puts them back (none when the order already matches)."""
        pooled = self.embedding_bags(sparse)
        values = pooled.values().view(pooled.values().shape[0], len(self.feature_names), -1)
        if pooled.keys() != self._pooled_keys:
            self._pooled_keys = list(pooled.keys())
            order = [self._pooled_keys.index(f) for f in self.feature_names]
            self._feature_order = (None if order == sorted(order)
                                   else torch.tensor(order, device=values.device))
        return values if self._feature_order is None else values.index_select(1, self._feature_order)

    def logits(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return self.over_arch(self.interaction(self.dense_arch(dense), pooled)).squeeze(1)

    def dense_loss(self, dense: torch.Tensor, pooled: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:
        """The dense part of a training step: the part CUDA Graphs capture."""
        return binary_cross_entropy_with_logits(self.logits(dense, pooled).float(), labels)


def build_model(model_cfg, spec, embedding_device: torch.device = torch.device("meta")) -> DLRM:
    tables = embedding_tables(spec, model_cfg.embedding_dim, model_cfg.embedding_precision)
    return DLRM(spec.num_dense, tables, model_cfg.bottom_mlp, model_cfg.top_mlp,
                model_cfg.interaction, model_cfg.self_interaction, model_cfg.dcn_layers,
                model_cfg.dcn_low_rank, embedding_device)
