"""The configured data's shape, read without opening any data file: a click-log dataset's
feature_spec.yaml, an interaction log's interactions.yaml, or the config's synthetic tables."""

from __future__ import annotations

from dlrm_hybrid.config import RETRIEVAL_KINDS
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.interactions.interaction_meta import planted_meta, read_meta, tower_features
from dlrm_hybrid.data.spec import DataSpec


def data_spec(data_cfg, model_cfg=None) -> DataSpec:
    """The configured data's shape: a dataset's feature_spec.yaml (`data.path`) or the config's
    synthetic tables, without opening any data file; for two_tower, an interaction log's
    interactions.yaml or the planted one's."""
    if model_cfg is not None and model_cfg.kind in RETRIEVAL_KINDS:
        meta = read_meta(data_cfg.path) if data_cfg.path else planted_meta(data_cfg)
        return tower_features(meta, model_cfg).spec()
    if not data_cfg.path:
        return DataSpec.from_config(data_cfg)
    return load_feature_spec(data_cfg.path).spec
