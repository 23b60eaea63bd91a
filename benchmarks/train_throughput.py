"""Training throughput of a config on 1..N gloo/NCCL ranks under torchrun, in one run.

    .venv/bin/python benchmarks/train_throughput.py [--config configs/demo.yaml] [--ranks 1 2] [--steps 1000]

Prints samples/s per world size (training steps only, as the `done:` line counts them) and the
ratio to the 1-rank run measured in the same invocation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def samples_per_s(config: str, nproc: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"train.max_steps={steps}", "train.eval_every=0", "data.val_samples=4096",
                     "train.progress_bar=false", f"train.run_dir={run_dir}"]
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
               f"--nproc_per_node={nproc}", "-m", "dlrm_hybrid", "train", "--config", config,
               *[arg for o in overrides for arg in ("--set", o)]]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    done = out.stdout.strip().splitlines()[-1]
    return float(done.rsplit("samples_per_s=", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    results = {n: samples_per_s(args.config, n, args.steps) for n in args.ranks}
    base = results[args.ranks[0]]
    print(f"{'ranks':>5} {'samples/s':>12} {'vs ' + str(args.ranks[0]) + ' rank(s)':>14}")
    for n, rate in results.items():
        print(f"{n:>5} {rate:>12,.0f} {rate / base:>14.2f}")


if __name__ == "__main__":
    main()
