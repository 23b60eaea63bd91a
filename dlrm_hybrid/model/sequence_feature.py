"""The ranker's sequence feature (`model.sequence: hstu`): the shape of DLRMv3's ranker
(meta-recsys/generative-recommenders, dlrm_v3; MLPerf Inference's DLRMv3) inside the DLRM.

HSTU (model/hstu.py) reads the user's history, each item's vector plus its action's (which
labels that engagement had: the action table), and after it the candidate (its item vector plus
a learned candidate marker). The candidate reads every history item and none reads it; its
output is one more vector of the DLRM's interaction, in the action table's place, so the top
MLP and the task heads see the candidate in the light of what the user did before.

A ranking dataset made with `--history L` carries the history in fixed slots, left-aligned:
`user_history0..` (keys of the item table) and `user_action0..` (keys of the action table),
action 0 past the history's end. So a row's history length is its count of nonzero actions,
and the item slots past it (any id) are never read. No `from __future__ import annotations`:
TorchScript compiles it inside the served model.
"""

from typing import List

import torch
from torch import nn

from dlrm_hybrid.data.interactions.interaction_meta import ITEM_ID
from dlrm_hybrid.model.hstu import HSTU, head_widths


class SequenceFeature(nn.Module):
    """slots [B, K, D] (the looked-up vectors of every key, in `keys` order) and actions [B, L]
    -> [B, F, D]: each lookup's feature vector, the action lookup's place taken by HSTU's
    output at the candidate."""

    def __init__(self, keys: List[str], features: List[str], item: str, history: List[str],
                 actions: List[str], dim: int, hstu_cfg) -> None:
        """`keys`: the lookup keys in the lookup's output order; `features`: each interaction
        feature's first key in the interaction's order, `actions[0]` standing for the
        sequence's vector; `item`: the candidate's key."""
        super().__init__()
        position = features.index(actions[0])
        own = [keys.index(f) for f in features if f != actions[0]]
        for name, index in (("feature_slots", own), ("history_slots", [keys.index(k) for k in history]),
                            ("action_slots", [keys.index(k) for k in actions])):
            self.register_buffer(name, torch.tensor(index, dtype=torch.int64), persistent=False)
        self.position = position
        self.register_buffer("item_slot", torch.tensor([keys.index(item)]), persistent=False)
        self.dim = dim
        self.candidate = nn.Parameter(torch.zeros(dim))
        attention_dim, linear_dim = head_widths(dim, hstu_cfg.heads, hstu_cfg.attention_dim,
                                                hstu_cfg.linear_dim)
        self.hstu = HSTU(dim, len(history) + 1, hstu_cfg.layers, hstu_cfg.heads, attention_dim,
                         linear_dim, hstu_cfg.dropout, 0, hstu_cfg.attention_chunk,
                         hstu_cfg.checkpoint_layers)

    def forward(self, slots: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        b = slots.shape[0]
        counts = (actions != 0).sum(1)
        # Only the batch's longest history is read: HSTU never reads a row's slots past its own
        # history, so cutting the slots past every row's leaves the outputs as they were. At
        # L = 4,095 with short histories that is what makes a step affordable (attention is
        # quadratic in the slots). One gather of every slot read: each gather's backward fills
        # a zero gradient as large as `slots` (8,192 slots: 0.2 s of a 0.4 s backward at B 256).
        n = int(counts.max()) if b > 0 else 0
        f = self.feature_slots.shape[0]
        picked = slots.index_select(1, torch.cat([self.feature_slots, self.item_slot,
                                                  self.history_slots[:n], self.action_slots[:n]]))
        features = picked[:, :f]
        candidate = (picked[:, f] + self.candidate)[:, None]  # [B, 1, D]
        history = picked[:, f + 1:f + 1 + n] + picked[:, f + 1 + n:]  # [B, n, D]
        if not self.training and b > 1 and bool((actions == actions[:1]).all()) and \
                torch.equal(history, history[:1].expand_as(history)):
            # one request's candidates: the history once, each candidate after it
            vector = self.hstu.after_history(history[0, :int(counts[0])], candidate[:, 0])[:, None]
        else:
            at = counts.view(b, 1, 1).expand(b, 1, self.dim)  # the slot right after the history
            sequence = torch.cat([history, candidate], 1).scatter(1, at, candidate)
            vector = self.hstu(sequence, counts + 1).gather(1, at)  # [B, 1, D]
        return torch.cat([features[:, :self.position], vector, features[:, self.position:]], 1)


def sequence_feature(lookups, keys: List[str], hstu_cfg) -> SequenceFeature:
    """The sequence feature of a ranker whose lookups are compositional.sequence_lookups'
    (the item table's keys: the item, then the history slots; the action table last)."""
    item_keys = next(lookup for lookup in lookups if lookup.feature == ITEM_ID).parts[0].keys
    return SequenceFeature(keys, [lookup.parts[0].keys[0] for lookup in lookups], item_keys[0],
                           list(item_keys[1:]), list(lookups[-1].parts[0].keys), lookups[0].dim,
                           hstu_cfg)


def action_ids(sparse, actions: List[str]) -> torch.Tensor:
    """[B, L]: each row's action ids from a KeyedJaggedTensor with one id per action key.
    Gathered in one indexing (a loop over 4,095 keys with `keys.index` took 0.24-0.59 s a
    batch of 256: more than the rest of the forward)."""
    keys = sparse.keys()
    where = {key: k for k, key in enumerate(keys)}
    offsets = torch.tensor(sparse.offset_per_key())
    at = torch.tensor([where[key] for key in actions])
    starts, counts = offsets[at], offsets[at + 1] - offsets[at]
    batch = sparse.stride()
    wrong = (counts != batch).nonzero()
    if len(wrong):
        raise ValueError(f"{actions[int(wrong[0])]}: expected one action id per row")
    index = starts[None, :] + torch.arange(batch)[:, None]  # [B, L]
    return sparse.values()[index.to(sparse.values().device)]
