"""Quality at equal memory: full tables, the hashing trick, and quotient-remainder embeddings
(mult, add, concat) with ~4x and ~16x fewer rows in the large tables.

    .venv/bin/python benchmarks/compositional.py [--steps 2000] [--reductions 4 16]
        [--id-orders frequency scattered]

Planted-teacher synthetic click logs (data/synthetic.py): three large Zipf tables (200,000,
100,000 and 50,000 rows) and five small ones; the model is the demo's (dim 16, `dot`). Only
the large tables are replaced. At reduction k their embedding bytes shrink k-fold:
hash m = n/k rows; mult and add c = k (n/k + k rows); concat (half-width parts) c = k/2. Every
run trains the same model from the same seed on the same batches, in one process, then
evaluates on 65,536 validation samples. Both id orders are run: `frequency` (id 0 the most
frequent value, as `preprocess` numbers Criteo's) and `scattered` (a fixed relabelling, as
numbering by first appearance gives): QR's quotient row is shared by c neighbouring ids, which
under `frequency` are the most frequent ones. Prints validation AUC and log loss, the oracle AUC (the
teacher's own probabilities) and the gap to it, the large tables' bytes, and seconds per run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LARGE = [200_000, 100_000, 50_000]
SMALL = [2_000, 500, 100, 20, 5]
DIM = 16
THRESHOLD = 10_000  # the large tables are those with more rows


def settings(steps: int, id_order: str, run_dir: str):
    return [f"data.id_order={id_order}", "model.embedding_dim=16", "model.bottom_mlp=[64,16]", "model.top_mlp=[64,32,1]",
            f"data.cardinalities={LARGE + SMALL}", "data.hotness=[1]",
            "data.train_samples=100000000", "data.val_samples=65536", "data.teacher_scale=2.0",
            "data.global_batch_size=2048", f"train.max_steps={steps}",
            f"train.log_every={steps}", "train.eval_every=0", "train.progress_bar=false",
            "optim.warmup_steps=0", f"optim.decay_start_step={steps // 2}",
            f"optim.decay_steps={steps // 2}", "checkpoint.resume=none",
            f"train.run_dir={run_dir}"]


def variants(reductions):
    """(technique, reduction, `model.compositional` override or None) of every run."""
    yield "full", 1, None
    for k in reductions:
        hashed = [f"{{technique: hash, features: [cat_{i}], buckets: {rows // k}}}"
                  for i, rows in enumerate(LARGE)]
        yield "hash", k, f"model.compositional=[{', '.join(hashed)}]"
        for op in ("mult", "add", "concat"):
            c = k // 2 if op == "concat" else k  # concat's parts are half as wide
            yield (f"qr {op}", k, f"model.compositional=[{{technique: qr, rows_above: "
                                  f"{THRESHOLD}, collisions: {c}, operation: {op}}}]")


def large_table_bytes(cfg, spec) -> int:
    """fp32 weight bytes of the large tables, or of their parts."""
    from dlrm_hybrid.model.compositional import lookups_of

    return sum(part.rows * part.dim * 4 for lookup in lookups_of(cfg.model, spec)
               if lookup.rows > THRESHOLD for part in lookup.parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="training steps per run")
    parser.add_argument("--reductions", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--id-orders", nargs="+", default=["frequency", "scattered"],
                        choices=["frequency", "scattered"])
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29577")
    sys.path.insert(0, str(ROOT))
    import logging

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synthetic import SyntheticClicks
    from dlrm_hybrid.parallel.process_group import init_distributed
    from dlrm_hybrid.train.loop import train
    from dlrm_hybrid.train.precision import cpu_description

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    env = init_distributed("gloo")
    print(f"{args.steps} steps x 2,048 samples, 1 process, {os.cpu_count()} cores "
          f"({cpu_description()})")
    print("| ids | technique | reduction | large tables | val AUC | AUC - oracle | val logloss "
          "| oracle AUC | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    runs = [(order, *v) for order in args.id_orders for v in variants(args.reductions)]
    with tempfile.TemporaryDirectory() as scratch:
        for order, name, k, rules in runs:
            run_dir = f"{scratch}/{order}_{name.replace(' ', '_')}_{k}"
            overrides = settings(args.steps, order, run_dir)
            overrides += [rules] if rules else []
            cfg = load_config(str(ROOT / "configs/demo.yaml"), overrides)
            size = large_table_bytes(cfg, SyntheticClicks(cfg.data).spec)
            start = time.perf_counter()
            with open(os.devnull, "w") as quiet:  # the run's own plan and progress lines
                saved, sys.stdout = sys.stdout, quiet
                try:
                    metrics = train(cfg, env).metrics
                finally:
                    sys.stdout = saved
            seconds = time.perf_counter() - start
            print(f"| {order} | {name} | {k}x | {size / 2**20:.1f} MiB | {metrics['val_auc']:.4f} | "
                  f"{metrics['val_auc'] - metrics['oracle_auc']:+.4f} | "
                  f"{metrics['val_logloss']:.4f} | {metrics['oracle_auc']:.4f} | {seconds:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
