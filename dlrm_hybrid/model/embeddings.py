"""Embedding table configs: one table per categorical feature."""

from __future__ import annotations

from typing import List

from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

from dlrm_hybrid.data.spec import DataSpec

PRECISIONS = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def table_name(feature: str) -> str:
    return f"t_{feature}"


def embedding_tables(spec: DataSpec, dim: int, precision: str = "fp32") -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=table_name(feature), embedding_dim=dim, num_embeddings=rows,
                           feature_names=[feature], pooling=PoolingType.SUM,
                           data_type=PRECISIONS[precision])
        for feature, rows in zip(spec.feature_names, spec.cardinalities)
    ]
