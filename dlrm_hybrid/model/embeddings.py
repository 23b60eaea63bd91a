"""Embedding table configs: one table per categorical feature, or its parts where
`model.compositional` replaces it (compositional.py)."""

from __future__ import annotations

from typing import List

from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

from dlrm_hybrid.model.compositional import FeatureLookup, Part

PRECISIONS = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def embedding_tables(lookups: List[FeatureLookup], precision: str = "fp32"
                     ) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=part.table, embedding_dim=part.dim, num_embeddings=part.rows,
                           feature_names=list(part.keys), pooling=PoolingType.SUM,
                           data_type=PRECISIONS[precision])
        for part in table_order(lookups)
    ]


def table_order(lookups: List[FeatureLookup]) -> List[Part]:
    """Every table, the vectors' parts first (feature order), then first-order weights (fm)."""
    return ([part for lookup in lookups for part in lookup.parts]
            + [lookup.first_order for lookup in lookups if lookup.first_order])
