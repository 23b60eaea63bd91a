"""Turn a placement into a torchrec ShardingPlan, shard the model, and initialise the tables.

Table initialisation must not depend on the placement: each table's values come from its own
seeded generator, in fixed row blocks, and a rank copies in only the shards it owns. That is
what makes a 1-rank and an 8-rank run start from the same weights.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import (CommType, QCommsConfig,
                                                     get_qcomm_codecs_registry)
from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                data_parallel, table_wise)
from torchrec.distributed.types import ShardingPlan

from dlrm_hybrid.compat import sharding_env
from dlrm_hybrid.model.compositional import Part
from dlrm_hybrid.model.dlrm import DLRM
from dlrm_hybrid.model.interactions import CatInteraction
from dlrm_hybrid.parallel.cpu_lookup import speed_up_cpu_tables
from dlrm_hybrid.parallel.dense_memory import dense_layout
from dlrm_hybrid.parallel.dense_sharding import dense_param_names, shard_dense
from dlrm_hybrid.parallel.exchange import install_exchange
from dlrm_hybrid.parallel.narrow_replicas import keep_fp32_grads
from dlrm_hybrid.parallel.plan import PlacementError, Plan

INIT_ROW_BLOCK = 65536  # rows generated per seeded block


def sharding_plan(model: DLRM, plan: Plan, local_world_size: int,
                  device_type: str) -> ShardingPlan:
    """torchrec's plan for `plan`; PlacementError for a plan that leaves a table out (torchrec
    would build the module without it, or fail deep inside)."""
    problem = plan.unplaced()
    if problem is not None:
        raise PlacementError(f"cannot shard the model: {problem}")
    per_table = {}
    for name in plan.tables:
        ranks = [s.rank for s in sorted(plan.shards_of(name), key=lambda s: s.col_offset)]
        per_table[name] = (data_parallel() if name in plan.replicated
                           else table_wise(rank=ranks[0]) if len(ranks) == 1
                           else column_wise(ranks=ranks))
    module_plan = construct_module_sharding_plan(
        model.embedding_bags, per_table, local_size=local_world_size,
        world_size=plan.world_size, device_type=device_type)
    return ShardingPlan({"embedding_bags": module_plan})


def shard_model(model: DLRM, plan: Plan, device: torch.device, local_world_size: int,
                comm_precision: str = "fp32", exchange: str = "pooled", dense: str = "ddp",
                hsdp_shard_size: int = 0) -> DistributedModelParallel:
    """Shard the embeddings by `plan`; the rest becomes data-parallel (DDP), or with `dense`
    fsdp/hsdp the dense modules are sharded by FSDP2 (dense_sharding.py; `hsdp_shard_size` 0:
    one host's ranks) and DDP keeps the replicated tables. A job of one rank has nothing to
    all-reduce and skips DDP (1-2 ms per step of its hooks and copies on CPU).
    On CPU the tables go onto huge pages, and SGD ones use every core (cpu_lookup.py); fp16
    replicated tables keep their gradient in fp32 (narrow_replicas.py).
    `exchange` (pooled | des) is what the owners send back (exchange.py); with des and `cat`,
    the first top layer's weight stays out of DDP."""
    env = sharding_env(dist.group.WORLD)
    codecs = comm_codecs(comm_precision, device)
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=codecs)
    if dense != "ddp":  # FSDP2 shards them below; DDP keeps the replicated tables, if any
        not_ddp = dense_param_names(model)
    elif exchange == "des" and isinstance(model.interaction, CatInteraction):
        not_ddp = [f"over_arch.{name}" for name, p in model.over_arch.named_parameters()
                   if p is model.first_top_layer().weight]
    else:
        not_ddp = []
    if isinstance(getattr(model, "loss", None), torch.nn.Module):
        # A two-tower loss's state (item frequencies, recent item vectors) is updated from the
        # global batch on every rank alike: DDP need not broadcast it each step.
        not_ddp += [f"loss.{name}" for name, _ in model.loss.named_buffers()]
    if getattr(model, "tasks", None):
        not_ddp.append("task_weights")  # the config's constants, equal on every rank
    dmp = DistributedModelParallel(
        model, env=env, device=device, sharders=[sharder],
        plan=sharding_plan(model, plan, local_world_size, device.type),
        init_data_parallel=plan.world_size > 1,
        data_parallel_wrapper=DefaultDataParallelWrapper(params_to_ignore=not_ddp))
    dmp.module.to(device)  # what the DDP wrapper does first
    keep_fp32_grads(dmp)  # fp16 replicated tables: their gradient averaged in fp32
    if dense != "ddp":
        shard_dense(dmp.module, dense, device,
                    dense_layout(dense, hsdp_shard_size, plan.world_size, local_world_size))
    if device.type == "cpu":
        speed_up_cpu_tables(dmp)
    install_exchange(dmp, exchange, plan.world_size, comm_precision, codecs)
    return dmp


