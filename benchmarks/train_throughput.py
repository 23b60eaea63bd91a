"""Training throughput of a config on 1..N gloo/NCCL ranks under torchrun, in one run; with
--threads, one process's throughput under each thread setting, on this host as it is and with
one core kept busy by a process this script starts.

    .venv/bin/python benchmarks/train_throughput.py [--config configs/demo.yaml] [--ranks 1 2] [--steps 1000]
    .venv/bin/python benchmarks/train_throughput.py --threads [--data DIR] [--samples 400000] \
        [--global-batch 256] [--steps 200] [--repeats 3] [--in-memory]

Prints the CPU, then samples/s per world size (training steps only, as the `done:` line counts
them) and the ratio to the 1-rank run measured in the same invocation. With --threads: writes
(or reuses, with --data) the demo config's synthetic data as split-binary files (--in-memory:
the planted data, no files) and trains one process on it with OMP_NUM_THREADS unset (the
product's default, dlrm_hybrid/threads.py), with torch's own default (what an unset
OMP_NUM_THREADS gave before) and with 1, each with the host idle and with a busy core; the
rounds alternate, and the load average before each run is printed, as the host may be shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
THREAD_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def samples_per_s(config: str, nproc: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"train.max_steps={steps}", "train.eval_every=0", "data.val_samples=4096",
                     "train.progress_bar=false", f"train.run_dir={run_dir}"]
        cmd = [sys.executable, "-m", "dlrm_hybrid.torchrun", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "dlrm_hybrid", "train", "--config", config,
               *[arg for o in overrides for arg in ("--set", o)]]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return done_rate(out)


def done_rate(run: subprocess.CompletedProcess) -> float:
    """The samples/s of a `train` run's `done:` line; where it failed, its error line as ours."""
    if run.returncode:
        sys.exit(f"train failed: {(run.stderr.strip().splitlines() or ['no output'])[-1]}")
    done = run.stdout.strip().splitlines()[-1]
    return float(done.rsplit("samples_per_s=", 1)[1])


def one_process_rate(data_dir: Optional[str], batch: int, steps: int,
                     threads: Optional[int]) -> float:
    """samples/s of one `train` process; `threads` None: OMP_NUM_THREADS unset."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_KEYS}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [f"train.max_steps={steps}", "train.eval_every=0", "data.val_samples=4096",
                     "train.progress_bar=false", f"train.run_dir={run_dir}",
                     f"data.global_batch_size={batch}", "checkpoint.every=0"]
        if data_dir:
            overrides.append(f"data.path={data_dir}")
        cmd = [sys.executable, "-m", "dlrm_hybrid", "train", "--config", "configs/demo.yaml",
               *[arg for o in overrides for arg in ("--set", o)]]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return done_rate(out)


def torch_default_threads() -> int:
    """The intra-op threads torch itself picks with no setting."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_KEYS}
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                         env=env, capture_output=True, text=True, check=True)
    return int(out.stdout)


def busy_core() -> subprocess.Popen:
    """Another process that keeps one core busy (`yes > /dev/null`)."""
    return subprocess.Popen(["yes"], stdout=subprocess.DEVNULL)


def thread_rates(args) -> None:
    from dlrm_hybrid.threads import default_threads
    from dlrm_hybrid.train.precision import cpu_description

    ours, torchs = default_threads(), torch_default_threads()
    settings: Dict[str, Optional[int]] = {f"unset (now {ours})": None,
                                          f"torch's default ({torchs})": torchs}
    if ours != 1:
        settings["1"] = 1
    print(f"cpu: {cpu_description()}; {os.cpu_count()} cpus; one process, batch "
          f"{args.global_batch}, {args.steps} steps, "
          f"{'in-memory synthetic data' if args.in_memory else 'split-binary files'}; "
          f"{args.repeats} rounds", flush=True)
    rates: Dict[str, Dict[str, List[float]]] = {h: {s: [] for s in settings}
                                                for h in ("idle", "busy core")}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = None if args.in_memory else (args.data or write_data(tmp, args.samples))
        for round_ in range(args.repeats):
            for host in rates:
                load = busy_core() if host == "busy core" else None
                try:
                    for name, threads in settings.items():
                        before = os.getloadavg()[0]
                        rate = one_process_rate(data_dir, args.global_batch, args.steps, threads)
                        rates[host][name].append(rate)
                        print(f"round {round_ + 1} {host:>9} OMP_NUM_THREADS {name:>20}: "
                              f"{rate:>9,.0f} samples/s (load average {before:.1f})", flush=True)
                finally:
                    if load is not None:
                        load.kill()
                        load.wait()
    print_thread_table(rates, next(iter(settings)))


def write_data(tmp: str, samples: int) -> str:
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synth_dataset import write_synthetic

    cfg = load_config(str(ROOT / "configs/demo.yaml"), [f"data.train_samples={samples}"])
    path = str(Path(tmp) / "data")
    write_synthetic(cfg.data, path)
    return path


def print_thread_table(rates: Dict[str, Dict[str, List[float]]], ours: str) -> None:
    """Median samples/s (and range) per host state and setting, and each against the default."""
    print(f"{'host':>9} {'OMP_NUM_THREADS':>20} {'median':>9} {'range':>20} {'default/this':>12}")
    for host, per_setting in rates.items():
        base = statistics.median(per_setting[ours])
        for name, values in per_setting.items():
            median = statistics.median(values)
            span = f"{min(values):,.0f}-{max(values):,.0f}"
            print(f"{host:>9} {name:>20} {median:>9,.0f} {span:>20} {base / median:>11.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per run (default 1000; --threads: 200)")
    parser.add_argument("--threads", action="store_true",
                        help="one process, OMP_NUM_THREADS unset / torch's default / 1, idle and "
                             "with a busy core")
    parser.add_argument("--data", help="--threads: an existing split-binary dataset to read")
    parser.add_argument("--samples", type=int, default=400_000,
                        help="--threads: training samples of the data written")
    parser.add_argument("--global-batch", type=int, default=256, help="--threads: the batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--in-memory", action="store_true",
                        help="--threads: the planted data made in the loader, no files")
    args = parser.parse_args()
    # a path that exists from here, absolute: the runs start in the checkout's root
    args.config, args.data = (str(Path(p).resolve()) if p and Path(p).exists() else p
                              for p in (args.config, args.data))
    if args.threads:
        args.steps = args.steps or 200
        thread_rates(args)
        return
    steps = args.steps or 1000
    from dlrm_hybrid.train.precision import cpu_description

    print(f"cpu: {cpu_description()}; {os.cpu_count()} cpus; {args.config}, {steps} steps",
          flush=True)
    results = {n: samples_per_s(args.config, n, steps) for n in args.ranks}
    base = results[args.ranks[0]]
    print(f"{'ranks':>5} {'samples/s':>12} {'vs ' + str(args.ranks[0]) + ' rank(s)':>14}")
    for n, rate in results.items():
        print(f"{n:>5} {rate:>12,.0f} {rate / base:>14.2f}")


if __name__ == "__main__":
    main()
