"""The shape of a click-log dataset as the model sees it: dense width, tables, ids per lookup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple


@dataclass(frozen=True)
class DataSpec:
    num_dense: int
    cardinalities: List[int]  # rows of each categorical feature's table
    hotness: List[int]  # ids per sample of each categorical feature (the most, if variable)
    variable_hotness: bool = False  # each lookup has 1..hotness ids, drawn uniformly
    names: Tuple[str, ...] = ()  # the features' names; empty: cat_0, cat_1, ... (click logs)

    @property
    def mean_hotness(self) -> List[float]:
        """Mean ids per lookup of each feature: what lookup and all-to-all costs scale with."""
        return [(h + 1) / 2 if self.variable_hotness else h for h in self.hotness]

    @property
    def feature_names(self) -> List[str]:
        return list(self.names) or [f"cat_{i}" for i in range(len(self.cardinalities))]

    @property
    def table_names(self) -> List[str]:
        """One embedding table per categorical feature."""
        return [f"t_{feature}" for feature in self.feature_names]

    @staticmethod
    def from_config(data_cfg) -> "DataSpec":
        hot = data_cfg.hotness
        hotness = hot * len(data_cfg.cardinalities) if len(hot) == 1 else list(hot)
        return DataSpec(data_cfg.num_dense, list(data_cfg.cardinalities), hotness,
                        data_cfg.hotness_distribution == "uniform")


def data_spec(data_cfg, model_cfg=None) -> DataSpec:
    """The configured data's shape: a dataset's feature_spec.yaml (`data.path`) or the config's
    synthetic tables, without opening any data file; for two_tower, an interaction log's
    interactions.yaml or the planted one's."""
    if model_cfg is not None and model_cfg.kind == "two_tower":
        from dlrm_hybrid.data.interaction_meta import planted_meta, read_meta, tower_features

        meta = read_meta(data_cfg.path) if data_cfg.path else planted_meta(data_cfg)
        return tower_features(meta, model_cfg).spec()
    if not data_cfg.path:
        return DataSpec.from_config(data_cfg)
    from dlrm_hybrid.data.feature_spec import load_feature_spec  # it imports this module

    return load_feature_spec(data_cfg.path).spec
