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
The draws are torch ops (splitmix64 in int64, whose wrapping arithmetic is uint64's), so a GPU
run makes its batches on the GPU: on any device the values the numpy code made before, ids,
lengths and labels bit for bit, dense features and probabilities within a float32 ulp on CUDA
(its float64 ndtri and sums round in the last bits) and bit for bit on the host.
Teacher latent vectors are hashed from their row index too, so a 40M-row table costs no memory.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from dlrm_hybrid.data.batch import Batch, ClickDataset, Columns
from dlrm_hybrid.data.spec import DataSpec

SPLIT_OFFSET = {"train": 0, "val": 1 << 40, "test": 2 << 40}  # disjoint sample index ranges
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
CPU = torch.device("cpu")
# Samples are made in blocks whose largest intermediate (latent draws or the teacher's dots)
# has at most this many elements. On a GPU it bounds the transient memory (512 MiB a tensor:
# FL15's 65536 samples in one block, ~165 kernel launches, ~2 ms of host time). On the CPU,
# tensors under glibc's mmap threshold (32 MiB at most) reuse heap pages instead of faulting in
# fresh ones every batch (which cost FL15 more than its arithmetic), and blocks of 2^21 were
# the fastest of 2^19..2^25 with 1 thread and 16 (benchmarks/README.md).
BLOCK_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 21}
# Where every table's teacher latent vectors together have at most this many entries (32 MiB of
# float64), they are drawn once per device and looked up: drawing every looked-up entry (its
# hash and ndtri) was over half of making a batch (1,024 samples, 1 thread, Intel Xeon with AMX:
# the demo's 3.5-4.3 ms -> 1.7-1.9 ms, the MLPerf test's multi-hot 4.6-7.5 ms -> 1.9-2.0 ms).
# Larger tables draw each looked-up entry as before. Either way the same values, bit for bit.
LATENT_TABLE_ELEMENTS = 1 << 22


def _int64(x: int) -> int:
    """The int64 with the bits of `x` mod 2^64. torch has no uint64 arithmetic; int64's
    wrapping + and * and its bitwise ops give uint64's bits."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _mix(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function of every element of `x` (uint64 bits in int64), in place,
    on its device; `scratch` a tensor like it. In place: on the CPU a new large tensor costs
    torch more than the operation itself (its first touch of the pages)."""
    x += _int64(_GOLDEN)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(x, shift, out=scratch)
        scratch &= (1 << (64 - shift)) - 1  # torch's >> is arithmetic: this makes it logical
        x ^= scratch
        if multiplier is not None:
            x *= _int64(multiplier)
    return x


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function of every element (uint64 bits in int64), on its device."""
    return _mix(x.clone(), torch.empty_like(x))


def stream_keys(seed: int, streams: Sequence[int]) -> torch.Tensor:
    """What each stream's indices are mixed with, splitmix64((seed << 20) ^ stream): int64 on
    the host."""
    return splitmix64(torch.tensor([_int64((seed << 20) ^ s) for s in streams],
                                   dtype=torch.int64))


def keyed_uniform(key: Union[int, torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in (0, 1) from splitmix64(index ^ key), on the index's device; `key` one
    stream's, or a tensor of keys broadcasting against `index` (one per column)."""
    return _uniform_of(index ^ key)


def _uniform_of(bits: torch.Tensor) -> torch.Tensor:
    """`keyed_uniform` of mixed-in bits (index ^ key), overwriting them."""
    scratch = torch.empty_like(bits)
    _mix(bits, scratch)
    bits >>= 11
    bits &= (1 << 53) - 1  # the top 53 bits: exact in float64
    u = scratch.view(torch.float64)  # its memory again, for the result
    u.copy_(bits)
    return u.add_(0.5).mul_(2.0**-53)


