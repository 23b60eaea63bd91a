"""torchrec's own planner on our tables, its plan turned into our `Plan` so that one cost model
scores both.

`EmbeddingShardingPlanner` gets the model's EmbeddingBagCollection built on the meta device
(nothing allocated, no GPU needed), a `Topology` of `compute_device="cuda"` with our per-rank
budget as `hbm_cap` (no further reservation), 8 ranks per host unless told otherwise, the
device's memory and host bandwidths, the local batch, and per table our hotness as its pooling
factor and our optimizer (its state counts in torchrec's storage estimate too). Its menu is ours:
`table_wise`, `column_wise` and `data_parallel` only (row-wise does not run on gloo and our cost
model does not price it). One difference stays: torchrec's column-wise shards all have one width,
`min_partition` (`cw_width`, 32 by default: 4 shards of a 128-wide table), where our placer picks
a shard count per table.

Its search is slow at scale, so `plan_in_subprocess` runs it in a child process and gives up
after `timeout_s`. Used by benchmarks/plan_quality.py.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import warnings
from dataclasses import dataclass
from typing import List, Optional, Sequence

from dlrm_hybrid.parallel.plan import Plan, Shard
from dlrm_hybrid.parallel.tables import TableSpec

MENU = ("table_wise", "column_wise", "data_parallel")
CW_WIDTH = 32  # torchrec's min_partition: the one width of its column-wise shards
RANKS_PER_HOST = 8


@dataclass(frozen=True)
class Bandwidths:
    """Bytes/s per rank: embedding memory, all-to-all within a host and between hosts."""
    memory: float
    intra_host: float
    inter_host: float


@dataclass
class PlannerResult:
    plan: Optional[Plan]  # None when it failed or ran out of time
    seconds: float  # EmbeddingShardingPlanner.plan() alone, or the time given up after
    failure: str = ""  # why there is no plan


def torchrec_plan(tables: Sequence[TableSpec], world_size: int, budget_bytes: int, batch_size: int,
                  bandwidths: Bandwidths, gpus_per_node: Optional[int] = RANKS_PER_HOST,
                  cw_width: int = CW_WIDTH) -> PlannerResult:
    """torchrec's plan for `tables` (global batch `batch_size`), in this process."""
    import torch
    from torch.distributed.optim import _apply_optimizer_in_backward
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import (EmbeddingShardingPlanner, ParameterConstraints,
                                              Topology)
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import PlannerError
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from dlrm_hybrid.train.optim import EMBEDDING_OPTIMIZERS

    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)  # its advice on dry runs
    warnings.filterwarnings("ignore", module="torchrec.distributed.planner")
    precisions = {"fp32": DataType.FP32, "fp16": DataType.FP16}
    bags = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                           feature_names=[t.name], data_type=precisions[t.precision])
        for t in tables])
    by_name = {t.name: t for t in tables}
    for optimizer in {t.optimizer for t in tables}:
        _apply_optimizer_in_backward(
            EMBEDDING_OPTIMIZERS[optimizer],
            [bags.embedding_bags[n].weight for n, t in by_name.items() if t.optimizer == optimizer],
            {"lr": 0.01})
    constraints = {t.name: ParameterConstraints(
        sharding_types=list(MENU), pooling_factors=[float(t.hotness)],
        num_poolings=[float(t.bags)], min_partition=min(cw_width, t.dim)) for t in tables}
    topology = Topology(world_size=world_size, compute_device="cuda", hbm_cap=budget_bytes,
                        local_world_size=gpus_per_node or world_size,
                        hbm_mem_bw=bandwidths.memory / 1000,  # torchrec counts bytes per ms
                        intra_host_bw=bandwidths.intra_host / 1000,
                        inter_host_bw=bandwidths.inter_host / 1000)
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=batch_size // world_size, constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.0), debug=False)
    start = time.perf_counter()
    try:
        sharding = planner.plan(bags, [EmbeddingBagCollectionSharder()])
    except PlannerError as e:
        return PlannerResult(None, time.perf_counter() - start, str(e).splitlines()[0])
    seconds = time.perf_counter() - start
    (module_plan,) = sharding.plan.values()
    return PlannerResult(to_plan(module_plan, tables, world_size, budget_bytes, batch_size,
                                 gpus_per_node), seconds)


def to_plan(module_plan, tables: Sequence[TableSpec], world_size: int, budget_bytes: int,
            batch_size: int, gpus_per_node: Optional[int]) -> Plan:
    """Our `Plan` of torchrec's per-table `ParameterSharding`s: table_wise is one shard,
    column_wise one per entry of its shard metadata (offsets and widths), data_parallel a
    replicated table. Any other sharding type is outside the menu and an error."""
    shards: List[Shard] = []
    replicated = set()
    for t in tables:
        p = module_plan[t.name]
        if p.sharding_type == "data_parallel":
            replicated.add(t.name)
        elif p.sharding_type == "table_wise":
            shards.append(Shard(t.name, p.ranks[0], 0, t.dim))
        elif p.sharding_type == "column_wise":
            shards += [Shard(t.name, m.placement.rank(), m.shard_offsets[1], m.shard_sizes[1])
                       for m in p.sharding_spec.shards]
        else:
            raise ValueError(f"table {t.name}: torchrec chose {p.sharding_type}, not in {MENU}")
    plan = Plan(world_size, "torchrec", budget_bytes, batch_size, {t.name: t for t in tables},
                shards, gpus_per_node, frozenset(replicated))
    _check_covered(plan)
    return plan


def _check_covered(plan: Plan) -> None:
    """Every table is replicated, or its shards tile its columns once: a conversion that lost a
    shard would score a cheaper plan than torchrec's."""
    for name, table in plan.tables.items():
        spans = sorted((s.col_offset, s.cols) for s in plan.shards_of(name))
        ends = [0] + [offset + cols for offset, cols in spans]
        tiled = bool(spans) and [o for o, _ in spans] == ends[:-1] and ends[-1] == table.dim
        if tiled == (name in plan.replicated):
            raise ValueError(f"table {name}: torchrec's plan gives it shards {spans} of its "
                             f"{table.dim} columns{' and replicates it' if spans else ''}")


def plan_in_subprocess(tables: Sequence[TableSpec], world_size: int, budget_bytes: int,
                       batch_size: int, bandwidths: Bandwidths,
                       gpus_per_node: Optional[int] = RANKS_PER_HOST, cw_width: int = CW_WIDTH,
                       timeout_s: float = 120.0) -> PlannerResult:
    """`torchrec_plan` in a forked child process, abandoned after `timeout_s` seconds. torchrec
    is imported here first, so that each child starts with it."""
    import torchrec.distributed.planner  # noqa: F401

    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_plan_into, daemon=True, args=(
        send, tables, world_size, budget_bytes, batch_size, bandwidths, gpus_per_node, cw_width))
    child.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            return PlannerResult(None, timeout_s, f"did not finish in {timeout_s:g} s")
        return receive.recv()
    except EOFError:
        child.join()
        return PlannerResult(None, 0.0, f"failed: its process ended with code {child.exitcode}")
    finally:
        child.kill()
        child.join()


def _plan_into(send, *args) -> None:
    """The child's side: its result, or its error in one line, through the pipe."""
    logging.disable(logging.WARNING)  # its per-table notices on the root logger, in this child only
    try:
        result = torchrec_plan(*args)
    except Exception as e:  # any error of torchrec's is this cell's result, not the table's end
        result = PlannerResult(None, 0.0, f"failed: {type(e).__name__}: {e}".splitlines()[0])
    send.send(result)
