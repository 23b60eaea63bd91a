"""The placement a running job uses: the plan file `parallel.plan` names (checked against the
model), or a fresh plan for this job's ranks, hosts and memory."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from dlrm_hybrid.config import parse_bytes
from dlrm_hybrid.parallel.cost_model import DEVICES, DeviceConstants, device_constants, device_kind
from dlrm_hybrid.parallel.greedy_search import plan_tables, search_rules
from dlrm_hybrid.parallel.plan import Plan
from dlrm_hybrid.parallel.plan_file import check_plan, load_plan
from dlrm_hybrid.parallel.process_group import DistEnv
from dlrm_hybrid.parallel.tables import TableSpec

CPU_DEFAULT_MEMORY = 8 * 2**30


def job_plan(cfg, specs: List[TableSpec], env: DistEnv) -> Plan:
    """The plan file named by `parallel.plan`, checked against the model, or a fresh plan."""
    if cfg.parallel.plan:
        plan = load_plan(cfg.parallel.plan)
        check_plan(plan, cfg.parallel.plan, specs, env.world_size)
        return plan
    hosts = env.local_world_size if env.world_size > env.local_world_size else None
    return plan_tables(specs, env.world_size, memory_budget(cfg, env),
                       cfg.data.global_batch_size, cfg.parallel.strategy, hosts,
                       job_device(cfg, env), **search_rules(cfg))


def job_device(cfg, env: DistEnv) -> DeviceConstants:
    """The constants the job's plan models: `parallel.device`, or the GPU's kind (cpu_gloo on
    CPU); the first in DEVICES' order of any rank's, so that every rank makes the same plan."""
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
    kinds = list(DEVICES)
    mine = torch.tensor([kinds.index(device_kind(cfg.parallel.device, name))],
                        dtype=torch.int64, device=env.device)
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return device_constants(kinds[int(mine.item())], cfg.parallel.cost_model)


def memory_budget(cfg, env: DistEnv) -> int:
    """Table bytes each rank may hold: its memory (the config's, or the GPU's, or 8 GiB on CPU)
    less the reserve; the smallest over all ranks, so that every rank makes the same plan."""
    memory = parse_bytes(cfg.parallel.memory_per_rank, "parallel.memory_per_rank", allow_auto=True)
    if memory is None:
        memory = (torch.cuda.get_device_properties(env.device).total_memory
                  if env.device.type == "cuda" else CPU_DEFAULT_MEMORY)
    reserve = parse_bytes(cfg.parallel.reserve_per_rank, "parallel.reserve_per_rank")
    smallest = torch.tensor([memory - reserve], dtype=torch.int64, device=env.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())
