"""The README's benchmark table: `python -m dlrm_hybrid bench` once per precision setting.

    .venv/bin/python benchmarks/bench_table.py [--config configs/bench_cpu.yaml] [--steps 60]
        [--settings fp32 bf16]        # on a GPU e.g.: fp32 tf32 bf16 bf16+graphs

Each setting is a fresh process (the same as a user's run); each reports its own reference
baseline measured in that process. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_line(config: str, setting: str, steps: int) -> dict:
    precision, _, graphs = setting.partition("+")
    cmd = [sys.executable, "-m", "dlrm_hybrid", "bench", "--config", config, "--steps", str(steps),
           "--set", f"train.precision={precision}",
           "--set", f"train.cuda_graphs={'true' if graphs == 'graphs' else 'false'}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = out.strip().splitlines()
    fields = dict(item.split("=") for item in lines[-1].split()[1:])
    roofline = next((l for l in lines if "roofline" in l), "")
    fields["roofline_fraction"] = roofline.rsplit("achieved ", 1)[-1].split()[0] if roofline else "?"
    return fields


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench_cpu.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--settings", nargs="+", default=["fp32", "bf16"])
    args = parser.parse_args()
    print("| setting | samples/s | reference samples/s | ratio | roofline fraction | peak memory GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for setting in args.settings:
        f = bench_line(args.config, setting, args.steps)
        print(f"| {setting} | {float(f['samples_per_s']):,.0f} | "
              f"{float(f['baseline_samples_per_s']):,.0f} | {f['ratio']} | "
              f"{f['roofline_fraction']} | {f['peak_mem_gib']} |", flush=True)


if __name__ == "__main__":
    main()
