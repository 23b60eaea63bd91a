"""Served models: size, quality and speed of each export precision against the fp32 eager model.

    .venv/bin/python benchmarks/inference.py [--checkpoint runs/demo/checkpoints/step_3000]
        [--calls 200] [--batches 1,64,512,4096]

Without --checkpoint it first trains the demo (`configs/demo.yaml`, 2 gloo ranks under torchrun,
--steps of it). Then it exports the checkpoint at fp32, fp16, int8 and int4 and prints:
- quality: file size, embedding-table bytes (and their share of fp32's), validation AUC and log
  loss of each file over the checkpoint's whole validation split, the AUC difference to the fp32
  file (target: int8 within 0.001), the eager model's AUC and, for the planted synthetic data, the
  oracle AUC;
- speed, in this process on CPU: p50 and p99 latency of one call over --calls calls (after 10
  untimed ones; the models take turns in 5 rounds) at each batch size, and samples/s (batch /
  mean latency), for the fp32 eager model (torchrec EmbeddingBagCollection fed a
  KeyedJaggedTensor) and each file (`score_bags` on the same rows). Inputs are built before
  timing, for both.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_hybrid.config_loading import load_config  # noqa: E402
from dlrm_hybrid.data.source import open_dataset  # noqa: E402
from dlrm_hybrid.model.dlrm import build_model  # noqa: E402
from dlrm_hybrid.serve.export import QUANTIZATIONS, export_model  # noqa: E402
from dlrm_hybrid.serve.predict import bags_input, load_scoring_model, metrics, scoring_rows  # noqa: E402
from dlrm_hybrid.train.inference import read_model_state  # noqa: E402
from dlrm_hybrid.train.precision import cpu_description  # noqa: E402


def train_demo(run_dir: Path, steps: int) -> Path:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "dlrm_hybrid", "train", "--config", str(ROOT / "configs/demo.yaml"),
           "--set", f"train.max_steps={steps}", "--set", f"train.run_dir={run_dir}",
           "--set", "train.progress_bar=false", "--set", "checkpoint.resume=none"]
    if steps < 3000:  # the demo's schedule decays over its last 1,500 steps: keep that shape
        cmd += ["--set", f"optim.decay_start_step={steps // 2}",
                "--set", f"optim.decay_steps={steps - steps // 2}"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={"OMP_NUM_THREADS": "1", **_path_env()})
    return run_dir / "checkpoints" / f"step_{steps}"


def _path_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}


def timed(calls_by_model: dict, calls: int, rounds: int = 5) -> dict:
    """Seconds per call of each model, `calls` each, after 10 untimed: in `rounds` rounds that
    take turns, so that a slow spell of this shared machine hits every model alike."""
    seconds: Dict[str, List[float]] = {name: [] for name in calls_by_model}
    for call in calls_by_model.values():
        for _ in range(10):
            call()
    for r in range(rounds):
        for name, call in calls_by_model.items():
            for _ in range(calls // rounds + (r < calls % rounds)):
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
    return {name: np.array(s) for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="a step_<n> checkpoint (default: train the demo)")
    parser.add_argument("--steps", type=int, default=3000, help="demo training steps (3000)")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per batch size")
    parser.add_argument("--batches", default="1,64,512,4096")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="inference_bench_") as work:  # the exports: removed
        measure(args, Path(work))


def measure(args, work: Path) -> None:
    """The tables of the docstring, with the demo's run (if trained) and the exports in `work`."""
    checkpoint = Path(args.checkpoint) if args.checkpoint else train_demo(work / "run", args.steps)
    cfg = load_config(str(checkpoint / "config.yaml"))
    dataset = open_dataset(cfg.data)
    val = dataset.columns("val", 0, dataset.num_samples("val"))
    rows = scoring_rows(val, str)

    eager = build_model(cfg.model, dataset.spec, embedding_device=torch.device("cpu"))
    eager.load_state_dict(read_model_state(checkpoint))
    eager.eval()
    served = {}
    for quantize in QUANTIZATIONS:
        description = export_model(str(checkpoint), str(work / f"{quantize}.pt"), quantize)
        served[quantize] = load_scoring_model(work / f"{quantize}.pt")[0], description

    print(f"# {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"# checkpoint {checkpoint} ({cfg.data.path or 'planted synthetic data'}), "
          f"validation split {len(val.labels):,} samples")
    with torch.inference_mode():
        batch = dataset.batch("val", 0, len(val.labels))
        eager_auc = metrics(torch.sigmoid(eager(batch.dense, batch.sparse)).numpy(), val.labels)
        quality = {q: metrics(module.score_bags(*bags_input(rows)).numpy(), val.labels)
                   for q, (module, _) in served.items()}
    oracle = (f", oracle AUC {metrics(val.true_prob, val.labels)['auc']:.5f}"
              if val.true_prob is not None else "")
    print(f"# fp32 eager model: AUC {eager_auc['auc']:.5f}, log loss {eager_auc['logloss']:.5f}"
          f"{oracle}\n")
    fp32_tables = sum(t["bytes"] for t in served["fp32"][1]["tables"])
    print("| precision | file bytes | table bytes (of fp32) | val AUC | AUC - fp32 | val log loss |")
    print("|---|---|---|---|---|---|")
    for q, (_, description) in served.items():
        tables = sum(t["bytes"] for t in description["tables"])
        print(f"| {q} | {(work / f'{q}.pt').stat().st_size:,} | {tables:,} "
              f"({tables / fp32_tables:.1%}) | {quality[q]['auc']:.5f} | "
              f"{quality[q]['auc'] - quality['fp32']['auc']:+.5f} | {quality[q]['logloss']:.5f} |")

    sizes = [int(b) for b in args.batches.split(",")]
    cells: Dict[str, List[str]] = {name: [] for name in ["fp32 eager", *served]}
    for size in sizes:
        part = dataset.batch("val", 0, size)
        inputs = bags_input(scoring_rows(dataset.columns("val", 0, size), str))
        calls: Dict[str, Callable[[], object]] = {
            "fp32 eager": lambda: eager(part.dense, part.sparse)}
        for q, (module, _) in served.items():
            calls[q] = functools.partial(module.score_bags, *inputs)
        with torch.inference_mode():
            for name, seconds in timed(calls, args.calls).items():
                p50, p99 = np.percentile(seconds, [50, 99]) * 1e3
                cells[name].append(f"{p50:.3f} / {p99:.3f} ({size / seconds.mean():,.0f})")
    print(f"\nlatency per call, ms p50 / p99 (samples/s), {args.calls} calls per cell")
    print("| model | " + " | ".join(f"batch {b:,}" for b in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, row in cells.items():
        print(f"| {name} | " + " | ".join(row) + " |")
    if torch.cuda.is_available():
        print("\n# a GPU is present, but the exported files keep their tables in host memory: "
              "GPU serving is not measured here")


if __name__ == "__main__":
    main()
