"""The two-tower retrieval model (`model.kind: two_tower`): a user tower and an item tower, each
pooling only its own side's features from the embedding tables and mapping them through an
MLP to one vector; the score of a (user, item) pair is their dot product over a temperature.

Both towers' tables live in one EmbeddingBagCollection, so the placer, torchrec's sharding, the
id and pooled-vector exchanges, the fused optimizers and checkpoints treat them as the ranker's.
Training takes a batch of engagements and returns the in-batch softmax loss (retrieval/loss.py).

A history user tower (`model.user_tower.encoder` history_mean | history_attention) reads the
user's recent items instead of the user's features: its slots are keys of the item table, and
model/history_encoder.py turns their vectors into the MLP's input.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.functional import normalize
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm_hybrid.data.interactions.interaction_meta import HISTORY, ITEM_ID
from dlrm_hybrid.model.compositional import FeatureLookup, lookups_of
from dlrm_hybrid.model.composed_lookup import composed_lookup
from dlrm_hybrid.model.embeddings import embedding_tables
from dlrm_hybrid.model.history_encoder import history_encoder
from dlrm_hybrid.retrieval.loss import InBatchSoftmax

SIDES = ("user", "item")


def tower_mlp(width_in: int, sizes: List[int]) -> nn.Sequential:
    """Linear layers with ReLU between them; the last is linear (the tower's output)."""
    layers: List[nn.Module] = []
    for i, width in enumerate(sizes):
        layers.append(nn.Linear(width_in, width))
        if i < len(sizes) - 1:
            layers.append(nn.ReLU())
        width_in = width
    return nn.Sequential(*layers)


class TwoTower(nn.Module):
    def __init__(self, lookups: List[FeatureLookup], towers: Dict[str, object],
                 loss: nn.Module, embedding_precision: str = "fp32",
                 embedding_device: torch.device = torch.device("meta")) -> None:
        """`towers`: "user" and "item" -> TowerConfig; `lookups`: both towers' features, the
        user's first (compositional.lookups_of); `loss`: the training loss of a batch's
        (user vectors, item vectors, item ids, labels: 1 an engagement, 0 an item that is
        only a negative)."""
        super().__init__()
        self.lookups = lookups
        self.lookup_ids, _ = composed_lookup(lookups)
        self.embedding_bags = EmbeddingBagCollection(
            tables=embedding_tables(lookups, embedding_precision), device=embedding_device)
        self.side_keys: Dict[str, List[str]] = {}
        self.side_dims: Dict[str, int] = {}  # a tower's table width: compositional parts' slots
        self.combine = nn.ModuleDict()
        mlps, self.normalize = {}, {}
        # a history tower's slots: the item table's keys after item_id's own
        self.history_keys = [k for lookup in lookups for part in lookup.parts
                             for k in part.keys if k.startswith(HISTORY)]
        self.history = (history_encoder(towers["user"], lookups[0].dim) if self.history_keys
                        else None)
        for side in SIDES:
            mine = [lookup for lookup in lookups if lookup.feature.startswith(f"{side}_")]
            self.side_keys[side] = [k for lookup in mine for part in lookup.tables
                                    for k in part.keys if not k.startswith(HISTORY)]
            self.side_dims[side] = mine[0].dim if mine else 0
            _, combine = composed_lookup(mine)
            if combine is not None:
                self.combine[side] = combine
            tower = towers[side]
            width = (sum(lookup.dim for lookup in mine) if mine or self.history is None
                     else lookups[0].dim)
            mlps[side] = tower_mlp(width, tower.mlp)
            self.normalize[side] = tower.normalize
        self.user_mlp, self.item_mlp = mlps["user"], mlps["item"]
        self.loss = loss
        self.exchange = "pooled"  # what the id and vector exchanges carry (parallel/exchange.py)
        # Set by the training step: fp16 loss scaling cuts the backward in two here.
        self.embedding_grad_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Given `labels` (training): the batch's loss. Else [B, 2E]: each sample's user
        vector and item vector side by side (`split_towers`). `dense` is not read."""
        if is_fx_symbolic_tracing():  # torchrec's train pipeline: it looks for the lookup's input
            return self.embedding_bags(self._lookup_input(sparse))
        pooled = self.embedding_bags(self._lookup_input(sparse))
        user, item = self.towers(pooled, labels is not None, self.history_counts(sparse))
        if labels is None:
            return torch.cat([user, item], 1)
        return self.loss(user, item, sparse[ITEM_ID].values(), labels)

    def _lookup_input(self, sparse: KeyedJaggedTensor) -> KeyedJaggedTensor:
        return sparse if self.lookup_ids is None else self.lookup_ids(sparse)

    def history_counts(self, sparse: KeyedJaggedTensor) -> Optional[torch.Tensor]:
        """[B] each sample's history length (its non-empty slots), for a history tower."""
        if self.history is None:
            return None
        keys = sparse.keys()
        lengths = sparse.lengths().view(len(keys), -1)
        return lengths[[keys.index(k) for k in self.history_keys]].sum(0)

    def towers(self, pooled: KeyedTensor, training: bool = False,
               counts: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each tower's output vector [B, E] from the pooled embeddings (and, for a history
        tower, each sample's history length)."""
        values = pooled.values()
        if training and self.embedding_grad_transform is not None and values.requires_grad:
            values = self.embedding_grad_transform(values)
        # one split (its backward one concatenation): a slice per key would each allocate the
        # whole gradient's width in the backward, which 51 keys of a history made 20x slower
        columns = dict(zip(pooled.keys(), values.split(pooled.length_per_key(), 1)))
        out = []
        for side, mlp in zip(SIDES, (self.user_mlp, self.item_mlp)):
            if side == "user" and self.history is not None:
                items = torch.stack([columns[k] for k in self.history_keys], 1)
                x = mlp(self.history(items, counts))
                out.append(normalize(x, dim=1) if self.normalize[side] else x)
                continue
            x = torch.cat([columns[k] for k in self.side_keys[side]], 1)
            if side in self.combine:
                x = self.combine[side](x.view(x.shape[0], -1, self.side_dims[side])).flatten(1)
            x = mlp(x)
            out.append(normalize(x, dim=1) if self.normalize[side] else x)
        return out[0], out[1]

def split_towers(both: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The user and item vectors of `TwoTower.forward`'s evaluation output."""
    width = both.shape[1] // 2
    return both[:, :width], both[:, width:]


def build_two_tower(cfg, spec, embedding_device: torch.device = torch.device("meta")) -> TwoTower:
    """The two-tower model a config describes over a dataset's features (`spec`)."""
    m = cfg.model
    items = spec.cardinalities[spec.feature_names.index(ITEM_ID)]
    loss = InBatchSoftmax(cfg.retrieval, items, m.temperature, m.item_tower.mlp[-1])
    return TwoTower(lookups_of(m, spec), {"user": m.user_tower, "item": m.item_tower},
                    loss, m.embedding_precision, embedding_device)
