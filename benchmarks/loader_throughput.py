"""Input pipeline throughput against the trainer's: is the loader ever what training waits on?

    .venv/bin/python benchmarks/loader_throughput.py [--samples 10000000] [--data DIR] [--batches 3000]
        [--global-batch 1024] [--train-steps 1000]
    .venv/bin/python benchmarks/loader_throughput.py --synthetic configs/criteo_1tb_fl15.yaml \
        [--batches 30]

Writes (or reuses, with --data) a split-binary copy of the demo config's synthetic data, then in
one run measures samples/s per process of the torch and the DALI loader (training batches of
--global-batch, one rank) and of 1-process CPU training on the same files (none with
--train-steps 0), and prints the loader/training ratios. With --synthetic: the torch loader over
a config's planted synthetic data at its global batch, on this machine's GPU (made there) or
else on the host, as training reads it.
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

from dlrm_hybrid.bench.roofline import synchronize
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.source import make_loader, open_dataset

ROOT = Path(__file__).resolve().parents[1]


def loader_rate(data_cfg, batches: int, device: torch.device = torch.device("cpu")) -> float:
    env = SimpleNamespace(rank=0, world_size=1, device=device)
    dataset = open_dataset(data_cfg)
    loader = make_loader(data_cfg, dataset, "train", env)
    next(loader)  # start-up (DALI builds its pipeline) is not throughput
    synchronize(device)
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    synchronize(device)
    seconds = time.perf_counter() - start
    loader.close()
    return batches * data_cfg.global_batch_size / seconds


def synthetic_rates(config: str, batches: int) -> None:
    """The planted data of `config` through the torch loader on this machine's training device."""
    cfg = load_config(str(ROOT / config), [])
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    where = torch.cuda.get_device_name(0) if device.type == "cuda" else "the host"
    print(f"{config}: batch {cfg.data.global_batch_size}, made on {where}; cpu: {cpu_name()}, "
          f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}")
    rate = loader_rate(cfg.data, batches, device)
    print(f"torch loader, synthetic: {rate:,.0f} samples/s, "
          f"{cfg.data.global_batch_size / rate * 1e3:.2f} ms/batch")


def training_rate(data_dir: str, steps: int, batch: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "dlrm_hybrid", "train", "--config", "configs/demo.yaml",
               "--set", f"data.path={data_dir}", "--set", f"train.max_steps={steps}",
               "--set", f"data.global_batch_size={batch}",
               "--set", "train.eval_every=0", "--set", "train.progress_bar=false",
               "--set", f"train.run_dir={run_dir}"]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:  # its error line, not a CalledProcessError traceback that hides it
        sys.exit(f"train failed: {(out.stderr.strip().splitlines() or ['no output'])[-1]}")
    return float(out.stdout.strip().splitlines()[-1].rsplit("samples_per_s=", 1)[1])


def cpu_name() -> str:
    """The CPU's model name, as lscpu and /proc/cpuinfo give it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--data", help="an existing split-binary dataset to read instead")
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--train-steps", type=int, default=1000, help="0: no training run")
    parser.add_argument("--global-batch", type=int, default=1024,
                        help="the loaders' batch (the demo's 1024; FL15's is 65536)")
    parser.add_argument("--synthetic", metavar="CONFIG",
                        help="measure this config's planted synthetic data instead")
    args = parser.parse_args()
    if args.data:  # absolute: the training run starts in the checkout's root
        args.data = str(Path(args.data).resolve())
    if args.synthetic:
        synthetic_rates(args.synthetic, args.batches)
        return
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        f"data.train_samples={args.samples}", f"data.global_batch_size={args.global_batch}"])
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data
        if data_dir is None:
            from dlrm_hybrid.data.synth_dataset import write_synthetic

            data_dir = str(Path(tmp) / "data")
            start = time.perf_counter()
            write_synthetic(cfg.data, data_dir)
            print(f"wrote {args.samples:,} samples in {time.perf_counter() - start:.0f} s")
        cfg.data.path = data_dir
        train = training_rate(data_dir, args.train_steps, args.global_batch) if args.train_steps \
            else float("nan")
        print(f"batch {args.global_batch}; cpu: {cpu_name()}, {os.cpu_count()} cores, "
              f"torch threads {torch.get_num_threads()}")
        print(f"{'what':>22} {'samples/s':>12} {'vs training':>12}")
        if args.train_steps:
            print(f"{'training, 1 process':>22} {train:>12,.0f} {1.0:>12.2f}")
        for loader in ("torch", "dali"):
            cfg.data.loader = loader
            rate = loader_rate(cfg.data, args.batches)
            ratio = f"{rate / train:>12.2f}" if args.train_steps else f"{'-':>12}"
            print(f"{loader + ' loader':>22} {rate:>12,.0f} {ratio}")


if __name__ == "__main__":
    main()
