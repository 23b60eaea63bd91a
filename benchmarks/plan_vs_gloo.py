"""The cost model against real runs: plans of one model, each trained for a few steps on gloo CPU
ranks, their measured step times beside the modeled ones (the "cpu_gloo" constants):

    .venv/bin/python benchmarks/plan_vs_gloo.py [--ranks 2,4] [--steps 40]

The model is configs/demo.yaml with larger tables (1.9M rows of 64 columns, 8 ids per lookup,
global batch 4,096), so that where the tables sit matters on 2 cores, and uniform ids
(`data.zipf_exponent=0`): every lookup goes to memory, as the model (and gloo_constants.py's
bandwidth) assumes; with click-log skew (1.1) the hot rows stay in cache and lookups cost less
than modeled. Its plans:

- greedy: the placer's plan (`plan_tables`, the default strategy) for the cpu_gloo constants;
- one rank: every table whole on rank 0 (it does all lookups and serves every all-to-all);
- replicated: greedy's, with every table of at most 50,000 rows held by every rank (torchrec
  data_parallel).

Each is written with `save_plan` and trained `--repeat` times (the plans in turn) with
`python -m dlrm_hybrid.torchrun ... train --set parallel.plan=FILE`; the measured step time is
the fastest of metrics.jsonl's windows of 5 steps after each run's first (other processes on the
machine only ever add time). The model leaves out the dense MLPs, alike in every plan, so the
measured time is higher by about a constant: what must agree is the order of the plans and
their differences. Takes ~16 s per run on 2 cores (95 s for the default 6).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.configured_spec import data_spec
from dlrm_hybrid.parallel.cost_model import DEVICES, step_time
from dlrm_hybrid.parallel.greedy_search import plan_tables
from dlrm_hybrid.parallel.plan import Plan, Shard
from dlrm_hybrid.parallel.plan_file import save_plan
from dlrm_hybrid.parallel.tables import table_specs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/demo.yaml"
MODEL = ["data.cardinalities=[1000000, 500000, 250000, 100000, 50000, 20000, 1000, 100]",
         "data.hotness=[8]", "data.zipf_exponent=0", "model.embedding_dim=64", "model.bottom_mlp=[64, 64]",
         "data.global_batch_size=4096", "data.val_samples=4096", "train.log_every=5",
         "train.eval_every=0", "train.progress_bar=false", "train.tensorboard=false",
         "checkpoint.resume=none"]
REPLICATED_ROWS = 50_000
BUDGET = 6 * 2**30  # CPU memory_per_rank (8 GiB) less reserve_per_rank (2 GiB)
PARTS = ("lookup_s", "a2a_intra_s", "fixed_s", "allreduce_s")


def plans(ranks: int) -> Dict[str, Plan]:
    cfg = load_config(str(ROOT / CONFIG), MODEL, world_size=ranks)
    tables = table_specs(cfg, data_spec(cfg.data))
    batch = cfg.data.global_batch_size
    greedy = plan_tables(tables, ranks, BUDGET, batch, gpus_per_node=ranks,
                         device=DEVICES["cpu_gloo"])
    by_name = {t.name: t for t in tables}
    one_rank = Plan(ranks, "one rank", BUDGET, batch, by_name,
                    [Shard(t.name, 0, 0, t.dim) for t in tables], ranks)
    small = frozenset(t.name for t in tables if t.rows <= REPLICATED_ROWS)
    replicated = Plan(ranks, "replicated", BUDGET, batch, by_name,
                      [s for s in greedy.shards if s.table not in small], ranks,
                      greedy.replicated | small)
    return {"greedy": greedy, "one rank": one_rank, "replicated": replicated}


def window_step_s(plan: Plan, ranks: int, steps: int, folder: Path, run: int) -> List[float]:
    """Seconds per step of each metrics.jsonl window after the first of a real run of `plan`;
    none (its error printed) if it fails."""
    plan_path = folder / f"{plan.strategy.replace(' ', '_')}_{ranks}.json"
    save_plan(plan, plan_path)
    run_dir = folder / f"{plan_path.stem}_{run}"
    command = [sys.executable, "-m", "dlrm_hybrid.torchrun", "--standalone",
               f"--nproc_per_node={ranks}", "-m", "dlrm_hybrid", "train", "--config", CONFIG,
               *[a for item in MODEL for a in ("--set", item)],
               "--set", f"train.max_steps={steps}", "--set", f"train.run_dir={run_dir}",
               "--set", f"parallel.plan={plan_path}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"  {plan.strategy} on {ranks} ranks did not run: "
              f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
        return []
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r and "loss" in r]
    return [plan.batch_size / rate for rate in rates[1:]]


def order_line(ranks: int, rows: List[Tuple[str, float, float]]) -> str:
    """The plans fastest first as modeled and as measured, and whether the orders agree."""
    modeled = [name for name, _, _ in sorted(rows, key=lambda r: r[1])]
    measured = [name for name, _, _ in sorted(rows, key=lambda r: r[2])]
    same = "the same order" if modeled == measured else "a DIFFERENT order"
    return (f"{ranks} ranks, fastest first: modeled {', '.join(modeled)}; measured "
            f"{', '.join(measured)}: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2", help="comma-separated gloo rank counts")
    parser.add_argument("--steps", type=int, default=40, help="training steps per run")
    parser.add_argument("--repeat", type=int, default=2, help="runs per plan")
    args = parser.parse_args()
    device = DEVICES["cpu_gloo"]
    print(f"cpu_gloo: memory {device.memory_bandwidth:.3g} B/s, all-to-all "
          f"{device.intra_host_bandwidth:.3g} B/s, {device.shard_fixed_s * 1e6:.0f} us per shard, "
          f"{device.message_fixed_s * 1e6:.0f} us per message ({device.source})\n")
    print("| ranks | plan | shards | replicated | modeled max ms | lookup | a2a | fixed | "
          "all-reduce | measured ms | measured - modeled |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in map(int, args.ranks.split(",")):
            made = plans(ranks)
            windows: Dict[str, List[float]] = {name: [] for name in made}
            for run in range(args.repeat):
                for name, plan in made.items():
                    windows[name] += window_step_s(plan, ranks, args.steps, Path(tmp), run)
            rows = []
            for name, plan in made.items():
                modeled = step_time(plan, device)
                slowest = int(modeled.total_s.argmax())
                parts = " | ".join(f"{getattr(modeled, p)[slowest] * 1e3:.1f}" for p in PARTS)
                real = min(windows[name], default=None)
                shown = "not run | " if real is None else \
                    f"{real * 1e3:.1f} | {(real - modeled.max_s) * 1e3:+.1f}"
                print(f"| {ranks} | {name} | {len(plan.shards)} | {len(plan.replicated)} | "
                      f"{modeled.max_s * 1e3:.1f} | {parts} | {shown} |")
                if real is not None:
                    rows.append((name, modeled.max_s, real))
            summary.append(order_line(ranks, rows))
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
