"""Mixed-dimension embeddings: validation AUC against embedding bytes, full-width tables beside,
at equal steps, on the planted data and on a Criteo-format sample.

    .venv/bin/python benchmarks/mixed_dimensions.py [--width 64] [--steps 2000] [--seeds 2]
        [--temperatures 0.1 0.15 0.2 0.3] [--round-dims] [--criteo-rows 1000000]
        [--criteo-steps 1000]

1. Planted: the teacher's click logs (data/synthetic.py; its latent vectors are 8 wide) over
   three large Zipf tables (200,000, 100,000 and 50,000 rows) and five small ones, as
   benchmarks/compositional.py; the demo's model at width `--width` (`dot`). Each temperature's
   widths are md_solver's (multiples of 4, or with `--round-dims` powers of two; tables of at
   most 200 rows kept full); every run
   trains the same model on the same batches, from each seed (train.seed), in one process, then
   evaluates on 65,536 validation samples.
2. Criteo-format: the planted teacher's rows over 26 tables shaped as Criteo 1TB's FL15 ones
   (each 1/40 of its rows, at least 4) written as Criteo TSV (label, I1..I13 with log(I + 3)
   the teacher's dense feature, C1..C26 as 8 hex digits), made into a dataset by `preprocess
   criteo` (hash split 90/5/5), trained from the files with and without mixed dimensions.

Bytes: every table's fp32 weights (rows x width x 4), the ratio against full width. A
projection's weights are dense and not counted (they are printed in `plan`'s dense part).
The last line is the planted data's run at the lowest temperature whose tables take at most a
quarter of the full-width bytes (the goal's setting):

    mixed_dimensions: bytes_ratio=R auc_full=X auc_mixed=Y temperature=T
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
LARGE = [200_000, 100_000, 50_000]
SMALL = [2_000, 500, 100, 20, 5]
FL15 = [7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828, 11,
        2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97, 35]
GOAL_RATIO = 0.25


def planted_settings(width: int, steps: int, seed: int, run_dir: str):
    return [f"model.embedding_dim={width}", f"model.bottom_mlp=[64,{width}]",
            "model.top_mlp=[64,32,1]",
            f"data.cardinalities={LARGE + SMALL}", "data.hotness=[1]",
            "data.train_samples=100000000", "data.val_samples=65536", "data.teacher_scale=2.0",
            *common_settings(steps, seed, run_dir)]


def common_settings(steps: int, seed: int, run_dir: str):
    return ["data.global_batch_size=2048", f"train.max_steps={steps}", f"train.seed={seed}",
            f"train.log_every={steps}", "train.eval_every=0", "train.progress_bar=false",
            "optim.warmup_steps=0", f"optim.decay_start_step={steps // 2}",
            f"optim.decay_steps={steps // 2}", "checkpoint.resume=none", "checkpoint.every=0",
            f"train.run_dir={run_dir}"]


def table_bytes(cfg, spec) -> int:
    from dlrm_hybrid.model.compositional import lookups_of

    return sum(p.rows * p.dim * 4 for lookup in lookups_of(cfg.model, spec) for p in lookup.parts)


def quietly(function):
    with open(os.devnull, "w") as quiet:  # the run's own plan and progress lines
        saved, sys.stdout = sys.stdout, quiet
        try:
            return function()
        finally:
            sys.stdout = saved


def run(overrides, env) -> dict:
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.configured_spec import data_spec
    from dlrm_hybrid.train.loop import train

    cfg = load_config(str(ROOT / "configs/demo.yaml"), overrides)
    size = table_bytes(cfg, data_spec(cfg.data))
    start = time.perf_counter()
    metrics = quietly(lambda: train(cfg, env).metrics)
    return {"auc": metrics["val_auc"], "bytes": size, "seconds": time.perf_counter() - start,
            "oracle": metrics.get("oracle_auc")}


def mixed(temperature: float, round_dims: bool):
    return ([f"model.mixed_dimensions.temperature={temperature}",
             f"model.mixed_dimensions.round_dims={str(round_dims).lower()}"] if temperature
            else [])


def planted(args, env, scratch: str) -> dict:
    print(f"\nplanted: {args.steps} steps x 2,048 samples, width {args.width}, tables "
          f"{LARGE + SMALL}")
    print("| temperature | table bytes | ratio | val AUC (mean of seeds) | per seed | - full "
          "| seconds |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for t in [0.0, *args.temperatures]:
        runs = [run(planted_settings(args.width, args.steps, seed, f"{scratch}/planted_{t}_{seed}")
                    + mixed(t, args.round_dims), env) for seed in range(args.seeds)]
        aucs = [r["auc"] for r in runs]
        results[t] = {"auc": statistics.mean(aucs), "bytes": runs[0]["bytes"]}
        full = results[0.0]
        print(f"| {t:g} | {runs[0]['bytes'] / 2**20:.2f} MiB | "
              f"{runs[0]['bytes'] / full['bytes']:.3f} | {results[t]['auc']:.5f} | "
              f"{' '.join(f'{a:.5f}' for a in aucs)} | {results[t]['auc'] - full['auc']:+.5f} | "
              f"{sum(r['seconds'] for r in runs):.0f} |", flush=True)
    print(f"oracle AUC {runs[0]['oracle']:.5f}")
    return results


def criteo_tsv(path: Path, rows: int) -> None:
    """The planted teacher's rows as Criteo TSV lines."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synthetic import SyntheticClicks

    cards = [max(4, n // 40) for n in FL15]
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        f"data.cardinalities={cards}", "data.hotness=[1]", f"data.train_samples={rows}",
        "data.teacher_scale=2.0"])
    data = SyntheticClicks(cfg.data)
    with open(path, "w") as out:
        for first in range(0, rows, 100_000):
            c = data.columns("train", first, min(100_000, rows - first))
            ints = np.maximum(np.rint(np.exp(c.dense.astype(np.float64) + 3.0)) - 3, 0)
            ints = ints.astype(np.int64)
            hexes = [np.char.mod("%08x", (ids[:, 0].astype(np.int64) * 2654435761 + 7919 * f)
                                 % 2**32) for f, ids in enumerate(c.ids)]
            fields = [c.labels.astype(np.int64).astype(str), *ints.T.astype(str), *hexes]
            lines = ["\t".join(row) for row in zip(*fields)]
            out.write("\n".join(lines) + "\n")


