"""Modeled time of one training step's embedding work on each rank: what a plan costs.

Every rank waits for the others at the all-to-all, so the slowest rank sets the step and the
placer minimises `step_time(plan, device).max_s`. Per rank r, at global batch B over P ranks
(b = B / P samples each) in hosts of g ranks:

- lookup: the bytes r's shards read in the forward and update in the backward for the whole
  batch; for each replicated table, its own samples' lookups plus the whole-table update every
  step (weights and optimizer state read and written, the dense gradient written and read);
  over the memory bandwidth.
- all-to-all: as owner, r sends the pooled vectors of every other rank's samples and receives
  their ids and gradients; as holder of b samples it sends ids and gradients to every other
  owner and receives their pooled vectors. Of the traffic between an owner and the batch, 1/P
  is its own (free), (g-1)/P stays inside its host, (P-g)/P crosses hosts. Links are full
  duplex: each takes the larger of the bytes sent and received over its bandwidth.
- fixed: a cost per shard (and replicated table) r serves, and per message r sends: one per
  peer with data in each all-to-all (ids, pooled vectors, gradients).
- all-reduce: the replicated tables' dense fp32 gradients, ring all-reduce (2(P-1)/P of the
  bytes), at the inter-host bandwidth where there are several hosts. They travel in the dense
  layers' DDP buckets, whose messages every plan pays: only their bytes are charged.

Not modeled: the dense MLPs (the same for every plan), overlap of communication with compute,
contention beyond each rank's own links. Memory is no time: it is the placer's hard limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Mapping, Optional, Protocol, Sequence, Tuple, Union

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.tables import shard_columns

Values = Union[np.ndarray, float]
_FIXED_NOTE = "fixed costs are estimates (kernel launch ~5 us, NCCL message ~10 us)"


class PlanView(Protocol):
    """What the cost model reads of a plan: parallel/plan.py's `Plan`, which is built on this
    module (so named here by its fields, not imported)."""

    world_size: int
    gpus_per_node: Optional[int]
    batch_size: int
    tables: Mapping[str, Any]  # name -> TableSpec
    shards: Sequence[Any]  # Shards: table, rank, cols
    replicated: FrozenSet[str]


@dataclass(frozen=True)
class DeviceConstants:
    name: str
    memory_bandwidth: float  # bytes/s: embedding lookups and updates (HBM)
    intra_host_bandwidth: float  # bytes/s per rank and direction, all-to-all / all-reduce in a host
    inter_host_bandwidth: float  # bytes/s per rank and direction, across hosts
    shard_fixed_s: float  # seconds per shard (or replicated table) a rank serves per step
    message_fixed_s: float  # seconds per message (one peer, one collective) a rank sends
    source: str  # where the numbers come from (one line)


DEVICES: Dict[str, DeviceConstants] = {
    "h100": DeviceConstants(
        "h100", 3.35e12, 450e9, 50e9, 5e-6, 10e-6,
        "H100 SXM datasheet: HBM3 3.35 TB/s, NVLink 4 900 GB/s both ways; DGX H100: one 400 Gb/s "
        f"ConnectX-7 NIC per GPU; {_FIXED_NOTE}"),
    "h200": DeviceConstants(
        "h200", 4.8e12, 450e9, 50e9, 5e-6, 10e-6,
        "H200 SXM datasheet: HBM3e 4.8 TB/s, NVLink 4 900 GB/s both ways; DGX H200: one 400 Gb/s "
        f"ConnectX-7 NIC per GPU; {_FIXED_NOTE}"),
    "a100": DeviceConstants(
        "a100", 2.0e12, 300e9, 25e9, 5e-6, 10e-6,
        "A100 80GB SXM datasheet: HBM2e 2.0 TB/s, NVLink 3 600 GB/s both ways; DGX A100: one "
        f"200 Gb/s HDR NIC per GPU; {_FIXED_NOTE}"),
    "cpu_gloo": DeviceConstants(
        "cpu_gloo", 1.91e9, 9.11e8, 9.11e8, 2.2e-5, 2.6e-4,
        "benchmarks/gloo_constants.py: AMD EPYC, 2 cores, 2 gloo ranks of 1 thread, torch 2.13.0 "
        "(one host: inter = intra)"),
}
TIME_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceConstants)
                    if f.name not in ("name", "source"))


def device_constants(kind: str, overrides: Mapping[str, float]) -> DeviceConstants:
    """DEVICES[kind] with `parallel.cost_model` overrides; a one-line ConfigError for an unknown
    device or constant, or a value that is not positive."""
    if kind not in DEVICES:
        raise ConfigError(f"parallel.device: {kind!r} is not one of auto, {', '.join(DEVICES)}")
    for key, value in overrides.items():
        if key not in TIME_FIELDS:
            raise ConfigError(f"parallel.cost_model.{key}: unknown constant; set one of "
                              f"{', '.join(TIME_FIELDS)}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"parallel.cost_model.{key}: must be a positive number (bytes/s or "
                              f"seconds), got {value!r}")
    base = DEVICES[kind]
    if not overrides:
        return base
    return dataclasses.replace(base, **{k: float(v) for k, v in overrides.items()},
                               source=f"{base.source}; parallel.cost_model sets "
                                      f"{', '.join(sorted(overrides))}")


def device_kind(setting: str, gpu_name: Optional[str]) -> str:
    """The DEVICES key a training job models: `parallel.device` unless auto; auto: the GPU's
    kind by its name (h100 for another GPU), cpu_gloo for CPU ranks (`gpu_name` None)."""
    if setting != "auto":
        return setting
    if gpu_name is None:
        return "cpu_gloo"
    return next((k for k in ("h200", "h100", "a100") if k in gpu_name.lower()), "h100")


@dataclass
class StepTime:
    """Per-rank seconds per step, arrays over ranks."""
    lookup_s: np.ndarray
    a2a_intra_s: np.ndarray
    a2a_inter_s: np.ndarray
    fixed_s: np.ndarray
    allreduce_s: np.ndarray

    PARTS = ("lookup_s", "a2a_intra_s", "a2a_inter_s", "fixed_s", "allreduce_s")

    @property
    def total_s(self) -> np.ndarray:
        return self.lookup_s + self.a2a_intra_s + self.a2a_inter_s + self.fixed_s + self.allreduce_s

    @property
    def max_s(self) -> float:
        return float(self.total_s.max())


@dataclass
class RankSums:
    """What a rank's step time depends on: its own shards' sums, its host's and all ranks'
    (arrays over ranks, broadcast, or one hypothetical rank's values: the placer scores every
    rank for a shard at once with these)."""
    pooled: Values  # bytes per sample of the pooled vectors its shards give (one direction)
    ids: Values  # bytes per sample of the ids and lengths its shards take in
    lookup: Values  # bytes its shards read and update per step
    shards: Values  # shards it owns
    host_pooled: Values  # `pooled` summed over its host
    host_ids: Values
    total_pooled: Values  # over all ranks
    total_ids: Values
    owners: Values  # ranks owning a shard


@dataclass(frozen=True)
class Layout:
    """What every rank shares: ranks, hosts, samples per rank and the replicated tables."""
    world: int
    per_host: int  # ranks per host (world for one host)
    local_batch: float
    replicated_lookup: float = 0.0  # bytes per rank per step, lookups and whole-table updates
    replicated_count: int = 0
    replicated_gradient: float = 0.0  # bytes of their dense fp32 gradients


def rank_times(s: RankSums, layout: Layout, device: DeviceConstants) -> StepTime:
    """The cost model's formulas (module docstring) over `s`."""
    parts = _parts(s, layout, device)
    shape = np.broadcast_shapes(*(np.shape(p) for p in parts))
    return StepTime(*(np.broadcast_to(np.asarray(p, dtype=float), shape).copy() for p in parts))


