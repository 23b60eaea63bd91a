"""Plan quality side by side: our `greedy`, `nvidia`, and torchrec's own EmbeddingShardingPlanner
(benchmarks/torchrec_planner.py) on the same tables, ranks and budget, scored by one cost model
(dlrm_hybrid/parallel/cost_model.py):

    .venv/bin/python benchmarks/plan_quality.py [--cases mlperf_dcnv2,criteo_1tb_fl15,fl15_qr,synthetic_10000]
        [--ranks 8,64,1024] [--gpus-per-node 8] [--device h100] [--gpu-memory 80GiB]
        [--torchrec-timeout 120] [--quick]

Cases: the configs' models (fl15_qr: criteo_1tb_fl15 with quotient-remainder tables above 1M
rows, c = 4, `mult`, as docs/compositional.md shows), and N log-uniform tables as
benchmarks/plan_time.py makes them (synthetic_N: 78 GiB per rank, global batch 65,536). Per
cell: the modeled step time of the slowest rank and its largest part, all-to-all bytes per step
(the largest rank's, all ranks', those crossing hosts), memory max/mean, shards, replicated
tables and planning time; then per case and rank count, whether greedy has the lowest modeled
max and sends no more bytes in all than nvidia. The dense MLPs are alike in every plan and not
modeled. torchrec's planner is given `--torchrec-timeout` seconds a cell (it is slow at scale).
`--quick`: configs/demo.yaml at 8 ranks, for the tests. The default run takes ~8.5 minutes on 2
cores, 6 of them torchrec's planner giving up on the 10,000 tables.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from plan_time import many_tables
from torchrec_planner import Bandwidths, plan_in_subprocess

from dlrm_hybrid.config import parse_bytes

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.configured_spec import data_spec
from dlrm_hybrid.parallel.cost_model import DEVICES, DeviceConstants, a2a_bytes, step_time
from dlrm_hybrid.parallel.greedy_search import STRATEGIES, plan_tables
from dlrm_hybrid.parallel.plan import Plan, PlacementError, format_bytes
from dlrm_hybrid.parallel.tables import TableSpec, table_specs

QR_FL15 = ("model.compositional=[{technique: qr, rows_above: 1000000, collisions: 4, "
           "operation: mult}]")
CONFIGS = {"mlperf_dcnv2": ("configs/mlperf_dcnv2.yaml", []),
           "criteo_1tb_fl15": ("configs/criteo_1tb_fl15.yaml", []),
           "fl15_qr": ("configs/criteo_1tb_fl15.yaml", [QR_FL15]),
           "demo": ("configs/demo.yaml", [])}
PARTS = ("lookup_s", "a2a_intra_s", "a2a_inter_s", "fixed_s", "allreduce_s")
PLANNERS = (*STRATEGIES, "torchrec")


@dataclass
class Case:
    """One placement problem: the tables, the per-rank budget and the global batch."""
    name: str
    tables: List[TableSpec]
    budget_bytes: int
    batch_size: int


@dataclass
class Cell:
    planner: str
    plan: Optional[Plan]
    seconds: float
    failure: str = ""


def load_case(name: str, ranks: int, gpu_memory: int) -> Case:
    if name.startswith("synthetic_"):
        return Case(name, many_tables(int(name.split("_")[1]), 0), 78 * 2**30, 65536)
    path, overrides = CONFIGS[name]
    cfg = load_config(path, overrides, world_size=ranks)
    budget = gpu_memory - parse_bytes(cfg.parallel.reserve_per_rank, "parallel.reserve_per_rank")
    return Case(name, table_specs(cfg, data_spec(cfg.data)), budget, cfg.data.global_batch_size)


def plan_cell(case: Case, planner: str, ranks: int, per_host: int, device: DeviceConstants,
              timeout_s: float) -> Cell:
    if planner == "torchrec":
        bandwidths = Bandwidths(device.memory_bandwidth, device.intra_host_bandwidth,
                                device.inter_host_bandwidth)
        result = plan_in_subprocess(case.tables, ranks, case.budget_bytes, case.batch_size,
                                    bandwidths, per_host, timeout_s=timeout_s)
        return Cell(planner, result.plan, result.seconds, result.failure)
    start = time.perf_counter()
    try:
        plan = plan_tables(case.tables, ranks, case.budget_bytes, case.batch_size, planner, per_host,
                           device)
    except PlacementError as e:
        return Cell(planner, None, time.perf_counter() - start,  # its end: how many ranks would do
                    f"failed: {str(e).split('; ')[-1]}")
    return Cell(planner, plan, time.perf_counter() - start)


@dataclass
class Score:
    max_s: float
    largest_part: str
    a2a_max: float
    a2a_total: float
    a2a_inter: float


def score(plan: Plan, device: DeviceConstants) -> Score:
    """The modeled slowest rank and the all-to-all bytes each rank sends per step."""
    modeled = step_time(plan, device)
    slowest = int(modeled.total_s.argmax())
    part = max(PARTS, key=lambda p: getattr(modeled, p)[slowest])
    intra, inter = a2a_bytes(plan)
    sent = intra + inter
    return Score(float(modeled.max_s), part[:-2], float(sent.max()), float(sent.sum()),
                 float(inter.sum()))


def row(case: Case, ranks: int, cell: Cell, device: DeviceConstants) -> str:
    head = f"| {case.name} | {ranks:,} | {cell.planner} |"
    if cell.plan is None:
        return f"{head} {cell.failure} | | | | | | | | {cell.seconds:.2f} |"
    s = score(cell.plan, device)
    return (f"{head} {s.max_s * 1e3:.2f} | {s.largest_part} | {format_bytes(s.a2a_max)} | "
            f"{format_bytes(s.a2a_total)} | {format_bytes(s.a2a_inter)} | "
            f"{cell.plan.imbalance()['memory']:.2f} | {len(cell.plan.shards):,} | "
            f"{len(cell.plan.replicated)} | {cell.seconds:.2f} |")


def verdict(case: Case, ranks: int, cells: Sequence[Cell], device: DeviceConstants) -> str:
    """Whether greedy has the lowest modeled max of the planners that made a plan, and sends no
    more bytes in all than nvidia."""
    scored = {c.planner: score(c.plan, device) for c in cells if c.plan is not None}
    if "greedy" not in scored:
        return f"| {case.name} | {ranks:,} | no greedy plan | | |"
    best = min(scored, key=lambda p: (scored[p].max_s, p != "greedy"))
    lowest = "yes" if best == "greedy" else f"no: {best} {scored[best].max_s * 1e3:.2f} ms"
    fewer = ("no nvidia plan" if "nvidia" not in scored else
             "yes" if scored["greedy"].a2a_total <= scored["nvidia"].a2a_total else
             f"no: {scored['greedy'].a2a_total / scored['nvidia'].a2a_total:.2f}x")
    return f"| {case.name} | {ranks:,} | {scored['greedy'].max_s * 1e3:.2f} | {lowest} | {fewer} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="mlperf_dcnv2,criteo_1tb_fl15,fl15_qr,synthetic_10000",
                        help=f"comma-separated: {', '.join(CONFIGS)}, synthetic_N")
    parser.add_argument("--ranks", default="8,64,1024", help="comma-separated rank counts")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--device", choices=sorted(DEVICES), default="h100")
    parser.add_argument("--gpu-memory", default="80GiB", help="per rank, less the config's reserve")
    parser.add_argument("--torchrec-timeout", type=float, default=120.0,
                        help="seconds torchrec's planner gets per cell")
    parser.add_argument("--quick", action="store_true", help="configs/demo.yaml at 8 ranks")
    args = parser.parse_args()
    if args.quick:
        args.cases, args.ranks = "demo", "8"
    device = DEVICES[args.device]
    memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    print(f"device {device.name} ({device.source}); {args.gpus_per_node} ranks per host; "
          f"torchrec: table_wise, column_wise (one width: 32 columns), data_parallel\n")
    print("| case | ranks | planner | modeled max ms | largest part | a2a max/rank | a2a total | "
          "a2a inter-host | memory max/mean | shards | replicated | plan s |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for name in args.cases.split(","):
        for ranks in map(int, args.ranks.split(",")):
            case = load_case(name, ranks, memory)
            per_host = min(args.gpus_per_node, ranks)
            cells = [plan_cell(case, p, ranks, per_host, device, args.torchrec_timeout)
                     for p in PLANNERS]
            for cell in cells:
                print(row(case, ranks, cell, device), flush=True)
            verdicts.append(verdict(case, ranks, cells, device))
    print("\n| case | ranks | greedy modeled max ms | greedy lowest | greedy total a2a <= nvidia |")
    print("|---|---:|---:|---|---|")
    print("\n".join(verdicts))


if __name__ == "__main__":
    main()
