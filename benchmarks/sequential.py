"""HSTU, the generative sequence model (`model.kind: hstu`), against the SASRec-style reference
(benchmarks/sasrec.py) on one interaction log's leave-last-out split, full ranking of the corpus.

    .venv/bin/python benchmarks/sequential.py --data FILE [--name NAME] [--positive 'rating>=4']
        [--seeds 3] [--ranks 1] [--quick]
    .venv/bin/python benchmarks/sequential.py --dataset DIR ...   (a folder preprocess wrote)
        [--setting HSTU_DROPOUT,SASREC_DROPOUT] [--epochs N]   (no grids; shorter runs)

--data: any log `preprocess interactions` reads (MovieLens u.data, ratings.dat, ratings.csv);
it is preprocessed into a temporary folder (positive = rating >= 4, leave-last-out per user by
timestamp, timestamps kept for HSTU's time bias).

1. HSTU through the product: `train` on --ranks gloo ranks (0: one process), a validation and
   a checkpoint after every epoch; each setting of GRID (on top of BASE) trained with seed 0,
   the setting and epoch of the best VALIDATION HR@10 chosen, that epoch's checkpoint tested
   (`eval --split test`). The chosen setting is then trained with each further seed, each
   seed's own validation-best epoch tested.
2. The SASRec-style reference in this process on one thread: its own grid on validation with
   seed 0 (sasrec.GRID), then the chosen setting with each further seed, tested the same way.
3. Both scored by retrieval/evaluate.py's code (the user's earlier items left out; HR@10 =
   recall@10 with one held-out item per user).

Prints the CPU, each run, a table per seed and last the summary line (means over the seeds):

    sequential: data=NAME users=U items=I seeds=S hstu_hr@10=X sasrec_hr@10=X hstu_ndcg@10=X
        sasrec_ndcg@10=X ratio_hr@10=X ratio_ndcg@10=X hstu_hr@10_se=X sasrec_hr@10_se=X
        hstu_sequences_per_s=X
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch

from retrieval import cpu_name, prepare_data, test_metrics, train_two_tower
import sasrec

BASE = {  # the reference's MovieLens settings (docs/sequential.md), the reference's width 64
    "model": {"kind": "hstu", "embedding_dim": 64, "temperature": 0.05,
              "hstu": {"max_length": 50, "layers": 2, "heads": 1, "dropout": 0.2}},
    "data": {"global_batch_size": 128, "shuffle": True},
    "retrieval": {"uniform_negatives": 128},
    "optim": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adam",
              "dense_lr": 0.001},
    "train": {"progress_bar": False, "tensorboard": False},
    "checkpoint": {"resume": "none"},
}
GRID = {"model.hstu.dropout": (0.2, 0.5)}  # max_length 200: no better on ml-100k, 4x the cost
EPOCHS = 60  # the longest run (the reference's too); validation after each epoch picks the count
QUICK = ({"model.hstu.max_length": 20}, 2)


def write_config(path: Path, data: Dict[str, object], sets: Dict[str, object], epochs: int,
                 per_epoch: int, seed: int) -> None:
    """BASE with `data`, `sets` (dotted keys), `epochs` of `per_epoch` steps, a validation and
    a checkpoint after each, and `seed` for the model and the data order."""
    cfg = json.loads(json.dumps(BASE))
    cfg["data"].update(data)
    cfg["data"]["seed"] = seed
    cfg["train"].update({"max_steps": epochs * per_epoch, "eval_every": per_epoch,
                         "log_every": per_epoch, "seed": seed})
    cfg["checkpoint"].update({"every": per_epoch, "keep": epochs})
    for key, value in sets.items():
        section, *rest = key.split(".")
        node = cfg.setdefault(section, {})
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = value
    import yaml

    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def hstu_run(data_cfg, sets: Dict[str, object], epochs: int, seed: int, scratch: Path,
             ranks: int, name: str) -> Dict[str, float]:
    """One HSTU training: its validation-best epoch's validation and test metrics, the epoch,
    sequences/s and seconds."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import open_dataset

    config, run_dir = scratch / f"{name}.yaml", scratch / name
    write_config(config, data_cfg, sets, 1, 1, seed)
    cfg = load_config(str(config))
    per_epoch = -(-open_dataset(cfg.data, cfg.model).num_samples("train")
                  // cfg.data.global_batch_size)
    write_config(config, data_cfg, sets, epochs, per_epoch, seed)
    curve, run = train_two_tower(config, run_dir, ranks)
    best = max(curve, key=lambda e: e["val_hr@10"])
    return {**best, **test_metrics(run_dir, best["step"]), "epoch": best["step"] // per_epoch,
            "sequences_per_s": run["samples_per_s"], "seconds": run["seconds"]}


def sasrec_run(data, retrieval_cfg, setting: dict, epochs: int, seed: int) -> Dict[str, float]:
    """One SASRec-style training on one thread: its validation-best epoch, tested."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        val, weights, epoch, seconds = sasrec.train(data, retrieval_cfg, epochs=epochs,
                                                    seed=seed, **setting)
        model = sasrec.SASRec(data.items, setting["maxlen"], setting["dropout"])
        model.load_state_dict(weights)
        test = sasrec.evaluate(model, data, retrieval_cfg, "test")
    finally:
        torch.set_num_threads(threads)
    return {**val, **test, "epoch": epoch, "seconds": seconds}


def words(sets: Dict[str, object]) -> str:
    return ", ".join(f"{k.split('.')[-1]} {v}" for k, v in sets.items())


def tune_hstu(data_cfg, scratch: Path, args) -> Tuple[dict, Dict[str, float], int]:
    """(the chosen setting, its seed-0 run, epochs) by validation HR@10 over GRID (with
    --setting, that one alone)."""
    grid, epochs = ([QUICK[0]], QUICK[1]) if args.quick else (
        [dict(zip(GRID, v)) for v in itertools.product(*GRID.values())], EPOCHS)
    if args.setting and not args.quick:
        grid = [{"model.hstu.dropout": args.setting[0]}]
    epochs = args.epochs or epochs
    best = None
    for i, sets in enumerate(grid):
        m = hstu_run(data_cfg, sets, epochs, 0, scratch, args.ranks, f"hstu_grid_{i}")
        print(f"  hstu {words(sets)}: best val HR@10 {m['val_hr@10']:.4f} after {m['epoch']} "
              f"of {epochs} epochs ({m['seconds']:.0f} s, {m['sequences_per_s']:,.0f} "
              f"sequences/s)", flush=True)
        if best is None or m["val_hr@10"] > best[1]["val_hr@10"]:
            best = (sets, m)
    return best[0], best[1], epochs


def tune_sasrec(data, retrieval_cfg, args) -> Tuple[dict, Dict[str, float], int]:
    grid, epochs = ([sasrec.QUICK[0]], sasrec.QUICK[1]) if args.quick else (
        [dict(zip(sasrec.GRID, v)) for v in itertools.product(*sasrec.GRID.values())],
        sasrec.EPOCHS)
    if args.setting and not args.quick:
        grid = [{"maxlen": sasrec.GRID["maxlen"][0], "dropout": args.setting[1]}]
    epochs = args.epochs or epochs
    best = None
    for setting in grid:
        m = sasrec_run(data, retrieval_cfg, setting, epochs, 0)
        print(f"  sasrec {setting}: best val HR@10 {m['val_hr@10']:.4f} after {m['epoch']} of "
              f"{epochs} epochs ({m['seconds']:.0f} CPU s)", flush=True)
        if best is None or m["val_hr@10"] > best[1]["val_hr@10"]:
            best = (setting, m)
    return best[0], best[1], epochs


def se(values: List[float]) -> float:
    """The standard error of the mean over seeds."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="an interaction log (e.g. ml-100k/u.data)")
    source.add_argument("--dataset", help="a folder `preprocess interactions` wrote")
    parser.add_argument("--name", help="the data's name in the summary (default: the log's "
                        "folder, e.g. ml-100k)")
    parser.add_argument("--positive", default="rating>=4", help="what counts as an engagement")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per model")
    parser.add_argument("--ranks", type=int, default=0,
                        help="gloo ranks of the HSTU runs (0: one process)")
    parser.add_argument("--setting", type=lambda t: tuple(float(x) for x in t.split(",")),
                        help="HSTU_DROPOUT,SASREC_DROPOUT: train these (chosen on another "
                        "log's validation) instead of each grid")
    parser.add_argument("--epochs", type=int, default=0, help="the longest run of each model "
                        f"(default: HSTU {EPOCHS}, SASRec {sasrec.EPOCHS})")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs: one short setting per model, 2 epochs")
    args = parser.parse_args()

    from dlrm_hybrid.config import Config
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    print(f"sequential benchmark on {cpu_name()}; HSTU runs OMP_NUM_THREADS=1 per process, "
          f"SASRec on 1 thread", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data_cfg, name = prepare_data(args, scratch)
        data = open_interactions(data_cfg["path"])
        retrieval_cfg = Config().retrieval
        print(f"data {name}: {data.users} users, {data.items} items, engagements train "
              f"{data.num_samples('train')} / val {data.num_samples('val')} / test "
              f"{data.num_samples('test')}; {data.meta.split_rule}; positive "
              f"{data.meta.positive}; timestamps {data.meta.timestamps}", flush=True)
        print("HSTU grid (seed 0, validation after each epoch):", flush=True)
        hstu_sets, first, epochs = tune_hstu(data_cfg, scratch, args)
        hstu = [first] + [hstu_run(data_cfg, hstu_sets, epochs, seed, scratch, args.ranks,
                                   f"hstu_seed_{seed}") for seed in range(1, args.seeds)]
        print("SASRec-style reference grid (seed 0, validation after each epoch):", flush=True)
        sas_sets, sas_first, sas_epochs = tune_sasrec(data, retrieval_cfg, args)
        sas = [sas_first] + [sasrec_run(data, retrieval_cfg, sas_sets, sas_epochs, seed)
                             for seed in range(1, args.seeds)]
    print(f"\n{name}: {data.users} users, {data.items} items; {data.meta.split_rule}; positive "
          f"{data.meta.positive}; full ranking, each user's earlier items left out; "
          f"{cpu_name()}")
    print(f"HSTU: {words(hstu_sets)} (chosen on validation); SASRec-style reference: "
          f"{sas_sets}")
    print("| seed | model | epoch | val HR@10 | test HR@10 | test NDCG@10 | test HR@50 | "
          "test MRR | train s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for seed, (h, s) in enumerate(zip(hstu, sas)):
        for model, m in (("HSTU", h), ("SASRec-style", s)):
            print(f"| {seed} | {model} | {m['epoch']} | {m['val_hr@10']:.4f} | "
                  f"{m['test_hr@10']:.4f} | {m['test_ndcg@10']:.4f} | {m['test_hr@50']:.4f} | "
                  f"{m['test_mrr']:.4f} | {m['seconds']:.0f} |")
    mean = {f"{model}_{metric}": float(np.mean([m[f"test_{metric}"] for m in runs]))
            for model, runs in (("hstu", hstu), ("sasrec", sas))
            for metric in ("hr@10", "ndcg@10")}
    print(f"sequential: data={name} users={data.users} items={data.items} seeds={args.seeds} "
          + " ".join(f"{k}={v:.4f}" for k, v in mean.items())
          + f" ratio_hr@10={mean['hstu_hr@10'] / mean['sasrec_hr@10']:.3f}"
          f" ratio_ndcg@10={mean['hstu_ndcg@10'] / mean['sasrec_ndcg@10']:.3f}"
          f" hstu_hr@10_se={se([m['test_hr@10'] for m in hstu]):.4f}"
          f" sasrec_hr@10_se={se([m['test_hr@10'] for m in sas]):.4f}"
          f" hstu_sequences_per_s={np.median([m['sequences_per_s'] for m in hstu]):.0f}")


if __name__ == "__main__":
    main()
