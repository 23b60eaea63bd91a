"""Bytes and speed of the two embedding exchanges, pooled and des, on 4 gloo ranks (CPU).

    .venv/bin/python benchmarks/des_exchange.py [--ranks 4] [--steps 20]

Two model shapes, each trained with both exchanges from the same seed on the same batches:
- `wide-64`: 64 tables of dim 64 (10,000 rows each), bottom MLP [128, 64], cat's first top
  layer H = 64, global batch 4,096: where des should win (cat: H P / (T D) = 1/16 at 4 ranks;
  fm: (D + 2) / (T_p D) = 0.064), with `cat` and `fm`.
- `mlperf`: DLRM-DCNv2's shape with `cat`: 26 tables of dim 128 (10,000 rows each: the row
  count does not change the exchange), bottom [512, 256, 128], top [1024, 1024, 512, 256, 1],
  global batch 2,048: where des should lose (1024 * 4 / (26 * 128) = 1.23 at 4 ranks; 2.46 at 8).
Each run is `train` under torchrun; the bytes are what each rank's exchange counted (rank_logs,
mean over ranks and logged steps), samples/s the training loop's own (first step included).
Prints a markdown table with the measured des / pooled byte ratio next to the formula's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SHAPES = {
    "wide-64": dict(tables=64, dim=64, bottom=[128, 64], top=[64, 32, 1], batch=4096),
    "mlperf": dict(tables=26, dim=128, bottom=[512, 256, 128], top=[1024, 1024, 512, 256, 1],
                   batch=2048),
}
CASES = [("wide-64", "cat"), ("wide-64", "fm"), ("mlperf", "cat")]


def settings(shape: dict, interaction: str, exchange: str, steps: int, run_dir: Path):
    return [f"model.interaction={interaction}", f"parallel.exchange={exchange}",
            f"model.embedding_dim={shape['dim']}", f"model.bottom_mlp={shape['bottom']}",
            f"model.top_mlp={shape['top']}", f"data.cardinalities={[10_000] * shape['tables']}",
            "data.hotness=[1]", f"data.global_batch_size={shape['batch']}",
            f"data.train_samples={shape['batch'] * (steps + 1)}", "data.val_samples=8192",
            f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
            "train.progress_bar=false", "train.rank_logs=true", "checkpoint.resume=none",
            f"train.run_dir={run_dir}"]


def formula(shape: dict, interaction: str, ranks: int) -> float:
    """des / pooled bytes by the issue's formula: H P / (T D) for cat, (D + 2) / (T_p D) for fm."""
    t, d = shape["tables"], shape["dim"]
    if interaction == "cat":
        return shape["top"][0] * ranks / (t * d)
    return (d + 2) / (t / ranks * d)


def counted_bytes(run_dir: Path, ranks: int) -> float:
    """Forward + backward exchange bytes per step and rank, mean over ranks and steps 2..."""
    per_step = []
    for rank in range(ranks):
        for line in (run_dir / f"rank_{rank}.jsonl").read_text().splitlines():
            event = json.loads(line)
            if event.get("step", 0) > 1:
                per_step.append(event["exchange_fwd_bytes"] + event["exchange_bwd_bytes"])
    return sum(per_step) / len(per_step)


def train(shape_name: str, interaction: str, exchange: str, ranks: int, steps: int,
          work: Path):
    run_dir = work / f"{shape_name}-{interaction}-{exchange}"
    sets = settings(SHAPES[shape_name], interaction, exchange, steps, run_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", "-m", "dlrm_hybrid", "train", "--config",
           "configs/demo.yaml", *[a for s in sets for a in ("--set", s)]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    if result.returncode:
        sys.exit(f"{run_dir.name} failed:\n{result.stderr[-3000:]}")
    done = result.stdout.strip().splitlines()[-1]
    samples_per_s = float(done.split("samples_per_s=")[1].split()[0])
    return counted_bytes(run_dir, ranks), samples_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from dlrm_hybrid.train.precision import cpu_description

    print(f"{args.ranks} gloo ranks on {os.cpu_count()} cores ({cpu_description()}), "
          f"{args.steps} steps each")
    print("| shape | interaction | pooled bytes/step/rank | des bytes/step/rank | des/pooled "
          "measured | formula | pooled samples/s | des samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as work:
        for shape_name, interaction in CASES:
            (pooled, pooled_speed), (des, des_speed) = (
                train(shape_name, interaction, exchange, args.ranks, args.steps, Path(work))
                for exchange in ("pooled", "des"))
            print(f"| {shape_name} | {interaction} | {pooled:,.0f} | {des:,.0f} | "
                  f"{des / pooled:.3f} | {formula(SHAPES[shape_name], interaction, args.ranks):.3f} | "
                  f"{pooled_speed:,.0f} | {des_speed:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