def criteo(args, env, scratch: str) -> None:
    tsv, dataset = Path(scratch) / "sample.tsv", Path(scratch) / "criteo"
    start = time.perf_counter()
    criteo_tsv(tsv, args.criteo_rows)
    subprocess.run([sys.executable, "-m", "dlrm_hybrid", "preprocess", "criteo", "--input",
                    str(tsv), "--output", str(dataset), "--split", "hash"], check=True,
                   cwd=ROOT, stdout=subprocess.DEVNULL)
    print(f"\nCriteo-format sample: {args.criteo_rows:,} rows written and preprocessed in "
          f"{time.perf_counter() - start:.0f} s; {args.criteo_steps} steps x 2,048 samples, "
          f"width 32")
    print("| temperature | table bytes | ratio | val AUC | - full | seconds |")
    print("|---|---|---|---|---|---|")
    model = ["model.embedding_dim=32", "model.bottom_mlp=[64,32]", f"data.path={dataset}"]
    full = None
    for t in [0.0, *args.temperatures]:
        r = run(model + common_settings(args.criteo_steps, 0, f"{scratch}/criteo_{t}")
                + mixed(t, args.round_dims), env)
        full = full or r
        print(f"| {t:g} | {r['bytes'] / 2**20:.2f} MiB | {r['bytes'] / full['bytes']:.3f} | "
              f"{r['auc']:.5f} | {r['auc'] - full['auc']:+.5f} | {r['seconds']:.0f} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="planted: steps per run")
    parser.add_argument("--seeds", type=int, default=2, help="planted: train.seed 0..N-1")
    parser.add_argument("--width", type=int, default=64, help="planted: model.embedding_dim")
    parser.add_argument("--round-dims", action="store_true",
                        help="model.mixed_dimensions.round_dims=true (powers of two)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.1, 0.15, 0.2, 0.3])
    parser.add_argument("--criteo-rows", type=int, default=1_000_000,
                        help="Criteo-format sample's rows (0: skip it)")
    parser.add_argument("--criteo-steps", type=int, default=1000)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29578")
    sys.path.insert(0, str(ROOT))
    import logging

    from dlrm_hybrid.parallel.process_group import init_distributed
    from dlrm_hybrid.train.precision import cpu_description

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    env = init_distributed("gloo")
    print(f"1 process, {os.cpu_count()} cores ({cpu_description()})")
    with tempfile.TemporaryDirectory() as scratch:
        results = planted(args, env, scratch)
        if args.criteo_rows:
            criteo(args, env, scratch)
    full = results[0.0]
    goal = [t for t in args.temperatures if results[t]["bytes"] <= GOAL_RATIO * full["bytes"]]
    if not goal:
        print(f"mixed_dimensions: no temperature reached {GOAL_RATIO} of the full bytes")
        return
    t = min(goal)
    print(f"mixed_dimensions: bytes_ratio={results[t]['bytes'] / full['bytes']:.3f} "
          f"auc_full={full['auc']:.5f} auc_mixed={results[t]['auc']:.5f} temperature={t:g}")


if __name__ == "__main__":
    main()