def rank_totals(s: RankSums, layout: Layout, device: DeviceConstants) -> np.ndarray:
    """`rank_times(...).total_s`, without keeping the parts (the placer scores with it)."""
    lookup, intra, inter, fixed, allreduce = _parts(s, layout, device)
    return lookup + intra + inter + fixed + allreduce


def _parts(s: RankSums, layout: Layout, device: DeviceConstants) -> Tuple[Values, ...]:
    own = own_traffic(s.pooled, s.ids, layout)
    host = s.host_ids + s.host_pooled
    b = layout.local_batch
    return (lookup_s(s.lookup, layout, device),
            np.maximum(*intra_bytes(own, host, s.host_pooled, b)) / device.intra_host_bandwidth,
            np.maximum(*inter_bytes(own, host, s.host_pooled, s.total_pooled, s.total_ids, b))
            / device.inter_host_bandwidth,
            fixed_s(s.shards, s.owners, layout, device),
            allreduce_s(layout, device))


# The formulas in parts, so that a placer can keep a rank's own terms and its host's between
# shards (greedy_state.py's scorer, bit for bit these): arrays over ranks, or one rank's floats.

def own_traffic(pooled: Values, ids: Values, layout: Layout) -> Tuple[Values, ...]:
    """What a rank's link bytes need of its own sums: its pooled bytes per sample and `mine`
    (per sample and peer: ids and gradients into its shards), each also times the other ranks
    of its host and times the ranks outside it."""
    mine = ids + pooled
    near, far = layout.per_host - 1, layout.world - layout.per_host
    return pooled, mine, near * pooled, near * mine, far * pooled, far * mine


