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

