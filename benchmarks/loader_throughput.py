"""Input pipeline throughput against the trainer's: is the loader ever what training waits on?

    .venv/bin/python benchmarks/loader_throughput.py [--samples 10000000] [--data DIR] [--batches 3000]

Writes (or reuses, with --data) a split-binary copy of the demo config's synthetic data, then in
one run measures samples/s per process of the torch and the DALI loader (training batches of the
demo's global batch, one rank) and of 1-process CPU training on the same files, and prints the
loader/training ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dlrm_hybrid.config import load_config
from dlrm_hybrid.data.source import make_loader, open_dataset

ROOT = Path(__file__).resolve().parents[1]


def loader_rate(data_cfg, batches: int) -> float:
    env = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    dataset = open_dataset(data_cfg)
    loader = make_loader(data_cfg, dataset, "train", env)
    next(loader)  # start-up (DALI builds its pipeline) is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    seconds = time.perf_counter() - start
    loader.close()
    return batches * data_cfg.global_batch_size / seconds


def training_rate(data_dir: str, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "dlrm_hybrid", "train", "--config", "configs/demo.yaml",
               "--set", f"data.path={data_dir}", "--set", f"train.max_steps={steps}",
               "--set", "train.eval_every=0", "--set", "train.progress_bar=false",
               "--set", f"train.run_dir={run_dir}"]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1].rsplit("samples_per_s=", 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--data", help="an existing split-binary dataset to read instead")
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--train-steps", type=int, default=1000)
    args = parser.parse_args()
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [f"data.train_samples={args.samples}"])
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data
        if data_dir is None:
            from dlrm_hybrid.data.synth_dataset import write_synthetic

            data_dir = str(Path(tmp) / "data")
            start = time.perf_counter()
            write_synthetic(cfg.data, data_dir)
            print(f"wrote {args.samples:,} samples in {time.perf_counter() - start:.0f} s")
        cfg.data.path = data_dir
        train = training_rate(data_dir, args.train_steps)
        print(f"{'what':>22} {'samples/s':>12} {'vs training':>12}")
        print(f"{'training, 1 process':>22} {train:>12,.0f} {1.0:>12.2f}")
        for loader in ("torch", "dali"):
            cfg.data.loader = loader
            rate = loader_rate(cfg.data, args.batches)
            print(f"{loader + ' loader':>22} {rate:>12,.0f} {rate / train:>12.2f}")


if __name__ == "__main__":
    main()