def comm_codecs(precision: str, device: torch.device) -> Optional[dict]:
    """torchrec's quantized-comms codecs: the pooled embeddings travel in `precision`, their
    gradients in bf16 (fp16 gradients underflow); gloo has no bf16 and uses fp16 for both."""
    if precision == "fp32":
        return None
    forward = CommType.FP16 if precision == "fp16" or device.type == "cpu" else CommType.BF16
    backward = CommType.FP16 if device.type == "cpu" else CommType.BF16
    return get_qcomm_codecs_registry(QCommsConfig(forward_precision=forward,
                                                  backward_precision=backward), device=device)


def init_tables(dmp: DistributedModelParallel, tables: List[Part], seed: int) -> None:
    """Fill each locally owned shard of each table with U(-b, b), b its `init_bound`:
    1/sqrt(rows) for a full table, as the original DLRM (compositional.py). A replicated
    (data_parallel) table is a plain tensor on every rank: the whole table, the same blocks."""
    state = dmp.state_dict()
    for index, table in enumerate(tables):
        weight = state[_state_key(state, table.table)]
        for (row0, col0), tensor in local_pieces(weight):
            rows, cols = tensor.shape
            with torch.no_grad():
                for start in range(row0 - row0 % INIT_ROW_BLOCK, row0 + rows, INIT_ROW_BLOCK):
                    block = _table_block(seed, index, start, table)
                    lo, hi = max(start, row0), min(start + block.shape[0], row0 + rows)
                    tensor[lo - row0:hi - row0].copy_(
                        block[lo - start:hi - start, col0:col0 + cols])


def local_pieces(weight: torch.Tensor) -> List[Tuple[Tuple[int, int], torch.Tensor]]:
    """((first row, first column), tensor) of each piece of a table's state-dict entry this
    rank holds: its local shards, or the whole table where it is replicated (a plain tensor)."""
    if hasattr(weight, "local_shards"):
        return [(tuple(s.metadata.shard_offsets), s.tensor) for s in weight.local_shards()]
    return [((0, 0), weight)]


def _table_block(seed: int, table_index: int, start: int, table: Part) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((seed, table_index, start)) & 0x7FFFFFFFFFFFFFFF)
    rows = min(INIT_ROW_BLOCK, table.rows - start)
    bound = table.init_bound
    return torch.empty(rows, table.dim).uniform_(-bound, bound, generator=gen)


def _state_key(state: dict, table_name: str) -> str:
    suffix = f"embedding_bags.embedding_bags.{table_name}.weight"
    (key,) = [k for k in state if k.endswith(suffix)]
    return key


def applied_sharding(dmp: DistributedModelParallel) -> dict:
    """What torchrec actually did with each table: {name: {"sharding": type, "ranks": [...]}}."""
    module_plan = dmp.plan.plan["embedding_bags"]
    return {name: {"sharding": p.sharding_type, "ranks": list(p.ranks)}
            for name, p in module_plan.items()}