def counter_uniform(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform float64 in (0, 1), one per int64 index, a pure function of (seed, stream, index)."""
    return keyed_uniform(_stream_key(seed, stream), index)


@functools.lru_cache(maxsize=None)
def _stream_key(seed: int, stream: int) -> int:
    return int(stream_keys(seed, [stream])[0])


def zipf_scale(rows: Sequence[int], exponent: float) -> np.ndarray:
    """Each table's constant of `zipf_ids`: (rows + 1)^(1 - exponent) - 1, or rows + 1 for
    exponent 1. Computed once, in numpy, as the data always was."""
    rows_plus_1 = np.asarray(rows, dtype=np.float64) + 1.0
    if abs(exponent - 1.0) < 1e-9:
        return rows_plus_1
    return np.power(rows_plus_1, 1.0 - exponent) - 1.0


def zipf_ids(u: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor,
             exponent: float) -> torch.Tensor:
    """Inverse CDF of a bounded power law on [1, rows + 1): id 0 is the most frequent. `rows`
    and `scale` (`zipf_scale`) broadcast against `u`, e.g. one per column."""
    if abs(exponent - 1.0) < 1e-9:
        x = torch.pow(scale, u)
    else:
        x = torch.pow(1.0 + u * scale, 1.0 / (1.0 - exponent))
    return torch.minimum(x.long() - 1, rows - 1)


SCATTER_MULTIPLIER = 2_654_435_761  # a prime above any table size: coprime to every row count


def scatter_ids(ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A bijection of 0..rows-1 (id -> (p * id + rows // 2) mod rows, p prime) that moves the
    frequent low ids apart: what id numbering by first appearance or by hashing looks like."""
    return (ids * SCATTER_MULTIPLIER + rows // 2) % rows


class SyntheticClicks(ClickDataset):
    """The planted-teacher dataset described by a `DataConfig`. Its columns are torch ops on
    any device: `batch(..., device)` makes a batch on a GPU, with the host's values."""

    STREAM_DENSE, STREAM_LABEL, STREAM_IDS, STREAM_LATENT, STREAM_LENGTHS = 0, 1, 2, 3, 4
    STREAM_MISSING = 5
    TASK_STREAMS = 1 << 12  # task t's streams: the shared ones + t * this (tables < 256)
    device_batches = True

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
        self._tables: Dict[torch.device, _TableConstants] = {}
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
        """Samples [first, first + count) of `split` as numpy arrays, made on the host; indices
        past its end are padding."""
        c = self.tensor_columns(split, first, count, CPU)
        numpy = lambda ts: None if ts is None else [np.ascontiguousarray(t) for t in ts]  # noqa
        return Columns(c.dense.numpy(), c.labels.numpy(), c.valid.numpy(), numpy(c.ids),
                       c.true_prob.numpy(), numpy(c.lengths))

    def batch(self, split: str, first: int, count: int,
              device: Optional[torch.device] = None) -> Batch:
        """`columns` as model inputs, made on `device` (the host if None)."""
        return Batch.from_columns(self.tensor_columns(split, first, count, device or CPU),
                                  self.spec.feature_names)

    def tensor_columns(self, split: str, first: int, count: int,
                       device: torch.device) -> Columns:
        """`columns` as torch tensors made on `device`: the same values on any device."""
        vectors = len(self.spec.cardinalities) + 1
        per_sample = max(sum(self.spec.hotness) * self.teacher_dim, vectors * vectors)
        rows = max(1, BLOCK_ELEMENTS.get(device.type, BLOCK_ELEMENTS["cuda"]) // per_sample)
        blocks = [self._block(split, start, min(rows, first + count - start), device)
                  for start in range(first, first + count, rows)]
        return blocks[0] if len(blocks) == 1 else _concat(blocks)

    def _block(self, split: str, first: int, count: int, device: torch.device) -> Columns:
        index = torch.arange(first, first + count, device=device) + SPLIT_OFFSET[split]
        tables = self._constants(device)
        dense = self._dense(index)
        ids = self._ids(index, tables)
        lengths = self._lengths(index, tables) if self.spec.variable_hotness else None
        valid = torch.arange(first, first + count, device=device) < self.sizes[split]
        if self.tasks:
            labels, prob = self._task_labels(index, dense, ids, lengths, tables)
        else:
            prob = torch.sigmoid(self.logit_bias + self._interaction(
                self._teacher_vectors(dense, ids, lengths, tables)))
            labels = (counter_uniform(self.seed, self.STREAM_LABEL, index) < prob).float()
        return Columns(dense.float(), labels, valid, ids, prob.float(), lengths)

    def _constants(self, device: torch.device) -> "_TableConstants":
        if device not in self._tables:  # made once per device: no host-to-device copy per batch
            self._tables[device] = _TableConstants(self, device)
        return self._tables[device]

    def _task_labels(self, index: torch.Tensor, dense: torch.Tensor, ids: list,
                     lengths: Optional[list], tables: "_TableConstants"):
        """Labels [B, T] (NaN: missing) and true probabilities [B, T] of the used tasks."""
        rho = self.task_correlation
        shared = self._interaction(self._teacher_vectors(dense, ids, lengths, tables))
        labels, probs = [], []
        for name in self.tasks:
            t = self.label_names.index(name)
            own = self._interaction(self._teacher_vectors(dense, ids, lengths, tables, t))
            prob = torch.sigmoid(self.logit_bias - 0.6 * t + rho**0.5 * shared
                                 + (1 - rho)**0.5 * own)
            streams = self.TASK_STREAMS * t
            label = (counter_uniform(self.seed, self.STREAM_LABEL + streams, index) < prob).float()
            if t and self.label_missing:
                missing = counter_uniform(self.seed, self.STREAM_MISSING + streams, index)
                label.masked_fill_(missing < self.label_missing, float("nan"))  # no device sync
            labels.append(label)
            probs.append(prob)
        return torch.stack(labels, 1), torch.stack(probs, 1)

    def _dense(self, index: torch.Tensor) -> torch.Tensor:
        n = self.spec.num_dense
        flat = index[:, None] * n + torch.arange(n, device=index.device)
        return torch.special.ndtri(counter_uniform(self.seed, self.STREAM_DENSE, flat))

    def _ids(self, index: torch.Tensor, tables: "_TableConstants") -> list:
        """[B, hot] ids per table, all tables in one pass (a column per id slot of a table).
        Sample i draws from counter slots i * stride + 0..hot-1: a stride of at least hot keeps
        neighbouring samples' slots apart, and 64 for hot <= 64 keeps the data as it always was."""
        u = keyed_uniform(tables.id_key, index[:, None] * tables.id_stride + tables.id_slot)
        ids = zipf_ids(u, tables.rows, tables.zipf_scale, self.exponent)
        if self.scattered:
            ids = scatter_ids(ids, tables.rows)
        return list(ids.split(self.spec.hotness, dim=1))  # views: the KJT copies them once

    def _lengths(self, index: torch.Tensor, tables: "_TableConstants") -> list:
        """Ids used by each sample's lookup of each feature, uniform in 1..hotness: [B] int32."""
        u = keyed_uniform(tables.length_key, index[:, None])
        lengths = torch.minimum((u * tables.hotness).int(), tables.hotness - 1) + 1  # u may be 1.0
        return list(lengths.unbind(dim=1))

    def _pooled_latents(self, ids: list, lengths: Optional[list], tables: "_TableConstants",
                        task: int) -> torch.Tensor:
        """Every table's teacher latent vectors of its `ids` ([B, hot] each; a task's own for
        `task` >= 0), mean-pooled over each row's first `lengths` ids (all if None), scaled:
        [B, tables, d]. All tables' draws in one pass."""
        d, hotness = self.teacher_dim, self.spec.hotness
        slots = torch.cat(ids, dim=1)
        latents = tables.latent_rows(task, d)
        if latents is not None:  # every table's rows, one after the other
            vec = latents.index_select(0, (slots + tables.first_row).flatten())
            vec = vec.view(*slots.shape, d)
        else:
            vec = _latent_draws(slots, tables.latent_keys[task + 1][:, None], d)
        if lengths is None and vec.shape[1] == len(ids):  # one id each: no pooling
            return vec / d**0.5
        parts = vec.split(hotness, dim=1)
        return torch.stack([_pool(part, None if lengths is None else n)
                            for part, n in zip(parts, lengths or [None] * len(parts))],
                           dim=1) / d**0.5

    def _interaction(self, z: torch.Tensor) -> torch.Tensor:
        """The teacher's scaled sum over z [B, n, d], its logit less the bias: a2 * sum_{i<j}
        <z_i, z_j>, and for teacher_order 3 + a3 * sum_{i<j<k} sum_c z_ic z_jc z_kc (a2, a3 set
        in __init__); variance teacher_scale^2, mean 0."""
        dots = torch.bmm(z, z.transpose(1, 2))
        n = z.shape[1]
        upper = torch.triu_indices(n, n, offset=1, device=z.device)  # flat, in row-major order:
        pairs = torch.index_select(dots.flatten(1), 1, upper[0] * n + upper[1])  # as dots[:, i, j]
        total = self.logit_scale * pairs.sum(dim=1)
        if self.order == 3:
            total = total + self.triple_scale * third_order(z)
        return total

    def _teacher_vectors(self, dense: torch.Tensor, ids: list, lengths: Optional[list],
                         tables: Optional["_TableConstants"] = None,
                         task: int = -1) -> torch.Tensor:
        """z = [dense projection, one pooled latent per table]: [B, F + 1, d]; a task's own
        for `task` >= 0."""
        tables = tables or self._constants(dense.device)
        projected = dense @ tables.projections[task + 1] / self.teacher_dim**0.5
        return torch.cat([projected[:, None], self._pooled_latents(ids, lengths, tables, task)],
                         dim=1)


def _latent_draws(ids: torch.Tensor, keys: torch.Tensor, d: int) -> torch.Tensor:
    """The unscaled teacher latent vectors of `ids` [..., columns], each column's ids drawn with
    its key (`keys` broadcasting against them): [..., columns, d] float64, N(0, 1) entries."""
    flat = (ids * d)[..., None] + torch.arange(d, device=ids.device)
    flat ^= keys
    vec = _uniform_of(flat)
    return torch.special.ndtri(vec, out=vec)


def _concat(blocks: List[Columns]) -> Columns:
    """Columns of consecutive blocks of samples as one."""
    cat = lambda name: torch.cat([getattr(b, name) for b in blocks])  # noqa: E731
    per_table = lambda name: [torch.cat(ts)  # noqa: E731
                              for ts in zip(*[getattr(b, name) for b in blocks])]
    return Columns(cat("dense"), cat("labels"), cat("valid"), per_table("ids"), cat("true_prob"),
                   None if blocks[0].lengths is None else per_table("lengths"))


def _pool(vec: torch.Tensor, lengths: Optional[torch.Tensor]) -> torch.Tensor:
    """Mean of [B, hot, d] over each row's first `lengths` (all if None) of hot: [B, d]."""
    if lengths is None:
        return vec.mean(dim=1)
    n = lengths[:, None]
    used = torch.arange(vec.shape[1], device=vec.device) < n
    return (vec * used[..., None]).sum(dim=1) / n


class _TableConstants:
    """Per-column constants of one device's draws (a column: one id slot of one table, or one
    table), and the teacher's dense projections there."""

    def __init__(self, data: SyntheticClicks, device: torch.device) -> None:
        spec, seed = data.spec, data.seed
        slots = [(t, k) for t, hot in enumerate(spec.hotness) for k in range(hot)]
        on = lambda values, dtype=torch.int64: (  # noqa: E731
            torch.as_tensor(values, dtype=dtype).to(device))
        self.id_slot = on([k for _, k in slots])
        self.id_stride = on([max(64, spec.hotness[t]) for t, _ in slots])
        self.id_key = on(stream_keys(seed, [data.STREAM_IDS + 16 * t for t, _ in slots]))
        rows = [spec.cardinalities[t] for t, _ in slots]
        self.rows = on(rows)
        self.zipf_scale = on(zipf_scale(rows, data.exponent), torch.float64)
        self.hotness = on(spec.hotness, torch.int32)
        self.length_key = on(stream_keys(seed, [data.STREAM_LENGTHS + 16 * t
                                                for t in range(len(spec.hotness))]))
        self.latent_keys = [  # [task + 1]: the shared latents' streams, then each task's own
            on(stream_keys(seed, [data.STREAM_LATENT + 16 * t + data.TASK_STREAMS * shift
                                  for t, _ in slots]))
            for shift in range(len(data.label_names) + 1)]
        self.projections = [p.to(device) for p in [data.dense_proj, *data.task_dense_proj]]
        first = np.cumsum([0, *spec.cardinalities])  # each table's first row in latent_rows
        self.first_row = on([int(first[t]) for t, _ in slots])
        self._table_slots = [slots.index((t, 0)) for t in range(len(spec.hotness))]
        self._cardinalities, self._device = spec.cardinalities, device
        self._latent_rows: Dict[int, torch.Tensor] = {}

    def latent_rows(self, task: int, d: int) -> Optional[torch.Tensor]:
        """Every table's unscaled teacher latent vectors (a task's own for `task` >= 0), one
        table after the other, [all rows, d], drawn on first use; None where they would hold
        over LATENT_TABLE_ELEMENTS entries."""
        if sum(self._cardinalities) * d > LATENT_TABLE_ELEMENTS:
            return None
        if task not in self._latent_rows:
            keys = self.latent_keys[task + 1]
            self._latent_rows[task] = torch.cat([
                _latent_draws(torch.arange(rows, device=self._device), keys[slot], d)
                for rows, slot in zip(self._cardinalities, self._table_slots)])
        return self._latent_rows[task]


def third_order(z: torch.Tensor) -> torch.Tensor:
    """sum over triples i<j<k of sum_c z_ic z_jc z_kc, for z [B, n, d]: per coordinate c the
    elementary symmetric polynomial e3 = (p1^3 - 3 p1 p2 + 2 p3) / 6 of z_1c..z_nc, p_k the
    power sums sum_i z_ic^k (Newton's identities), so O(n d) instead of O(n^3 d): [B]."""
    p1, p2, p3 = (z.pow(k).sum(dim=1) for k in (1, 2, 3))
    return ((p1**3 - 3 * p1 * p2 + 2 * p3) / 6).sum(dim=1)
