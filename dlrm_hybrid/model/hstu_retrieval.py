"""The generative sequence model for retrieval (`model.kind: hstu`): one item table, HSTU over each
user's items in order (model/hstu.py), next-item prediction at every position.

A sample is one window of a user's training timeline (data/interactions/histories.py's
`window_rows`): its history slots (`user_history0..`, keys of the item table, as a history
user tower's) and its target (`item_id`, the item after the history). Position t predicts the
item in slot t + 1, the last position the target; the loss is retrieval/sequence_loss.py's
sampled softmax. Uniform negatives come as extra rows of label 0 (the dataset's
`set_uniform_negatives`, as for two_tower). The item table lives in one EmbeddingBagCollection,
so the placer, torchrec's sharding, the exchanges, the fused optimizers and checkpoints treat it
as any table; HSTU's layers are dense and data-parallel.

Evaluation and serving read it as a two-tower model: forward without labels gives [B, 2D], the
user's vector (HSTU's output at the history's last item) beside the target's item vector
(L2-normalised), so retrieval/evaluate.py and the FAISS export score it unchanged.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch import nn
from torch.fx._symbolic_trace import is_fx_symbolic_tracing
from torch.nn.functional import normalize
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from dlrm_hybrid.data.interactions.interaction_meta import HISTORY, ITEM_ID
from dlrm_hybrid.model.compositional import FeatureLookup, lookups_of
from dlrm_hybrid.model.embeddings import embedding_tables
from dlrm_hybrid.model.hstu import EPS, HSTU, head_widths, last_positions
from dlrm_hybrid.retrieval.sequence_loss import SequenceSoftmax


class HSTURetrieval(nn.Module):
    def __init__(self, lookups: List[FeatureLookup], hstu_cfg, temperature: float,
                 embedding_precision: str = "fp32",
                 embedding_device: torch.device = torch.device("meta")) -> None:
        super().__init__()
        self.lookups = lookups
        self.embedding_bags = EmbeddingBagCollection(
            tables=embedding_tables(lookups, embedding_precision), device=embedding_device)
        self.history_keys = [k for lookup in lookups for part in lookup.parts
                             for k in part.keys if k.startswith(HISTORY)]
        dim = lookups[0].dim
        attention_dim, linear_dim = head_widths(dim, hstu_cfg.heads, hstu_cfg.attention_dim,
                                                hstu_cfg.linear_dim)
        self.hstu = HSTU(dim, hstu_cfg.max_length, hstu_cfg.layers, hstu_cfg.heads,
                         attention_dim, linear_dim, hstu_cfg.dropout, hstu_cfg.time_buckets,
                         hstu_cfg.attention_chunk, hstu_cfg.checkpoint_layers)
        self.loss = SequenceSoftmax(temperature, hstu_cfg.in_batch_negatives)
        self.exchange = "pooled"  # what the id and vector exchanges carry (parallel/exchange.py)
        # Set by the training step: fp16 loss scaling cuts the backward in two here.
        self.embedding_grad_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor,
                labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Given `labels` (training; 0: a uniform negative's row): the batch's loss. Else
        [B, 2D]: each sample's user vector and item vector side by side. `dense`: each history
        slot's time where the dataset has them ([B, max_length]), else [B, 0]."""
        if is_fx_symbolic_tracing():  # torchrec's train pipeline: it looks for the lookup's input
            return self.embedding_bags(sparse)
        pooled = self.embedding_bags(sparse)
        items, target, counts = self.sequences(pooled, sparse, labels is not None)
        times = dense[:, :items.shape[1]].double() if dense.shape[1] else None
        if labels is None:
            user = last_positions(self.hstu(items, counts, times), counts)
            return torch.cat([user, normalize(target, dim=1, eps=EPS)], 1)
        history_ids, target_ids = self.ids(sparse)
        outputs = self.hstu(items, counts, times)
        n = items.shape[1]
        slots = torch.arange(n, device=items.device)
        engaged = labels > 0.5
        last = slots[None, :] == (counts - 1)[:, None]  # where the target is the next item
        following = torch.cat([items[:, 1:], items[:, :1]], 1)
        following = torch.where(last[:, :, None], target[:, None, :], following)
        following_ids = torch.cat([history_ids[:, 1:n], history_ids[:, :1]], 1)
        following_ids = torch.where(last, target_ids[:, None], following_ids)
        used = (slots[None, :] < counts[:, None]) & engaged[:, None]
        return self.loss(outputs[used], normalize(following[used], dim=-1, eps=EPS),
                         following_ids[used], normalize(target[~engaged], dim=1, eps=EPS),
                         target_ids[~engaged])

    def sequences(self, pooled: KeyedTensor, sparse: KeyedJaggedTensor, training: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(history vectors [B, n, D] left-aligned, n the batch's longest history; target
        vectors [B, D]; history lengths [B])."""
        values = pooled.values()
        if training and self.embedding_grad_transform is not None and values.requires_grad:
            values = self.embedding_grad_transform(values)
        columns = dict(zip(pooled.keys(), values.split(pooled.length_per_key(), 1)))
        keys = sparse.keys()
        lengths = sparse.lengths().view(len(keys), -1)
        counts = lengths[[keys.index(k) for k in self.history_keys]].sum(0)
        n = max(int(counts.max()) if counts.numel() else 0, 1)
        items = torch.stack([columns[k] for k in self.history_keys[:n]], 1)
        return items, columns[ITEM_ID], counts

    def ids(self, sparse: KeyedJaggedTensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(history item ids [B, L], -1 past a history's end; target ids [B])."""
        keys = sparse.keys()
        lengths = sparse.lengths().view(len(keys), -1)
        starts = sparse.offsets()[:-1].view(len(keys), -1)
        values = sparse.values()
        rows = [keys.index(k) for k in self.history_keys]
        picked = values[starts[rows].clamp(max=max(len(values) - 1, 0))]
        history = torch.where(lengths[rows] > 0, picked, torch.full_like(picked, -1)).T
        target = values[starts[keys.index(ITEM_ID)]]
        return history, target


def build_hstu(cfg, spec, embedding_device: torch.device = torch.device("meta")) -> HSTURetrieval:
    """The sequence model a config describes over an interaction log's features (`spec`)."""
    m = cfg.model
    return HSTURetrieval(lookups_of(m, spec), m.hstu, m.temperature, m.embedding_precision,
                         embedding_device)
