"""Embedding table configs: one table per categorical feature."""

from __future__ import annotations

from typing import List

from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

from dlrm_hybrid.data.spec import DataSpec

PRECISIONS = {"fp32": DataType.FP32, "fp16": DataType.FP16}


def embedding_tables(spec: DataSpec, dim: int, precision: str = "fp32") -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=name, embedding_dim=dim, num_embeddings=rows,
                           feature_names=[feature], pooling=PoolingType.SUM,
                           data_type=PRECISIONS[precision])
        for name, feature, rows in zip(spec.table_names, spec.feature_names, spec.cardinalities)
    ]
