"""Synthetic click logs with a known answer.

A planted teacher (a fixed random model of the DLRM family) gives each sample a true click
probability; labels are Bernoulli draws from it. The AUC of the true probabilities on the
validation split (the oracle AUC) is the ceiling a learner can reach. With z_0 the projected
dense features and z_1..z_F the tables' pooled latent vectors (n = F + 1 vectors of width d):

    data.teacher_order 2:  logit = b + s * P / sqrt(C(n,2) / d)
    data.teacher_order 3:  logit = b + s * (P / sqrt(C(n,2) / d) + T / sqrt(C(n,3) / d^2)) / sqrt(2)
    P = sum_{i<j} <z_i, z_j>,  T = sum_{i<j<k} sum_c z_ic z_jc z_kc,  s = data.teacher_scale

Each normalised sum has unit variance (z entries ~N(0, 1/d), the terms uncorrelated), so the
logit's variance and the click rate stay those of order 2; the three-way sum's heavier tails
lower the oracle AUC a little (configs/demo.yaml: 0.748 against 0.787, click rate 25.1% against
25.4%). Only order 3 needs a model that forms three-way products.

With `model.tasks` the data carries one label per task (data/synthetic.py's multi-task teacher):
task t's logit is b_t + sqrt(rho) * S(z) + sqrt(1 - rho) * S(z^t), S the teacher's scaled sum
above, z the shared latent vectors, z^t the task's own (its own dense projection and table
latents), rho = data.task_correlation; b_t = -1.2 - 0.6 t gives each task its own rate, and each
task has its own oracle AUC. Every label but the first is missing (NaN) with probability
data.label_missing.

Every random number is a pure function of (seed, stream, sample or row index), computed by a
counter-based hash instead of a sequential generator: that is what lets each rank generate
exactly its own slice of any global batch, and makes the data identical for any world size.
Teacher latent vectors are hashed from their row index too, so a 40M-row table costs no memory.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from dlrm_hybrid.data.batch import ClickDataset, Columns
from dlrm_hybrid.data.spec import DataSpec

SPLIT_OFFSET = {"train": 0, "val": 1 << 40, "test": 2 << 40}  # disjoint sample index ranges
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_uniform(seed: int, stream: int, index: np.ndarray) -> np.ndarray:
    """Uniform floats in (0, 1), one per index, a pure function of (seed, stream, index)."""
    key = _splitmix64(np.array([(seed << 20) ^ stream], dtype=np.uint64))
    bits = _splitmix64(index.astype(np.uint64) ^ key)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def counter_normal(seed: int, stream: int, index: np.ndarray) -> torch.Tensor:
    return torch.special.ndtri(torch.from_numpy(counter_uniform(seed, stream, index)))


def zipf_ids(u: np.ndarray, rows: int, exponent: float) -> np.ndarray:
    """Inverse CDF of a bounded power law on [1, rows + 1): id 0 is the most frequent."""
    if abs(exponent - 1.0) < 1e-9:
        x = np.power(rows + 1.0, u)
    else:
        a = 1.0 - exponent
        x = np.power(1.0 + u * (np.power(rows + 1.0, a) - 1.0), 1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, rows - 1)


SCATTER_MULTIPLIER = 2_654_435_761  # a prime above any table size: coprime to every row count


def scatter_ids(ids: np.ndarray, rows: int) -> np.ndarray:
    """A bijection of 0..rows-1 (id -> (p * id + rows // 2) mod rows, p prime) that moves the
    frequent low ids apart: what id numbering by first appearance or by hashing looks like."""
    return (ids * SCATTER_MULTIPLIER + rows // 2) % rows


class SyntheticClicks(ClickDataset):
    """The planted-teacher dataset described by a `DataConfig`."""

    STREAM_DENSE, STREAM_LABEL, STREAM_IDS, STREAM_LATENT, STREAM_LENGTHS = 0, 1, 2, 3, 4
    STREAM_MISSING = 5
    TASK_STREAMS = 1 << 12  # task t's streams: the shared ones + t * this (tables < 256)

    def __init__(self, data_cfg, tasks: Sequence[str] = ()) -> None:
        """`tasks`: the labels to plant (model.tasks' names); none: one click label."""
        self.spec = DataSpec.from_config(data_cfg)
        self.label_names = tuple(tasks) or ("click",)
        self.task_correlation = data_cfg.task_correlation
        self.label_missing = data_cfg.label_missing
        self.seed = data_cfg.seed
        self.exponent = data_cfg.zipf_exponent
        self.scattered = data_cfg.id_order == "scattered"
        self.teacher_dim = data_cfg.teacher_dim
        self.sizes = {"train": data_cfg.train_samples, "val": data_cfg.val_samples,
                      "test": data_cfg.val_samples}
        self.dense_proj = self._dense_projection(self.seed)
        self.task_dense_proj = [self._dense_projection(self.seed + 7919 * (t + 1))
                                for t in range(len(self.label_names))]
        self.order = data_cfg.teacher_order
        vectors = len(self.spec.cardinalities) + 1
        pairs = vectors * (vectors - 1) // 2
        triples = vectors * (vectors - 1) * (vectors - 2) // 6
        # Each latent entry is N(0, 1/d), so a dot of two is ~N(0, 1/d) and a three-way product
        # sum ~N(0, 1/d^2), all uncorrelated: each sum is rescaled to unit variance, then to
        # teacher_scale (order 3: both divided by sqrt 2, the same total), around a ~25% click rate.
        self.logit_scale = data_cfg.teacher_scale / (pairs / self.teacher_dim) ** 0.5
        if self.order == 3:
            self.logit_scale /= 2**0.5
            self.triple_scale = data_cfg.teacher_scale / (2 * triples / self.teacher_dim**2) ** 0.5
        self.logit_bias = -1.2

    def _dense_projection(self, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(self.spec.num_dense, self.teacher_dim, generator=gen,
                           dtype=torch.float64) / self.spec.num_dense**0.5

    def num_samples(self, split: str) -> int:
        return self.sizes[split]

    def columns(self, split: str, first: int, count: int) -> Columns:
        """Samples [first, first + count) of `split`; indices past its end are padding."""
        index = np.arange(first, first + count, dtype=np.uint64) + np.uint64(SPLIT_OFFSET[split])
        dense = self._dense(index)
        ids = self._ids(index)
        lengths = self._lengths(index) if self.spec.variable_hotness else None
        valid = np.arange(first, first + count) < self.sizes[split]
        if self.tasks:
            labels, prob = self._task_labels(index, dense, ids, lengths)
            return Columns(dense.numpy().astype(np.float32), labels, valid, ids, prob, lengths)
        prob = torch.sigmoid(self._teacher_logit(dense, ids, lengths)).numpy()
        labels = counter_uniform(self.seed, self.STREAM_LABEL, index) < prob
        return Columns(dense.numpy().astype(np.float32), labels.astype(np.float32), valid, ids,
                       prob.astype(np.float32), lengths)

    def _task_labels(self, index: np.ndarray, dense: torch.Tensor, ids: list,
                     lengths: Optional[list]):
        """Labels [B, T] (NaN: missing) and true probabilities [B, T] of the used tasks."""
        rho = self.task_correlation
        shared = self._interaction(self._teacher_vectors(dense, ids, lengths))
        labels, probs = [], []
        for name in self.tasks:
            t = self.label_names.index(name)
            own = self._interaction(self._teacher_vectors(dense, ids, lengths, t))
            prob = torch.sigmoid(self.logit_bias - 0.6 * t + rho**0.5 * shared
                                 + (1 - rho)**0.5 * own).numpy()
            streams = self.TASK_STREAMS * t
            label = (counter_uniform(self.seed, self.STREAM_LABEL + streams, index) < prob
                     ).astype(np.float32)
            if t and self.label_missing:
                missing = counter_uniform(self.seed, self.STREAM_MISSING + streams, index)
                label[missing < self.label_missing] = np.nan
            labels.append(label)
            probs.append(prob)
        return (np.stack(labels, 1), np.stack(probs, 1).astype(np.float32))

    def _dense(self, index: np.ndarray) -> torch.Tensor:
        n = self.spec.num_dense
        flat = (index[:, None] * np.uint64(n) + np.arange(n, dtype=np.uint64)).reshape(-1)
        return counter_normal(self.seed, self.STREAM_DENSE, flat).reshape(len(index), n)

    def _ids(self, index: np.ndarray) -> list:
        """[B, hot] ids per table. Sample i draws from counter slots i * stride + 0..hot-1: a
        stride of at least hot keeps neighbouring samples' slots apart, and 64 for hot <= 64
        keeps the data as it always was."""
        out = []
        for table, (rows, hot) in enumerate(zip(self.spec.cardinalities, self.spec.hotness)):
            stride = np.uint64(max(64, hot))
            slots = index[:, None] * stride + np.arange(hot, dtype=np.uint64)
            u = counter_uniform(self.seed, self.STREAM_IDS + 16 * table, slots.reshape(-1))
            ids = zipf_ids(u, rows, self.exponent).reshape(len(index), hot)
            out.append(scatter_ids(ids, rows) if self.scattered else ids)
        return out

    def _lengths(self, index: np.ndarray) -> list:
        """Ids used by each sample's lookup of each feature, uniform in 1..hotness: [B] int32."""
        out = []
        for table, hot in enumerate(self.spec.hotness):
            u = counter_uniform(self.seed, self.STREAM_LENGTHS + 16 * table, index)
            out.append(np.minimum((u * hot).astype(np.int32), hot - 1) + 1)  # u may round to 1.0
        return out

    def _latents(self, table: int, ids: np.ndarray, lengths: Optional[np.ndarray],
                 task: int = -1) -> torch.Tensor:
        """The teacher's latent vectors of `ids` ([B, hot]) in `table` (a task's own, for
        `task` >= 0), mean-pooled over each row's first `lengths` ids (all if None): [B, d]."""
        d = self.teacher_dim
        flat = (ids.astype(np.uint64)[..., None] * np.uint64(d) + np.arange(d, dtype=np.uint64))
        stream = self.STREAM_LATENT + 16 * table + self.TASK_STREAMS * (task + 1)
        vec = counter_normal(self.seed, stream, flat.reshape(-1))
        vec = vec.reshape(*ids.shape, d)
        if lengths is None:
            return vec.mean(dim=1) / d**0.5
        n = torch.from_numpy(lengths)[:, None]
        used = torch.arange(ids.shape[1]) < n
        return (vec * used[..., None]).sum(dim=1) / n / d**0.5

    def _teacher_logit(self, dense: torch.Tensor, ids: list,
                       lengths: Optional[list]) -> torch.Tensor:
        """bias + a2 * sum_{i<j} <z_i, z_j>, and for teacher_order 3
        + a3 * sum_{i<j<k} sum_c z_ic z_jc z_kc (a2, a3 set in __init__)."""
        return self.logit_bias + self._interaction(self._teacher_vectors(dense, ids, lengths))

    def _interaction(self, z: torch.Tensor) -> torch.Tensor:
        """The teacher's scaled sum over z [B, n, d]: variance teacher_scale^2, mean 0."""
        dots = torch.bmm(z, z.transpose(1, 2))
        upper = torch.triu_indices(z.shape[1], z.shape[1], offset=1)
        total = self.logit_scale * dots[:, upper[0], upper[1]].sum(dim=1)
        if self.order == 3:
            total = total + self.triple_scale * third_order(z)
        return total

    def _teacher_vectors(self, dense: torch.Tensor, ids: list, lengths: Optional[list],
                         task: int = -1) -> torch.Tensor:
        """z = [dense projection, one pooled latent per table]: [B, F + 1, d]; a task's own
        for `task` >= 0."""
        proj = self.dense_proj if task < 0 else self.task_dense_proj[task]
        vectors = [dense @ proj / self.teacher_dim**0.5]
        vectors += [self._latents(t, table_ids, None if lengths is None else lengths[t], task)
                    for t, table_ids in enumerate(ids)]
        return torch.stack(vectors, dim=1)


def third_order(z: torch.Tensor) -> torch.Tensor:
    """sum over triples i<j<k of sum_c z_ic z_jc z_kc, for z [B, n, d]: per coordinate c the
    elementary symmetric polynomial e3 = (p1^3 - 3 p1 p2 + 2 p3) / 6 of z_1c..z_nc, p_k the
    power sums sum_i z_ic^k (Newton's identities), so O(n d) instead of O(n^3 d): [B]."""
    p1, p2, p3 = (z.pow(k).sum(dim=1) for k in (1, 2, 3))
    return ((p1**3 - 3 * p1 * p2 + 2 * p3) / 6).sum(dim=1)
