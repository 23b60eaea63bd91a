"""What differs between the model kinds that `model.kind` names: the ranker (`dlrm`, one task or
several), the two-tower retrieval model (`two_tower`) and the sequence model (`hstu`). `model_kind(cfg)` picks one; the
training loop and `eval` call it and never ask `model.kind` themselves. Everything else (placing,
sharding, the step, checkpoints) is the same for both: each model computes its own loss in its
forward."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Union

from dlrm_hybrid.config import Config
from dlrm_hybrid.data.source import make_loader
from dlrm_hybrid.model.cross import rank_above_width
from dlrm_hybrid.model.dlrm import DLRM, build_model
from dlrm_hybrid.model.hstu_retrieval import HSTURetrieval, build_hstu
from dlrm_hybrid.model.two_tower import TwoTower, build_two_tower
from dlrm_hybrid.parallel.plan_report import describe_towers
from dlrm_hybrid.retrieval.evaluate import evaluate_retrieval
from dlrm_hybrid.train.evaluate import evaluate

Model = Union[DLRM, TwoTower, HSTURetrieval]


class ModelKind(ABC):
    """One model kind: how to build it, what the run says about it after the plan, and how to
    evaluate it."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @abstractmethod
    def build(self, spec) -> Model:
        """The unsharded model over a dataset's features (`spec`), its tables on the meta device."""

    @abstractmethod
    def plan_lines(self, plan, model: Model) -> List[str]:
        """What the run prints about this kind of model after the plan's table."""

    @abstractmethod
    def evaluate(self, dmp, dataset, env, split: str = "val") -> Optional[Dict[str, float]]:
        """The metrics of `split`, named `<split>_...`, on rank 0 (None elsewhere)."""


class RankerKind(ModelKind):
    """The DLRM: a click probability per task; AUC and log loss per task."""

    def build(self, spec) -> Model:
        return build_model(self.cfg.model, spec)

    def plan_lines(self, plan, model: Model) -> List[str]:
        m = self.cfg.model
        dcn = (rank_above_width(m.dcn, len(model.lookups), model.embedding_dim)
               if m.interaction == "dcn" else None)
        return (([describe_tasks(m)] if m.tasks else []) + ([dcn] if dcn else [])
                + ([describe_sequence(m, model)] if model.sequence is not None else []))

    def evaluate(self, dmp, dataset, env, split: str = "val") -> Optional[Dict[str, float]]:
        batches = make_loader(self.cfg.data, dataset, split, env)
        metrics = evaluate(dmp, batches, env, prefix=f"{split}_",
                           tasks=[t.name for t in self.cfg.model.tasks])
        batches.close()
        return metrics


class TwoTowerKind(ModelKind):
    """The user and item towers: where each tower's tables went; recall, HR, NDCG and MRR over
    the whole item corpus."""

    def build(self, spec) -> Model:
        return build_two_tower(self.cfg, spec)

    def plan_lines(self, plan, model: Model) -> List[str]:
        return [describe_towers(plan, model.lookups)]

    def evaluate(self, dmp, dataset, env, split: str = "val") -> Optional[Dict[str, float]]:
        return evaluate_retrieval(dmp, dataset, self.cfg.retrieval, env,
                                  self.cfg.data.global_batch_size // env.world_size, split)


class HstuKind(TwoTowerKind):
    """The sequence model: where its item table went and what its HSTU layers are; evaluated
    as the two-tower model (its user vector against every item's)."""

    def build(self, spec) -> Model:
        return build_hstu(self.cfg, spec)

    def plan_lines(self, plan, model: Model) -> List[str]:
        h = self.cfg.model.hstu
        dense = sum(p.numel() for p in model.hstu.parameters())
        layer = model.hstu.layers[0]
        return [describe_towers(plan, model.lookups, "hstu"),
                f"hstu: {h.layers} layers, {h.heads} head{'s' if h.heads > 1 else ''} "
                f"(Q, K {layer.attention_dim} and U, V {layer.linear_dim} wide each), sequences of "
                f"up to {h.max_length} items, {dense:,} dense parameters, data-parallel; every "
                f"position trained, candidates: "
                f"{'the batch next items and ' if h.in_batch_negatives else ''}"
                f"{self.cfg.retrieval.uniform_negatives} uniform draws"]


def model_kind(cfg: Config) -> ModelKind:
    """The kind `model.kind` names (the config's validation allows only these)."""
    kinds = {"two_tower": TwoTowerKind, "hstu": HstuKind}
    return kinds.get(cfg.model.kind, RankerKind)(cfg)


def describe_sequence(model_cfg, model: DLRM) -> str:
    """One line: what the ranker's sequence feature reads and how big its HSTU is."""
    h, hstu = model_cfg.hstu, model.sequence.hstu
    slots = hstu.length - 1
    dense = sum(p.numel() for p in model.sequence.parameters())
    return (f"sequence: HSTU over the user's last {slots} engagements (keys of t_item_id) plus "
            f"their actions (t_user_action), then the candidate; its output at the candidate is "
            f"one more vector of the interaction; {h.layers} layers, {h.heads} "
            f"head{'s' if h.heads > 1 else ''}, {dense:,} dense parameters, data-parallel")


def describe_tasks(model_cfg) -> str:
    """One line: the tasks, their loss weights and heads, and what the heads read."""
    tasks = ", ".join(f"{t.name} (weight {t.weight:g}, head {[*t.head, 1]})"
                      for t in model_cfg.tasks)
    trunk = f"the shared trunk {model_cfg.top_mlp[:-1]}"
    mmoe = model_cfg.mmoe
    reads = (f"{mmoe.experts} gated experts {mmoe.expert_mlp} over {trunk}" if mmoe.experts
             else trunk)
    return f"tasks: {tasks}; the heads read {reads}"
