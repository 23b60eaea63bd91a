"""The GPU speed table of one device call: `bench` on the FL15 model per setting, ours beside the
reference and torchrec's own stack, a profile of the step's top kernels, and the MLPerf DCNv2
model in the form that fits one 80 GiB card. Every run is bounded; a table is printed last.

    benchmarks/gpu_check.sh --speed OUT                  # on the GPU machine, after --unpack
    benchmarks/gpu_check.sh --speed OUT --cpu-rehearsal  # the same runs on the demo model

Each run's whole output goes to OUT/speed.log; the profile's trace stays outside OUT (a call
brings back few files), its table is in the log.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 560  # of the 600 s a device call gets
FL15, MLPERF_QR = "configs/criteo_1tb_fl15.yaml", "configs/mlperf_dcnv2_qr.yaml"


class Run(NamedTuple):
    name: str
    config: str
    sets: List[str]
    peers: List[str]
    steps: int
    profile: bool = False


RUNS = [
    Run("default (bf16 + graphs)", FL15, [], ["reference", "torchrec"], 30),
    Run("bf16 eager, profiled", FL15, ["train.precision=bf16", "train.cuda_graphs=false"],
        ["none"], 20, profile=True),
    Run("tf32 + graphs", FL15, ["train.precision=tf32"], ["none"], 20),
    Run("fp32 + graphs", FL15, ["train.precision=fp32"], ["none"], 20),
    Run("bf16 + graphs, fp16 tables", FL15, ["model.embedding_precision=fp16"], ["none"], 30),
    Run("MLPerf DCNv2 (QR), bf16 + graphs", MLPERF_QR, [], ["none"], 20),
]


def command(run: Run, rehearsal: bool, profile_dir: Path) -> List[str]:
    config, steps = ("configs/demo.yaml", 3) if rehearsal else (run.config, run.steps)
    return [sys.executable, "-m", "dlrm_hybrid", "bench", "--config", config, "--steps",
            str(steps), "--peers", *run.peers,
            *(["--profile", str(profile_dir)] if run.profile else []),
            *[a for s in run.sets for a in ("--set", s)]]


def last_fields(output: str) -> Dict[str, str]:
    lines = [line for line in output.splitlines() if line.startswith("bench: ")]
    return dict(item.split("=", 1) for item in lines[-1].split()[1:]) if lines else {}


def _text(data) -> str:
    """What a cut-off run printed (TimeoutExpired keeps bytes even for a text run)."""
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu-rehearsal", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + BUDGET_S
    scratch = Path(tempfile.mkdtemp(prefix="gpu_speed_"))
    rows = []
    with open(args.out / "speed.log", "w") as log:
        for i, run in enumerate(RUNS):
            left = deadline - time.time()
            if left < 30:
                rows.append((run.name, "skipped: out of time", {}))
                continue
            cmd = command(run, args.cpu_rehearsal, scratch / f"profile_{i}")
            log.write(f"\n$ {' '.join(cmd[1:])}\n")
            log.flush()
            start = time.time()
            try:
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                      timeout=min(left, 200))
                output, status = done.stdout + done.stderr, f"exit {done.returncode}"
            except subprocess.TimeoutExpired as cut:
                output = _text(cut.stdout) + _text(cut.stderr)
                status = f"cut off after {time.time() - start:.0f} s"
            log.write(output)
            log.flush()
            fields = last_fields(output)
            rows.append((run.name, status if not fields else f"{time.time() - start:.0f} s", fields))
            print(f"gpu_speed: {run.name}: {fields.get('samples_per_s', status)}", flush=True)
    print("| setting | samples/s | ran | vs reference | vs torchrec | roofline fraction | "
          "peak GiB | wall |")
    print("|---|---:|---|---:|---:|---:|---:|---|")
    for name, status, f in rows:
        if not f:
            print(f"| {name} | | | | | | | {status} |")
            continue
        print(f"| {name} | {float(f['samples_per_s']):,.0f} | {f['precision']} | "
              f"{f.get('ratio', '')} | {f.get('torchrec_ratio', '')} | "
              f"{f['roofline_fraction']} | {f['peak_mem_gib']} | {status} |")


if __name__ == "__main__":
    main()
