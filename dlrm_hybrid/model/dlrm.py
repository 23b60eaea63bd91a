"""The DLRM: bottom MLP over dense features, embedding bags over categorical ones, an
interaction, and a top MLP giving the click logit."""

from __future__ import annotations

from typing import List

import torch
from torch import nn
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

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """Click logits, [B]."""
        dense_out = self.dense_arch(dense)
        # A sharded collection returns its features grouped by owner rank: reorder by name.
        pooled = self.embedding_bags(sparse).to_dict()
        sparse_out = torch.stack([pooled[f] for f in self.feature_names], dim=1)
        return self.over_arch(self.interaction(dense_out, sparse_out)).squeeze(1)


def build_model(model_cfg, spec, embedding_device: torch.device = torch.device("meta")) -> DLRM:
    tables = embedding_tables(spec, model_cfg.embedding_dim, model_cfg.embedding_precision)
    return DLRM(spec.num_dense, tables, model_cfg.bottom_mlp, model_cfg.top_mlp,
                model_cfg.interaction, model_cfg.self_interaction, model_cfg.dcn_layers,
                model_cfg.dcn_low_rank, embedding_device)