def intra_bytes(own: Tuple[Values, ...], host: Values, host_pooled: Values,
                b: float) -> Tuple[Values, Values]:
    """Bytes sent and received per step inside the host (`host`: its ids + pooled)."""
    pooled, mine, near_pooled, near_mine = own[:4]
    return (b * (near_pooled + host - mine),  # pooled out; ids, gradients to host owners
            b * (near_mine + host_pooled - pooled))


def inter_bytes(own: Tuple[Values, ...], host: Values, host_pooled: Values, total_pooled: Values,
                total_ids: Values, b: float) -> Tuple[Values, Values]:
    """Bytes sent and received per step across hosts."""
    far_pooled, far_mine = own[4:]
    return (b * (far_pooled + total_ids + total_pooled - host),
            b * (far_mine + total_pooled - host_pooled))


def lookup_s(lookup: Values, layout: Layout, device: DeviceConstants) -> Values:
    return (lookup + layout.replicated_lookup) / device.memory_bandwidth


def fixed_s(shards: Values, owners: Values, layout: Layout, device: DeviceConstants) -> Values:
    owns = np.asarray(shards) > 0
    messages = owns * (layout.world - 1) + 2 * (owners - owns)
    return device.shard_fixed_s * (shards + layout.replicated_count) + \
        device.message_fixed_s * messages


def allreduce_s(layout: Layout, device: DeviceConstants) -> float:
    world, g = layout.world, layout.per_host
    if world == 1 or not layout.replicated_gradient:
        return 0.0
    link = device.inter_host_bandwidth if world > g else device.intra_host_bandwidth
    return 2 * (world - 1) / world * layout.replicated_gradient / link


def layout_of(plan: PlanView) -> Layout:
    return make_layout(plan.world_size, plan.gpus_per_node, plan.batch_size,
                       [plan.tables[name] for name in sorted(plan.replicated)])


def make_layout(world: int, per_host: Optional[int], batch: int, replicated: Sequence) -> Layout:
    """`replicated`: the TableSpecs every rank holds whole."""
    local = batch / world
    return Layout(world, per_host or world, local,
                  sum(t.shard_lookup_bytes(t.dim, local) + replicated_update_bytes(t)
                      for t in replicated),
                  len(replicated), float(sum(t.rows * t.dim * 4 for t in replicated)))


def replicated_update_bytes(table) -> float:
    """Memory traffic of updating a replicated table whole each step: weights and optimizer
    state read and written, its dense fp32 gradient written and read."""
    return 2.0 * (table.bytes + table.rows * table.dim * 4)


def rank_sums(plan: PlanView) -> RankSums:
    """The plan's per-rank sums (hosts broadcast to their ranks)."""
    world = plan.world_size
    per_host = plan.gpus_per_node or world
    ranks = np.fromiter((s.rank for s in plan.shards), dtype=np.int64, count=len(plan.shards))
    per_shard = np.empty((len(plan.shards), 3))  # by `TableColumns`: numpy calls per kind of
    for index, table, cols in shard_columns(plan.tables, plan.shards):  # table, not per shard
        for column, values in enumerate(shard_terms(table, cols, plan.batch_size)):
            per_shard[index, column] = values
    pooled, ids, lookup = (np.bincount(ranks, weights=w, minlength=world) for w in per_shard.T)
    shards = np.bincount(ranks, minlength=world).astype(float)
    on_host = lambda v: np.repeat(v.reshape(-1, per_host).sum(axis=1), per_host)  # noqa: E731
    return RankSums(pooled, ids, lookup, shards, on_host(pooled), on_host(ids), pooled.sum(),
                    ids.sum(), float((shards > 0).sum()))


def shard_terms(table, cols: int, batch: int) -> Tuple[float, float, float]:
    """A shard's pooled and id bytes per sample and lookup bytes per step."""
    return table.pooled_bytes(cols), table.id_bytes, table.shard_lookup_bytes(cols, batch)


def step_time(plan: PlanView, device: DeviceConstants) -> StepTime:
    return rank_times(rank_sums(plan), layout_of(plan), device)


def a2a_bytes(plan: PlanView) -> Tuple[np.ndarray, np.ndarray]:
    """Bytes each rank sends per step in the all-to-all (forward and backward: ids, pooled
    vectors, gradients), inside its host and across hosts."""
    send_intra, _, send_inter, _ = _link_bytes(rank_sums(plan), layout_of(plan))
    return send_intra, send_inter


def _link_bytes(s: RankSums, layout: Layout) -> Tuple[Values, Values, Values, Values]:
    """Bytes sent and received per step inside the host, then across hosts."""
    own = own_traffic(s.pooled, s.ids, layout)
    host = s.host_ids + s.host_pooled
    b = layout.local_batch
    return (*intra_bytes(own, host, s.host_pooled, b),
            *inter_bytes(own, host, s.host_pooled, s.total_pooled, s.total_ids, b))
