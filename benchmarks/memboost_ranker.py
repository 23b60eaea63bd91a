"""Memboost's statistics as features of the product's ranker (issue 62): the DLRM trained on a
ranking dataset of logged impressions (`preprocess impressions`) with the three Memboost
features, and on the same dataset with them zeroed; test AUC of both.

    .venv/bin/python benchmarks/memboost_ranker.py [--seeds 0,1,2] [--rounds 6] [--requests 10000]
        [--steps 1000] [--quick]

The world and the serving are benchmarks/memboost.py's (its docstring has every constant:
1,000 queries with Zipf(0.8) traffic, 2,000 items, a pair effect N(0, 0.8^2) on each query's
100 candidates that no feature shows, the position-based click model, K = 10): its `funnel`
policy (a logistic-regression ranker retrained on its log every round, 8% of requests in random
order) serves --rounds rounds of --requests requests, and every round's impressions go to one
impression log (time = the round). `preprocess impressions` makes the dataset (the last 10% of
requests test, the 10% before validation; each row's features from the rounds before its own),
and `train` (1 rank, --steps steps, configs below) trains the DLRM on it twice: as written, and
with numerical.bin zeroed in every split (the same rows, ids and labels). `predict --split
test` gives each model's test AUC. Printed last:

    memboost_ranker: auc_with=X auc_without=X gain=X rows=N
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from memboost import Policy, cpu_name, draw_world, serve  # noqa: E402

from dlrm_hybrid.data.feature_spec import load_feature_spec  # noqa: E402
from dlrm_hybrid.serve.impressions import concat, write_impressions  # noqa: E402

CONFIG = """
model: {{embedding_dim: 16, bottom_mlp: [32, 16], top_mlp: [64, 32, 1]}}
data: {{global_batch_size: 512, shuffle: true}}
optim: {{embedding: rowwise_adagrad, embedding_lr: 0.05, dense: adagrad, dense_lr: 0.02}}
train: {{max_steps: {steps}, log_every: {steps}, eval_every: 0, progress_bar: false}}
checkpoint: {{resume: none}}
"""


def cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dlrm_hybrid", *args], cwd=ROOT,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def logged_world(seed: int, args, path: Path) -> None:
    """--rounds of the funnel policy serving one world, as one impression log at `path`."""
    world = draw_world(seed, args.queries, args.items)
    policy = Policy(world, 0.0, True, 1.0)
    rng = np.random.default_rng(seed + 10_000)
    logs = []
    for r in range(args.rounds):
        queries = rng.choice(len(world.traffic), args.requests, p=world.traffic)
        shuffled = rng.random(args.requests) < args.random_share
        uniform = rng.random((args.requests, 10))
        log, slot = serve(world, policy.order(r == 0), queries, shuffled,
                          np.random.default_rng(int(rng.integers(1 << 31))), uniform, r)
        policy.learn(log, slot)
        logs.append(log)
    write_impressions(str(path), concat(logs))


def zeroed(data: Path, out: Path) -> None:
    """A copy of the dataset with every split's dense features 0."""
    shutil.copytree(data, out)
    for files in load_feature_spec(str(out)).splits.values():
        size = files.numerical.stat().st_size
        files.numerical.write_bytes(bytes(size))


def test_auc(data: Path, work: Path, name: str, steps: int) -> float:
    (work / f"{name}.yaml").write_text(CONFIG.format(steps=steps))
    cli("train", "--config", str(work / f"{name}.yaml"), "--set", f"data.path={data}",
        "--set", f"train.run_dir={work / name}")
    cli("export", "--checkpoint", str(work / name / "checkpoints" / f"step_{steps}"), "--out",
        str(work / f"{name}.pt"))
    out = cli("predict", "--model", str(work / f"{name}.pt"), "--data", str(data), "--split",
              "test", "--out", str(work / f"{name}.csv"))
    return float(out.split(" auc=")[1].split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=10_000, help="requests per round")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--random-share", type=float, default=0.08)
    parser.add_argument("--steps", type=int, default=1000, help="training steps of each model")
    parser.add_argument("--quick", action="store_true", help="a small run that checks it works")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.queries, args.items, args.steps = 2, 1000, 100, 400, 40
    print(f"memboost_ranker on {cpu_name()}: rounds={args.rounds} requests={args.requests} "
          f"queries={args.queries} items={args.items} random_share={args.random_share} "
          f"steps={args.steps}", flush=True)
    found = []
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            t = time.time()
            logged_world(seed, args, work / "log.tsv")
            simulated = time.time() - t
            made = cli("preprocess", "impressions", "--impressions", str(work / "log.tsv"),
                       "--output", str(work / "data"))
            prepared = time.time() - t - simulated
            zeroed(work / "data", work / "zero")
            rows = int(made.split("done: rows=")[1].split()[0])
            with_mb = test_auc(work / "data", work, "with", args.steps)
            without = test_auc(work / "zero", work, "without", args.steps)
            found.append((with_mb, without, rows))
            print(f"seed {seed}: rows={rows} auc_with={with_mb:.4f} auc_without={without:.4f} "
                  f"gain={with_mb - without:+.4f} (simulated {simulated:.0f} s, preprocess "
                  f"{prepared:.0f} s, total {time.time() - t:.0f} s)", flush=True)
            print(made.strip().splitlines()[-1], flush=True)
    mean = np.mean(found, 0)
    print(f"memboost_ranker: auc_with={mean[0]:.4f} auc_without={mean[1]:.4f} "
          f"gain={mean[0] - mean[1]:+.4f} rows={int(mean[2])}")


if __name__ == "__main__":
    main()
