"""Planning time at scale: 10,000 tables on 1,024 ranks (both strategies), in one run.

    .venv/bin/python benchmarks/plan_time.py [--tables 10000] [--ranks 1024] [--gpus-per-node 8]

Table sizes are log-uniform from 10 to 10^7 rows (dim 64, row-wise Adagrad, 1 to 10 ids per
lookup), 80 GiB per rank. Prints seconds per plan, shard counts and the imbalances.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dlrm_hybrid.parallel.placement import STRATEGIES, plan_tables
from dlrm_hybrid.parallel.tables import TableSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = (10 ** rng.uniform(1, 7, args.tables)).astype(int)
    hotness = rng.integers(1, 11, args.tables)
    tables = [TableSpec(f"t{i}", int(r), 64, "fp32", "rowwise_adagrad", float(h))
              for i, (r, h) in enumerate(zip(rows, hotness))]
    print(f"{args.tables} tables ({rows.sum():,} rows) on {args.ranks} ranks "
          f"({args.gpus_per_node} per host), 78 GiB for tables per rank")
    print(f"{'strategy':>8} {'seconds':>8} {'shards':>7} {'memory':>7} {'a2a':>6} {'lookup':>7}")
    for strategy in STRATEGIES:
        start = time.perf_counter()
        plan = plan_tables(tables, args.ranks, 78 * 2**30, 65536, strategy, args.gpus_per_node)
        seconds = time.perf_counter() - start
        i = plan.imbalance()
        print(f"{strategy:>8} {seconds:>8.2f} {len(plan.shards):>7} {i['memory']:>7.3f} "
              f"{i['a2a']:>6.3f} {i['lookup']:>7.3f}")


if __name__ == "__main__":
    main()
