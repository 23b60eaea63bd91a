"""The served model: a trained DLRM whose embedding tables are fbgemm's inference tables
(`IntNBitTableBatchedEmbeddingBagsCodegen`: row-wise int8/int4, or fp16/fp32, per table), taking
plain tensors and returning click probabilities (a multi-task model: each task's, and the value
model's weighted sum of them). It is written for `torch.jit.script`, so the
exported file runs with torch and fbgemm_gpu only (and without `from __future__ import
annotations`: TorchScript cannot resolve its class attributes' string annotations).

Why fbgemm's table directly and not torchrec's quantized EmbeddingBagCollection (which wraps the
same kernel): that one takes a KeyedJaggedTensor, so every caller of the artifact would need
torchrec to build its input. Here the id transform that training's KJT path does
(composed_lookup.LookupIds: hashing, QR parts, fm's first-order keys) is done on plain tensors.
"""

from typing import List, Optional, Tuple

import torch
from torch import nn


class ScoringModel(nn.Module):
    """forward(dense [B, num_dense] float32, ids [B, F] or [B, F, H] int64, lengths [B, F] or
    None) -> [B] click probabilities. ids[b, f] holds sample b's ids of categorical feature f
    (padded to the widest bag H); lengths[b, f] says how many of them it has (None: all H).
    `score_bags` takes the jagged layout instead: ids of feature 0 for every sample, then of
    feature 1, ... (torchrec's KeyedJaggedTensor order) and their lengths [F, B].
    A multi-task model (model.tasks) returns [B, T], task t's probabilities in column t;
    `score_with_value` and `score_bags_with_value` return them as [B, T] for any model, with the
    value model's sum_t w_t p_t [B] (weights [T] in `tasks` order; default: the exported
    `value_weights`, none where the config had no value_model)."""

    cardinalities: torch.Tensor
    value_weights: torch.Tensor

    def __init__(self, embeddings: nn.Module, num_dense: int, feature_names: List[str],
                 cardinalities: List[int], key_feature: List[int], key_transform: List[int],
                 key_modulus: List[int], key_slot: List[int], max_ids: List[int],
                 embedding_dim: int,
                 dense_arch: nn.Module, interaction: nn.Module, over_arch: nn.Module,
                 combine_parts: Optional[nn.Module], flat_pooled: bool,
                 tasks: List[str], multi_task: bool, value_weights: List[float],
                 sequence: Optional[nn.Module] = None, action_features: List[int] = [],
                 widen_parts: Optional[nn.Module] = None) -> None:
        """Lookup keys (the embedding table's features, in its output order) each read one
        categorical feature (`key_feature`), transform its ids (0: none, 1: mod m, 2: floor
        division by m, 3: remainder by m; m = `key_modulus`) and keep one id slot of every bag
        (`key_slot` j: the bag's j-th id, -1: all). A feature looked up by id slots takes at
        most as many ids as it has slots (`max_ids`; 0: any number). `tasks` name the outputs
        (["click"] for a single-task model, whose forward gives [B]); `value_weights` is the
        default value model, one weight per task, or empty. `sequence`: the ranker's sequence
        feature (model/sequence_feature.py), reading the actions of features
        `action_features` (one id each per sample). `widen_parts`: mixed-dimension tables'
        projections (model/composed_lookup.WidenParts)."""
        super().__init__()
        self.embeddings = embeddings
        self.num_dense = num_dense
        self.feature_names = feature_names
        self.register_buffer("cardinalities", torch.tensor(cardinalities, dtype=torch.int64))
        self.key_feature = key_feature
        self.key_transform = key_transform
        self.key_modulus = key_modulus
        self.key_slot = key_slot
        self.max_ids = max_ids
        self.embedding_dim = embedding_dim
        self.dense_arch = dense_arch
        self.interaction = interaction
        self.over_arch = over_arch
        self.combine_parts = combine_parts
        self.flat_pooled = flat_pooled
        self.tasks = tasks
        self.multi_task = multi_task
        self.register_buffer("value_weights", torch.tensor(value_weights, dtype=torch.float32))
        self.sequence = sequence
        self.action_features = action_features
        self.widen_parts = widen_parts

    def forward(self, dense: torch.Tensor, ids: torch.Tensor,
                lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
        if ids.dim() == 2:
            ids = ids.unsqueeze(2)
        if ids.dim() != 3 or ids.shape[1] != len(self.feature_names):
            raise ValueError(f"ids: expected [B, {len(self.feature_names)}] or "
                             f"[B, {len(self.feature_names)}, H], got {list(ids.shape)}")
        batch, features, width = ids.shape[0], ids.shape[1], ids.shape[2]
        by_feature = ids.transpose(0, 1)  # [F, B, H]
        if lengths is None:
            counts = torch.full([features, batch], width, dtype=torch.int64, device=ids.device)
            return self.score_bags(dense, by_feature.reshape(-1), counts)
        if list(lengths.shape) != [batch, features]:
            raise ValueError(f"lengths: expected [{batch}, {features}], got {list(lengths.shape)}")
        counts = lengths.transpose(0, 1).to(torch.int64)
        if bool((counts < 0).any()) or bool((counts > width).any()):
            raise ValueError(f"lengths: each must be in [0, {width}] (the ids' last dimension)")
        used = torch.arange(width, device=ids.device) < counts.unsqueeze(2)
        return self.score_bags(dense, torch.masked_select(by_feature, used), counts)

    @torch.jit.export
    def score_bags(self, dense: torch.Tensor, values: torch.Tensor,
                   lengths: torch.Tensor) -> torch.Tensor:
        features = len(self.feature_names)
        if dense.dim() != 2 or dense.shape[1] != self.num_dense:
            raise ValueError(f"dense: expected [B, {self.num_dense}], got {list(dense.shape)}")
        if list(lengths.shape) != [features, dense.shape[0]]:
            raise ValueError(f"lengths: expected [{features}, {dense.shape[0]}] (features x "
                             f"samples), got {list(lengths.shape)}")
        lengths = lengths.to(torch.int64)
        values = values.to(torch.int64)
        if bool((lengths < 0).any()):
            raise ValueError("lengths: must not be negative")
        if int(lengths.sum()) != values.numel():
            raise ValueError(f"values: {values.numel()} ids, but lengths add up to "
                             f"{int(lengths.sum())}")
        self._check_ids(values, lengths)
        indices, offsets = self._lookup_input(values, lengths)
        pooled = self.embeddings(indices, offsets)
        widen = self.widen_parts
        if widen is not None:
            pooled = widen(pooled)
        if not self.flat_pooled:
            pooled = pooled.reshape(pooled.shape[0], -1, self.embedding_dim)
            combine = self.combine_parts
            if combine is not None:
                pooled = combine(pooled)
            sequence = self.sequence
            if sequence is not None:
                pooled = sequence(pooled, self._actions(values, lengths))
        logits = self.over_arch(self.interaction(self.dense_arch(dense.float()), pooled))
        return torch.sigmoid(logits if self.multi_task else logits.squeeze(1))

    @torch.jit.export
    def score_with_value(self, dense: torch.Tensor, ids: torch.Tensor,
                         lengths: Optional[torch.Tensor] = None,
                         weights: Optional[torch.Tensor] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
        """forward's probabilities as [B, T] and their value [B]."""
        return self._with_value(self.forward(dense, ids, lengths), weights)

    @torch.jit.export
    def score_bags_with_value(self, dense: torch.Tensor, values: torch.Tensor,
                              lengths: torch.Tensor, weights: Optional[torch.Tensor] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """score_bags' probabilities as [B, T] and their value [B]."""
        return self._with_value(self.score_bags(dense, values, lengths), weights)

    def _with_value(self, probabilities: torch.Tensor, weights: Optional[torch.Tensor]
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if probabilities.dim() == 1:
            probabilities = probabilities.unsqueeze(1)
        w = self.value_weights if weights is None else weights
        if w.numel() == 0:
            raise ValueError(f"weights: the model was exported without a value model; give "
                             f"one weight per task ({', '.join(self.tasks)})")
        if list(w.shape) != [len(self.tasks)]:
            raise ValueError(f"weights: expected [{len(self.tasks)}] (one per task: "
                             f"{', '.join(self.tasks)}), got {list(w.shape)}")
        return probabilities, torch.mv(probabilities, w.to(probabilities.dtype))

    def _check_ids(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """An id outside its feature's table would read another row (or memory), and an id
        past a feature's id slots would be left out: refuse them."""
        for f in range(len(self.max_ids)):
            limit = self.max_ids[f]
            if limit > 0 and lengths.shape[1] > 0 and int(lengths[f].max()) > limit:
                raise ValueError(f"lengths: feature {self.feature_names[f]} takes at most "
                                 f"{limit} ids per sample (its training hotness)")
        feature_of = torch.repeat_interleave(
            torch.arange(lengths.shape[0], device=values.device), lengths.sum(1))
        bad = (values < 0) | (values >= self.cardinalities[feature_of])
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0, 0])
            f = int(feature_of[first])
            raise ValueError(f"ids: {int(values[first])} is out of range for feature "
                             f"{self.feature_names[f]}, whose ids are 0..{int(self.cardinalities[f]) - 1}")

    def _actions(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, L]: each sample's history actions (one id per action feature), checked to be
        left-aligned (0 only past the history's end)."""
        sizes: List[int] = lengths.sum(1).tolist()
        per_feature = torch.split(values, sizes)
        columns: List[torch.Tensor] = []
        for f in self.action_features:
            if bool((lengths[f] != 1).any()):
                raise ValueError(f"lengths: feature {self.feature_names[f]} takes one id per "
                                 f"sample (0: past the history's end)")
            columns.append(per_feature[f])
        actions = torch.stack(columns, 1)
        if bool(((actions[:, 1:] != 0) & (actions[:, :-1] == 0)).any()):
            raise ValueError("ids: a history action after an empty slot (0); the history is "
                             "left-aligned, oldest first, its empty slots last")
        return actions

    def _lookup_input(self, values: torch.Tensor, lengths: torch.Tensor):
        """Indices and offsets of every lookup key's bags, key after key (fbgemm's layout)."""
        sizes: List[int] = lengths.sum(1).tolist()
        per_feature = torch.split(values, sizes)
        keys_ids: List[torch.Tensor] = []
        keys_lengths: List[torch.Tensor] = []
        for k in range(len(self.key_feature)):
            f = self.key_feature[k]
            ids, counts = per_feature[f], lengths[f]
            slot = self.key_slot[k]
            if slot >= 0:
                starts = torch.cumsum(counts, 0) - counts
                position = (torch.arange(ids.numel(), device=ids.device)
                            - torch.repeat_interleave(starts, counts))
                ids, counts = ids[position == slot], (counts > slot).to(torch.int64)
            transform, m = self.key_transform[k], self.key_modulus[k]
            if transform == 1 or transform == 3:
                ids = torch.remainder(ids, m)
            elif transform == 2:
                ids = torch.div(ids, m, rounding_mode="floor")
            keys_ids.append(ids)
            keys_lengths.append(counts)
        counts = torch.cat(keys_lengths)
        offsets = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
        offsets[1:] = torch.cumsum(counts, 0)
        return torch.cat(keys_ids), offsets


def _stack_into(module: nn.Module, kernels: dict) -> None:
    """Each of torchrec's per-layer ParameterLists as one stacked buffer of `module`."""
    for name, per_layer in kernels.items():
        module.register_buffer(name, torch.stack(list(per_layer)).detach())


class StackedCrossNet(nn.Module):
    """torchrec's LowRankCrossNet (DCN-v2, low rank) with its layers' kernels stacked into
    tensors: the same arithmetic, but TorchScript can loop over it (it cannot index torchrec's
    ParameterList with a loop variable)."""

    v: torch.Tensor
    w: torch.Tensor
    bias: torch.Tensor

    def __init__(self, crossnet: nn.Module) -> None:
        super().__init__()
        _stack_into(self, {"v": crossnet.V_kernels, "w": crossnet.W_kernels,
                           "bias": crossnet.bias})

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in range(self.v.shape[0]):
            x = x0 * (torch.nn.functional.linear(torch.nn.functional.linear(x, self.v[layer]),
                                                 self.w[layer]) + self.bias[layer]) + x
        return x


class StackedMixtureCrossNet(nn.Module):
    """torchrec's LowRankMixtureCrossNet (DCN-v2's mixture of low-rank experts, relu between
    the factors) with its kernels stacked into tensors and its gates into one [K, N] matrix:
    the same arithmetic, in a form TorchScript can loop over."""

    u: torch.Tensor
    v: torch.Tensor
    c: torch.Tensor
    bias: torch.Tensor
    gates: torch.Tensor

    def __init__(self, crossnet: nn.Module) -> None:
        super().__init__()
        _stack_into(self, {"u": crossnet.U_kernels, "v": crossnet.V_kernels,
                           "c": crossnet.C_kernels, "bias": crossnet.bias})
        self.register_buffer("gates", torch.cat([gate.weight for gate in crossnet.gates])
                             .detach())

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        x0 = input.unsqueeze(2)  # [B, N, 1]
        x = x0
        for layer in range(self.u.shape[0]):
            gating = torch.softmax(torch.nn.functional.linear(x.squeeze(2), self.gates), 1)
            experts: List[torch.Tensor] = []
            for i in range(self.u.shape[1]):
                expert = torch.relu(torch.matmul(self.v[layer, i], x))  # [B, r, 1]
                expert = torch.relu(torch.matmul(self.c[layer, i], expert))
                expert = torch.matmul(self.u[layer, i], expert)  # [B, N, 1]
                experts.append((x0 * (expert + self.bias[layer])).squeeze(2))
            x = torch.matmul(torch.stack(experts, 2), gating.unsqueeze(2)) + x
        return x.squeeze(2)
