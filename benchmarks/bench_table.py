"""The benchmark table of benchmarks/README.md: `python -m dlrm_hybrid bench` once per precision setting.

    .venv/bin/python benchmarks/bench_table.py [--config configs/bench_cpu.yaml] [--steps 60]
        [--settings fp32 bf16] [--repeat 3] [--emulate-avx2]
        # on a GPU e.g.: --settings fp32 tf32 bf16 bf16+graphs bf16+graphs+nopipeline

Each run is a fresh process (the same as a user's run) and reports its own reference baseline
measured in that process. With --repeat, each figure is the median of the runs and the ratio
shows its range. A setting whose precision this CPU would emulate runs in fp32 (bench falls
back and says so): the `ran` column shows it. --emulate-avx2 runs bench as on an AVX2-only CPU
(oneDNN and ATen limited to AVX2). Prints the CPU capability, then a markdown table.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


class BenchFailed(Exception):
    """A bench run that exited non-zero: the command and its last stderr line."""


def setting_overrides(setting: str) -> List[str]:
    """`bf16+graphs+nopipeline` -> the `--set` values: the precision, then `graphs` (CUDA Graphs),
    `pipeline` / `nopipeline` (train.pipeline enabled / disabled; absent: the config's own)."""
    precision, *flags = setting.split("+")
    unknown = set(flags) - {"graphs", "pipeline", "nopipeline"}
    if unknown:
        raise ValueError(f"setting {setting!r}: unknown part(s) {sorted(unknown)}; "
                         f"use PRECISION[+graphs][+pipeline|+nopipeline]")
    sets = [f"train.precision={precision}",
            f"train.cuda_graphs={'true' if 'graphs' in flags else 'false'}"]
    if "pipeline" in flags or "nopipeline" in flags:
        sets.append(f"train.pipeline={'enabled' if 'pipeline' in flags else 'disabled'}")
    return sets


def bench_line(config: str, setting: str, steps: int, emulate_avx2: bool = False,
               extra: List[str] = (), timeout: float | None = None,
               peers: List[str] = ("reference",)) -> Dict[str, str]:
    """One bench run's last-line fields, plus `dense_share`: the dense part's share of the step
    in its profile. `extra`: further `--set` overrides; `peers`: bench's --peers."""
    cmd = [sys.executable, "-m", "dlrm_hybrid", "bench", "--config", config, "--steps", str(steps),
           "--peers", *peers,
           *[a for o in [*setting_overrides(setting), *extra] for a in ("--set", o)]]
    env = {**os.environ, **(AVX2_ONLY if emulate_avx2 else {})}
    try:
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchFailed(f"{' '.join(cmd[1:])}: still running after {timeout:.0f} s")
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchFailed(f"{' '.join(cmd[1:])} failed: {last}")
    lines = run.stdout.strip().splitlines()
    fields = dict(item.split("=", 1) for item in lines[-1].split()[1:])
    split = next(line for line in lines if line.strip().startswith("step split"))
    fields["dense_share"] = re.search(r"\| dense [\d.]+ \((\d+)%\)", split).group(1)
    return fields


def row(setting: str, runs: List[Dict[str, str]]) -> str:
    """A markdown row: medians over the runs, the ratio's range where there were several."""
    def median(key: str) -> float:
        return statistics.median(float(r[key]) for r in runs)

    ratios = sorted(float(r["ratio"]) for r in runs)
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(runs) > 1 else ""
    ran = "/".join(sorted({r["precision"] for r in runs}))
    return (f"| {setting} | {ran} | {median('samples_per_s'):,.0f} | "
            f"{median('baseline_samples_per_s'):,.0f} | {median('ratio'):.2f}{spread} | "
            f"{median('roofline_fraction'):.2f} | {median('dense_share'):.0f}% | "
            f"{median('peak_mem_gib'):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench_cpu.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--settings", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--repeat", type=int, default=1, help="runs per setting (default 1)")
    parser.add_argument("--emulate-avx2", action="store_true",
                        help="run bench as on an AVX2-only CPU (ONEDNN_MAX_CPU_ISA=AVX2)")
    args = parser.parse_args()
    if Path(args.config).exists():  # from here, absolute: bench runs in the checkout's root
        args.config = str(Path(args.config).resolve())
    for i, setting in enumerate(args.settings):
        try:
            runs = [bench_line(args.config, setting, args.steps, args.emulate_avx2)
                    for _ in range(args.repeat)]
        except (BenchFailed, ValueError) as error:
            sys.exit(f"bench_table: {error}")
        if i == 0:  # the capability comes from the first run
            print(f"cpu: {runs[0]['cpu']}" + (" (AVX2 emulated)" if args.emulate_avx2 else ""))
            print("| setting | ran | samples/s | reference samples/s | ratio | roofline fraction "
                  "| dense share of step | peak memory GiB |")
            print("|---|---|---:|---:|---:|---:|---:|---:|")
        print(row(setting, runs), flush=True)


if __name__ == "__main__":
    main()
