"""The DLRM: bottom MLP over dense features, embedding bags over categorical ones, an
interaction, and a top MLP giving the click logit."""

from __future__ import annotations

import math
from typing import Callable, List, Optional

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.functional import binary_cross_entropy_with_logits, linear, pad
from torchrec.models.dlrm import DenseArch, OverArch
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm_hybrid.config import (DcnConfig, DhenConfig, HstuConfig, MmoeConfig,
                                RankingLossConfig, TaskConfig)
from dlrm_hybrid.model.alignment import aligned
from dlrm_hybrid.model.compositional import FeatureLookup, lookups_of
from dlrm_hybrid.model.composed_lookup import WidenParts, composed_lookup
from dlrm_hybrid.model.cross import dcn_over_arch
from dlrm_hybrid.model.embeddings import embedding_tables
from dlrm_hybrid.model.interactions import FactorizationMachine, build_interaction
from dlrm_hybrid.model.sequence_feature import action_ids, sequence_feature
from dlrm_hybrid.model.task_dots import with_task_dots
from dlrm_hybrid.model.task_heads import TaskHeads, multitask_loss, ranking_loss


class DLRM(nn.Module):
    def __init__(self, num_dense: int, lookups: List[FeatureLookup], bottom_mlp: List[int],
                 top_mlp: List[int], interaction: str = "dot", self_interaction: bool = False,
                 dcn: Optional[DcnConfig] = None, dhen: Optional[DhenConfig] = None,
                 embedding_precision: str = "fp32",
                 embedding_device: torch.device = torch.device("meta"),
                 tasks: Optional[List[TaskConfig]] = None, mmoe: Optional[MmoeConfig] = None,
                 ranking: Optional[RankingLossConfig] = None, task_dot_dim: int = 0,
                 sequence: Optional[HstuConfig] = None) -> None:
        """Embedding tables start on `embedding_device`; "meta" allocates nothing, because
        sharding materialises each table only on the rank that owns it. `lookups` says which
        tables each categorical feature is looked up in (compositional.py). `dcn`, `dhen`: those
        interactions' settings (the config's defaults if None). `tasks` (multi-task ranking):
        one head per task in place of the top MLP's last layer, logits [B, T]; `ranking`: a
        learning-to-rank term beside their log loss, over requests of consecutive rows;
        `task_dot_dim` > 0: each task's own dot interaction (model/task_dots.py); `sequence`:
        HSTU's settings for the sequence feature (model/sequence_feature.py; `lookups` then
        end with the action table's)."""
        super().__init__()
        tables = embedding_tables(lookups, embedding_precision)
        self.lookups = lookups
        self.embedding_dim = lookups[0].dim
        self.lookup_keys = [k for t in tables for k in t.feature_names]  # in the lookup's output order
        self.dense_arch = PaddedDenseArch(num_dense, bottom_mlp)
        # Compositional features: their ids become the parts' ids (a parameter-free module the
        # train pipeline runs ahead, with the id exchange); the parts' vectors are combined.
        self.lookup_ids, self.combine_parts = composed_lookup(lookups)
        self.widen_parts = (WidenParts(lookups) if any(p.projected for lk in lookups
                                                       for p in lk.parts) else None)
        self.sequence = (sequence_feature(lookups, self.lookup_keys, sequence)
                         if sequence is not None else None)
        self.embedding_bags = EmbeddingBagCollection(tables=tables, device=embedding_device)
        dcn = dcn or DcnConfig()
        self.interaction, width = build_interaction(
            interaction, len(lookups), bottom_mlp[-1], self.embedding_dim,
            self_interaction, dcn, dhen or DhenConfig(), align=True)
        padding = getattr(self.interaction, "padding", 0)
        self.over_arch = (dcn_over_arch(width, top_mlp, dcn) if interaction == "dcn"
                          else OverArch(width - padding, top_mlp))
        if padding:  # the top MLP's first layer as built for the unpadded width, then grown
            grow_input(next(m for m in self.over_arch.modules() if isinstance(m, nn.Linear)),
                       width)
        self.tasks = [t.name for t in tasks] if tasks else None
        if tasks:
            _put_task_heads(self.over_arch, tasks, mmoe or MmoeConfig())
            self.register_buffer("task_weights", torch.tensor([t.weight for t in tasks]),
                                 persistent=False)
            if task_dot_dim:
                self.interaction, self.over_arch = with_task_dots(
                    self.interaction, self.over_arch, width, len(lookups), self.embedding_dim,
                    len(tasks), task_dot_dim)
        self.ranking = ranking if ranking is not None and ranking.kind != "none" else None
        # pooled: the lookup returns pooled vectors; des: per-sample partial sums of the first
        # operation on them, added up over their owners (parallel/exchange.py sets it).
        self.exchange = "pooled"
        # Set by the training step: fp16 loss scaling cuts the backward in two here, and
        # CUDA Graphs replace `dense_loss` by its captured version.
        self.embedding_grad_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
        self._pooled_order: Optional[torch.Tensor] = None
        self._pooled_keys: Optional[List[str]] = None

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Click logits [B] (multi-task: [B, T]); given `labels`, the step's loss instead
        (training)."""
        if is_fx_symbolic_tracing():  # torchrec's train pipeline: it looks for the lookup's input
            return self.embedding_bags(self._lookup_input(sparse))
        if self.exchange == "pooled":
            values = self.lookup_values(sparse)
            pooled = self.vectors(values if labels is None else self._cut(values), sparse)
        else:
            pooled = self.embedding_bags(self._lookup_input(sparse)).values()
            pooled = pooled if labels is None else self._cut(pooled)
        if labels is None:
            return self.logits(dense, pooled)
        return self.dense_loss(dense, pooled, labels)

    def _cut(self, values: torch.Tensor) -> torch.Tensor:
        """fp16's loss scaling cuts the backward here, at the lookup's output: everything after
        it (projections, the sequence feature's HSTU, the MLPs) is the dense part, whose
        gradients the scaler checks and unscales."""
        if self.embedding_grad_transform is not None and values.requires_grad:
            return self.embedding_grad_transform(values)
        return values

    def _lookup_input(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return sparse if self.lookup_ids is None else self.lookup_ids(sparse)

    def pooled_embeddings(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """[B, F, D] in feature order (fm: flat, then the first-order columns)."""
        return self.vectors(self.lookup_values(sparse), sparse)

    def lookup_values(self, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """[B, the keys' widths] pooled, in lookup order. A sharded collection returns its keys
        grouped by owner rank: one gather puts them back in lookup order (none when it already
        matches), in pieces as wide as the narrowest key (D, or D/2 with `concat` parts, 4 with
        fm or mixed-dimension tables)."""
        pooled = self.embedding_bags(self._lookup_input(sparse))
        values = pooled.values()
        if pooled.keys() != self._pooled_keys:
            self._pooled_keys = list(pooled.keys())
            self._pooled_order = _lookup_order(pooled, self.lookup_keys, values.device)
        if self._pooled_order is not None:
            piece = values.shape[1] // len(self._pooled_order)
            values = values.view(values.shape[0], -1, piece).index_select(1, self._pooled_order)
        return values.reshape(values.shape[0], -1)

    def vectors(self, values: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        """The lookup's values as the interaction's vectors: mixed-dimension tables' projected
        to their width, compositional features' parts combined, the sequence feature's HSTU
        output in its slot."""
        if isinstance(self.interaction, FactorizationMachine):
            return values
        if self.widen_parts is not None:
            values = self.widen_parts(values)
        slots = values.reshape(values.shape[0], -1, self.embedding_dim)
        if self.sequence is not None:
            return self.sequence(slots, action_ids(sparse, self.lookups[-1].parts[0].keys))
        return slots if self.combine_parts is None else self.combine_parts(slots)

    def logits(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """`pooled`: the pooled embeddings, or with des the owners' summed partial results."""
        bottom = self.dense_arch(dense)
        if self.exchange == "pooled":
            return self._outputs(self.over_arch(self.interaction(bottom, pooled)))
        if isinstance(self.interaction, FactorizationMachine):
            return self._outputs(self.over_arch(self.interaction.from_sums(bottom, pooled)))
        # cat: the owners sent sum_t W_t e_t; the first top layer adds W_dense x + b.
        first, *rest = self.over_arch.model[0]._mlp
        weight = first._linear.weight
        hidden = first._activation_fn(
            linear(bottom, weight[:, :bottom.shape[1]], first._linear.bias) + pooled)
        for layer in rest:
            hidden = layer(hidden)
        return self._outputs(self.over_arch.model[1](hidden))

    def _outputs(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, 1] -> [B] for the single click logit; [B, T] as it is for tasks."""
        return logits if self.tasks else logits.squeeze(1)

    def first_top_layer(self) -> nn.Linear:
        """The top MLP's first layer: with `cat`, its weight's columns past the bottom MLP's
        width are the W_t of the pooled vectors, in feature order."""
        return self.over_arch.model[0]._mlp[0]._linear

    def dense_loss(self, dense: torch.Tensor, pooled: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:
        """The dense part of a training step: the part CUDA Graphs capture."""
        if self.tasks:
            logits = self.logits(dense, pooled)
            loss = multitask_loss(logits, labels, self.task_weights)
            if self.ranking is not None:
                loss = loss + self.ranking.weight * ranking_loss(
                    logits, labels, self.task_weights, self.ranking.kind, self.ranking.group)
            return loss
        return binary_cross_entropy_with_logits(self.logits(dense, pooled).float(), labels)


class PaddedDenseArch(DenseArch):
    """torchrec's DenseArch whose first layer reads the dense features padded with zeros to an
    aligned width (model/alignment.py): initialised as the unpadded one, with zero weights on
    the padding, so it is the same function and trains the same (a zero input column's weights
    get zero gradients)."""

    def __init__(self, num_dense: int, layer_sizes: List[int]) -> None:
        super().__init__(num_dense, layer_sizes)
        self.num_dense = num_dense
        self.padding = aligned(num_dense) - num_dense
        grow_input(self.model._mlp[0]._linear, aligned(num_dense))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.padding:
            features = pad(features, [0, self.padding])
        return self.model(features)


def grow_input(layer: nn.Linear, width: int) -> None:
    """Give `layer` `width` input columns, the new ones' weights zero (none where it has them)."""
    if layer.in_features == width:
        return
    with torch.no_grad():
        weight = layer.weight.new_zeros(layer.out_features, width)
        weight[:, :layer.in_features] = layer.weight
    layer.weight, layer.in_features = nn.Parameter(weight), width


def _put_task_heads(over_arch: nn.Module, tasks: List[TaskConfig], mmoe: MmoeConfig) -> None:
    """Replace the top MLP's last layer (torchrec's OverArch: model[1]; dcn parallel: last)."""
    attr, owner = ("last", over_arch) if hasattr(over_arch, "last") else ("1", over_arch.model)
    width = getattr(owner, attr).in_features
    setattr(owner, attr, TaskHeads(width, [t.head for t in tasks], mmoe.experts, mmoe.expert_mlp))


def _lookup_order(pooled: KeyedTensor, wanted: List[str], device: torch.device
                  ) -> Optional[torch.Tensor]:
    """Indices of equal pieces of the pooled columns that put the keys in `wanted` order."""
    widths = dict(zip(pooled.keys(), pooled.length_per_key()))
    piece = math.gcd(*widths.values())
    first, start = {}, 0
    for key in pooled.keys():
        first[key], start = start // piece, start + widths[key]
    order = [first[k] + i for k in wanted for i in range(widths[k] // piece)]
    return None if order == sorted(order) else torch.tensor(order, device=device)


def build_model(model_cfg, spec, embedding_device: torch.device = torch.device("meta")) -> DLRM:
    return DLRM(spec.num_dense, lookups_of(model_cfg, spec), model_cfg.bottom_mlp,
                model_cfg.top_mlp, model_cfg.interaction, model_cfg.self_interaction,
                model_cfg.dcn, model_cfg.dhen, model_cfg.embedding_precision, embedding_device,
                model_cfg.tasks, model_cfg.mmoe, model_cfg.ranking_loss, model_cfg.task_dot_dim,
                model_cfg.hstu if model_cfg.sequence != "none" else None)
