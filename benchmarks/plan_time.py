"""Planning time at scale: how much longer 10,000 and 20,000 tables take to place on 1,024 ranks
than the 26 tables of Criteo 1TB (the figure the placer is held to: under 2 s more).

    .venv/bin/python benchmarks/plan_time.py [--tables 10000,20000] [--ranks 1024]
                                             [--gpus-per-node 8] [--repeat 3]

The 26 tables are Criteo 1TB's at frequency threshold 15 (dim 128); the many are log-uniform from
10 to 10^7 rows (dim 64, 1 to 10 ids per lookup); all row-wise Adagrad, 78 GiB for tables per
rank, global batch 65,536, both strategies, on the same ranks, modeled for an H100. Prints the
best of `--repeat` runs in seconds, the difference to the 26-table plan, shard and replicated
table counts, the modeled max step (ms) and the all-to-all MiB all ranks send; takes ~15 s.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dlrm_hybrid.parallel.cost_model import a2a_bytes
from dlrm_hybrid.parallel.greedy_search import STRATEGIES, plan_tables
from dlrm_hybrid.parallel.tables import TableSpec

CRITEO_1TB_FL15 = [7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828,
                   11, 2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97,
                   35]


def many_tables(count: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = (10 ** rng.uniform(1, 7, count)).astype(int)
    hotness = rng.integers(1, 11, count)
    return [TableSpec(f"t{i}", int(r), 64, "fp32", "rowwise_adagrad", float(h))
            for i, (r, h) in enumerate(zip(rows, hotness))]


def timed_plan(tables, args, strategy):
    """The plan and the best of `args.repeat` times to make it, in seconds."""
    seconds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        plan = plan_tables(tables, args.ranks, 78 * 2**30, 65536, strategy, args.gpus_per_node)
        seconds.append(time.perf_counter() - start)
    return plan, min(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", default="10000,20000", help="comma-separated table counts")
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="runs per plan; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    criteo = [TableSpec(f"cat_{i}", rows, 128, "fp32", "rowwise_adagrad")
              for i, rows in enumerate(CRITEO_1TB_FL15)]
    cases = [("26 (FL15)", criteo)]
    cases += [(f"{n:,}", many_tables(n, args.seed)) for n in map(int, args.tables.split(","))]
    print(f"{args.ranks} ranks ({args.gpus_per_node} per host), 78 GiB for tables per rank, "
          f"best of {args.repeat} runs")
    print(f"{'tables':>10} {'strategy':>8} {'seconds':>8} {'over 26':>8} {'shards':>7} "
          f"{'replic.':>7} {'max ms':>8} {'a2a MiB':>9}")
    criteo_seconds = {}
    for label, tables in cases:
        for strategy in STRATEGIES:
            plan, seconds = timed_plan(tables, args, strategy)
            first = criteo_seconds.setdefault(strategy, seconds)  # the 26 tables come first
            over = " " * 8 if tables is criteo else f"{seconds - first:+8.2f}"
            sent = sum(part.sum() for part in a2a_bytes(plan)) / 2**20
            print(f"{label:>10} {strategy:>8} {seconds:>8.2f} {over} {len(plan.shards):>7} "
                  f"{len(plan.replicated):>7} {1e3 * plan.step_time().max_s:>8.3f} {sent:>9.1f}")


if __name__ == "__main__":
    main()
