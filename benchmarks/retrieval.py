"""Two-tower retrieval against its peers on one interaction log: each loss option, a popularity
baseline and `implicit`'s ALS and BPR, on the same leave-last-out split, scored by one metric.

    .venv/bin/python benchmarks/retrieval.py [--data FILE | --dataset DIR] [--name NAME]
        [--positive 'rating>=4'] [--ranks 2] [--towers all|history] [--quick]

--data: any interaction log `preprocess interactions` reads (MovieLens' u.data, ratings.dat,
ratings.csv, ...); it is preprocessed into a temporary folder (positive = rating >= 4,
leave-last-out per user by timestamp). --dataset: a folder it already wrote. Neither: the
planted log of the default config (data.users x data.items), whose teacher's ranking is the
ceiling.

1. Two-tower hyperparameters: a small grid (GRID: temperature x embedding learning rate, up
   to EPOCHS epochs) trained in one process with the default loss (logQ + accidental hits
   removed); the setting and epoch count with the best VALIDATION recall@10 are chosen.
2. Each loss option (LOSSES, those the config offers) with the chosen hyperparameters, trained
   through the CLI on --ranks gloo ranks (dlrm_hybrid.torchrun); validation metrics and
   samples/s from the run's metrics.jsonl, TEST metrics from `eval --split test`.
3. History towers (HISTORY_TOWERS: the user tower reads the user's last items, mean or causal
   attention, model.user_tower.encoder): each trained once on --ranks ranks with its settings
   (chosen by hand on VALIDATION), evaluated and checkpointed after every epoch; the checkpoint
   of the best validation recall@10 is tested. `--towers history` runs these, the SASRec-style
   reference and the peers only.
4. A SASRec-style reference (Kang & McAuley 2018; benchmarks/sasrec.py): a next-item model
   trained in this process on one thread on each user's training sequence, its setting and
   epoch chosen on VALIDATION (the same split, exclusions and metric code), tested once.
5. Peers on the same training split (dlrm_hybrid/retrieval/peers.py): popularity; ALS and BPR,
   each with a small grid chosen on validation; scored by retrieval/evaluate.py on test.
6. ANN against exact search: the validation-best loss option exported (`export --retrieval
   --index hnsw`); IVF and HNSW (retrieval/index.py's defaults) against exact top-100 for the
   test users' tower vectors, and ms per query (one query per call).

Prints the CPU, a markdown table and last the summary line:

    retrieval: data=NAME users=N items=N two_tower_recall@10=X two_tower_recall@100=X
        history_tower_recall@10=X history_mean_recall@10=X history_attention_recall@10=X
        sasrec_recall@10=X popularity_recall@10=X peer_recall@10=X ann_recall_vs_exact=X

(two_tower: the validation-best loss option; history_tower: the validation-best history
tower; sasrec: the SASRec-style reference; peer: the validation-best of ALS and BPR; ann: HNSW recall@100 against exact. With
`--towers history` the two_tower and ann fields are left out.)
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # when loaded as a module (the tests)

import sasrec  # noqa: E402  (the SASRec-style reference)

BASE = {  # the two-tower model over id features (and the log's side features, where it has any)
    "model": {"kind": "two_tower", "embedding_dim": 64,
              "user_tower": {"mlp": [128, 64]}, "item_tower": {"mlp": [128, 64]}},
    "data": {"global_batch_size": 256},
    "optim": {"embedding": "rowwise_adagrad", "embedding_lr": 0.05, "dense": "adam",
              "dense_lr": 0.001},
    "train": {"progress_bar": False, "tensorboard": False},
    "checkpoint": {"resume": "none"},
}
GRID = {"model.temperature": (0.05, 0.1, 0.2), "optim.embedding_lr": (0.05, 0.2)}
EPOCHS = 30  # the longest training the grid tries; validation after each epoch picks the count
QUICK_GRID = {"model.temperature": (0.1,)}
LOSSES = {  # name -> retrieval settings; each row adds one option to the default (logQ + hits)
    "in-batch softmax": {"logq": False, "remove_accidental_hits": False},
    "+ logQ": {"logq": True, "remove_accidental_hits": False},
    "+ logQ + hits removed (default)": {},
    "+ 1024 uniform negatives": {"uniform_negatives": 1024},
    "+ cross-batch memory 2048": {"cross_batch_memory": 2048},
}
HISTORY_TOWERS = {  # name -> (settings, epochs); settings chosen on validation (benchmarks/README.md)
    "history mean": ({"model.user_tower.encoder": "history_mean",
                      "model.user_tower.history_length": 50, "model.temperature": 0.2}, 10),
    "history attention": ({"model.user_tower.encoder": "history_attention",
                           "model.user_tower.history_length": 20, "model.user_tower.dropout": 0.1,
                           "model.temperature": 0.1}, 6),
}
PEER_GRIDS = {
    "ALS": [{"factors": f, "regularization": r} for f in (32, 64, 128) for r in (0.01, 0.1)],
    "BPR": [{"factors": f, "learning_rate": lr} for f in (32, 64, 128) for lr in (0.01, 0.05)],
}
K_ANN = 100


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def cli(args: List[str], ranks: int = 0) -> str:
    """`python -m dlrm_hybrid ARGS` (under torchrun with `ranks` > 0); its stdout, or exit with
    its error line."""
    launcher = ([sys.executable, "-m", "dlrm_hybrid.torchrun", "--standalone",
                 f"--nproc_per_node={ranks}"] if ranks else [sys.executable])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run = subprocess.run([*launcher, "-m", "dlrm_hybrid", *args], cwd=ROOT, text=True,
                         capture_output=True, env={**env, "OMP_NUM_THREADS": "1"})
    if run.returncode:
        lines = (run.stderr + run.stdout).strip().splitlines() or ["no output"]
        errors = [line for line in lines if line.startswith("error:")]
        sys.exit(f"{' '.join(args[:2])} failed: {(errors or lines)[-1]}")
    return run.stdout


def prepare_data(args, scratch: Path) -> Tuple[Dict[str, object], str]:
    """(the config's data section, the dataset's name)."""
    if args.data:
        folder = scratch / "data"
        cli(["preprocess", "interactions", "--input", args.data, "--output", str(folder),
             "--positive", args.positive])
        return {"path": str(folder)}, args.name or Path(args.data).resolve().parent.name
    if args.dataset:
        return {"path": args.dataset}, args.name or Path(args.dataset).name
    return {}, args.name or "planted"


def write_config(path: Path, data: Dict[str, object], epochs: int, train_samples: int,
                 sets: Dict[str, object], eval_epochs: int = 0) -> int:
    """BASE with `data`, `sets` (dotted keys) and `epochs` of training, evaluated at the end
    (and every `eval_epochs`); returns the steps per epoch."""
    cfg = json.loads(json.dumps(BASE))
    cfg["data"].update(data)
    per_epoch = -(-train_samples // cfg["data"]["global_batch_size"])
    steps = max(1, epochs * per_epoch)
    cfg["train"].update({"max_steps": steps, "eval_every": eval_epochs * per_epoch,
                         "log_every": max(1, steps // 10)})
    for key, value in sets.items():
        section, *rest = key.split(".")
        node = cfg.setdefault(section, {})
        for part in rest[:-1]:
            node = node.setdefault(part, {})
        node[rest[-1]] = value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return per_epoch


def train_two_tower(config: Path, run_dir: Path, ranks: int) -> Tuple[List[dict], dict]:
    """Train through the CLI: (the validation events, {steady samples/s, seconds, step})."""
    start = time.perf_counter()
    cli(["train", "--config", str(config), "--set", f"train.run_dir={run_dir}"], ranks)
    seconds = time.perf_counter() - start
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [e["samples_per_s"] for e in events if "samples_per_s" in e][1:]  # past warm-up
    return [e for e in events if "val_recall@10" in e], {
        "samples_per_s": statistics.median(speeds) if speeds else float("nan"),
        "seconds": seconds, "step": max(e.get("step", 0) for e in events)}


def test_metrics(run_dir: Path, step: int) -> Dict[str, float]:
    """`eval --split test` of the run's last checkpoint: its `eval:` line's numbers."""
    out = cli(["eval", "--checkpoint", str(run_dir / "checkpoints" / f"step_{step}"),
               "--split", "test"])
    line = [x for x in out.splitlines() if x.startswith("eval:")][-1]
    fields = dict(part.split("=", 1) for part in line.split()[1:] if "=" in part)
    return {k: float(v) for k, v in fields.items() if k.startswith("test_")}


def tune_two_tower(data_cfg, train_samples: int, scratch: Path, grid, epochs: int
                   ) -> Tuple[dict, int]:
    """The grid's best setting and epoch count by validation recall@10 (one process, the
    default loss). The learning rates are constant, so one run of `epochs` evaluated after
    every epoch gives every shorter run's result too."""
    best = (-1.0, {}, 0)
    for values in itertools.product(*grid.values()):
        setting = dict(zip(grid, values))
        name = "_".join(str(v) for v in values)
        per_epoch = write_config(scratch / f"grid_{name}.yaml", data_cfg, epochs, train_samples,
                                 setting, eval_epochs=1)
        curve, run = train_two_tower(scratch / f"grid_{name}.yaml", scratch / f"grid_{name}", 0)
        top = max(curve, key=lambda e: e["val_recall@10"])
        best = max(best, (top["val_recall@10"], setting, top["step"] // per_epoch),
                   key=lambda b: b[0])
        print(f"  {setting}: best val recall@10 {top['val_recall@10']:.4f} after "
              f"{top['step'] // per_epoch} epochs (after {epochs}: "
              f"{curve[-1]['val_recall@10']:.4f}; {run['seconds']:.0f} s)", flush=True)
    return best[1], best[2]


def loss_options() -> Dict[str, dict]:
    """LOSSES whose settings the config has."""
    from dlrm_hybrid.config import RetrievalConfig

    offered = {f.name for f in dataclasses.fields(RetrievalConfig)}
    return {name: sets for name, sets in LOSSES.items() if set(sets) <= offered}


def tune_peer(name: str, data, retrieval_cfg, quick: bool = False
              ) -> Tuple[dict, dict, float]:
    """(setting, test metrics, training seconds) of the validation-best setting of a peer (with
    `quick`, of its grid's first setting)."""
    from dlrm_hybrid.retrieval import peers

    fit = {"ALS": peers.als, "BPR": peers.bpr}[name]
    best = None
    for setting in PEER_GRIDS[name][:1] if quick else PEER_GRIDS[name]:
        start = time.perf_counter()
        vectors = fit(data, **setting)
        seconds = time.perf_counter() - start
        val = peers.evaluate_peer(vectors, data, retrieval_cfg, "val")
        if best is None or val["val_recall@10"] > best[1]["val_recall@10"]:
            best = (setting, val, seconds, vectors)
    setting, val, seconds, vectors = best
    return setting, {**val, **peers.evaluate_peer(vectors, data, retrieval_cfg, "test")}, seconds


def ann_vs_exact(run_dir: Path, step: int, scratch: Path, data) -> Dict[str, float]:
    """HNSW and IVF recall@K_ANN against exact search for the test users, and ms per query."""
    from dlrm_hybrid.retrieval.index import (IndexParams, ann_recall, build_index,
                                             query_latency)
    from dlrm_hybrid.serve.retrieve import Retriever

    folder = scratch / "export"
    cli(["export", "--retrieval", "--checkpoint", str(run_dir / "checkpoints" / f"step_{step}"),
         "--out", str(folder), "--index", "hnsw"])
    retriever = Retriever(str(folder))
    users = data.pairs["test"][0]
    queries = retriever.user_vectors(users)
    out = {"hnsw_recall": ann_recall(retriever.index, retriever.item_vectors, queries, K_ANN)}
    for kind in ("flat", "ivf", "hnsw"):
        index = (retriever.index if kind == "hnsw"
                 else build_index(retriever.item_vectors, IndexParams(kind)))
        if kind == "ivf":
            out["ivf_recall"] = ann_recall(index, retriever.item_vectors, queries, K_ANN)
        for q, ms in query_latency(index, queries, K_ANN).items():
            out[f"{kind}_{q}"] = ms
    return out


def history_rows(data_cfg, train_samples: int, scratch: Path, args) -> Tuple[list, dict]:
    """Each history tower trained once on `args.ranks` ranks, a checkpoint and a validation
    after every epoch; the validation-best epoch's checkpoint tested. (table rows, {name:
    metrics})."""
    rows, found = [], {}
    for i, (name, (sets, epochs)) in enumerate(HISTORY_TOWERS.items()):
        epochs = 1 if args.quick else epochs
        config, run_dir = scratch / f"history_{i}.yaml", scratch / f"history_{i}"
        per_epoch = -(-train_samples // BASE["data"]["global_batch_size"])
        write_config(config, data_cfg, epochs, train_samples,
                     {**sets, "checkpoint.every": per_epoch, "checkpoint.keep": epochs},
                     eval_epochs=1)
        curve, run = train_two_tower(config, run_dir, args.ranks)
        best = max(curve, key=lambda e: e["val_recall@10"])
        m = {**best, **run, **test_metrics(run_dir, best["step"])}
        found[name] = m
        setting = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in sets.items())
        rows.append(row(name.replace("history", "history tower,"),
                        f"{setting}, {best['step'] // per_epoch} of {epochs} epochs", m,
                        f"{m['samples_per_s']:,.0f} ({args.ranks} ranks)", m["seconds"]))
        print(f"  {name}: val recall@10 {m['val_recall@10']:.4f} after "
              f"{best['step'] // per_epoch} epochs, test recall@10 {m['test_recall@10']:.4f} "
              f"({m['seconds']:.0f} s)", flush=True)
    return rows, found


def row(model: str, setting: str, m: Dict[str, float], speed: str = "",
        seconds: Optional[float] = None) -> str:
    def get(key: str) -> str:
        return f"{m[key]:.4f}" if key in m else "n/a"

    return (f"| {model} | {setting} | {get('val_recall@10')} | {get('test_recall@10')} | "
            f"{get('test_recall@50')} | {get('test_recall@100')} | {get('test_ndcg@10')} | "
            f"{get('test_mrr')} | {speed} | {'' if seconds is None else f'{seconds:.1f}'} |")


def two_tower_rows(data_cfg, train_samples: int, scratch: Path, args) -> Tuple[list, dict]:
    """Tune on validation, then train each loss option on `args.ranks` ranks and test it;
    (table rows, {loss: (metrics, run folder)})."""
    grid, epochs = (QUICK_GRID, 1) if args.quick else (GRID, EPOCHS)
    print(f"two-tower grid (validation after each of {epochs} epochs, 1 process, default loss):",
          flush=True)
    best, epochs = tune_two_tower(data_cfg, train_samples, scratch, grid, epochs)
    print(f"chosen: {best}, {epochs} epochs; batch {BASE['data']['global_batch_size']}, "
          f"embedding dim {BASE['model']['embedding_dim']}, towers "
          f"{BASE['model']['user_tower']['mlp']}", flush=True)
    rows, tower = [], {}
    for loss, sets in loss_options().items():
        config, run_dir = scratch / f"loss_{len(tower)}.yaml", scratch / f"loss_{len(tower)}"
        write_config(config, data_cfg, epochs, train_samples,
                     {**best, **{f"retrieval.{k}": v for k, v in sets.items()}})
        curve, run = train_two_tower(config, run_dir, args.ranks)
        m = {**curve[-1], **run, **test_metrics(run_dir, run["step"])}
        tower[loss] = (m, run_dir)
        rows.append(row("two-tower", loss, m, f"{m['samples_per_s']:,.0f} ({args.ranks} ranks)",
                        m["seconds"]))
        print(f"  {loss}: val recall@10 {m['val_recall@10']:.4f}, test recall@10 "
              f"{m['test_recall@10']:.4f} ({m['seconds']:.0f} s)", flush=True)
    return rows, tower


def peer_rows(data, retrieval_cfg, quick: bool = False) -> Tuple[list, dict]:
    """Popularity, ALS and BPR (and the planted teacher where the data has one): (table rows,
    {name: test metrics})."""
    from dlrm_hybrid.retrieval import peers

    start = time.perf_counter()
    pop = peers.popularity(data)
    seconds = time.perf_counter() - start
    found = {"popularity": {**peers.evaluate_peer(pop, data, retrieval_cfg, "val"),
                            **peers.evaluate_peer(pop, data, retrieval_cfg, "test")}}
    rows = [row("popularity", "train counts", found["popularity"], "", seconds)]
    for peer in PEER_GRIDS:
        setting, found[peer], seconds = tune_peer(peer, data, retrieval_cfg, quick)
        rows.append(row(f"implicit {peer}", ", ".join(f"{k} {v}" for k, v in setting.items()),
                        found[peer], "", seconds))
    if "test_ceiling_recall@10" in found["popularity"]:
        ceiling = {k.replace("ceiling_", ""): v for k, v in found["popularity"].items()
                   if "ceiling" in k}
        rows.append(row("teacher (ceiling)", "planted", ceiling))
    return rows, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", help="an interaction log (e.g. ml-100k/u.data)")
    source.add_argument("--dataset", help="a folder `preprocess interactions` wrote")
    parser.add_argument("--name", help="the data's name in the summary (default: the log's "
                        "folder, e.g. ml-100k; planted)")
    parser.add_argument("--positive", default="rating>=4", help="what counts as an engagement")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks of the loss runs")
    parser.add_argument("--towers", choices=("all", "history"), default="all",
                        help="history: the history towers and the peers only")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs: one grid point (of each peer too), one "
                        "epoch (SASRec: sasrec.QUICK)")
    args = parser.parse_args()

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import open_dataset
    from dlrm_hybrid.retrieval.index import IndexParams

    print(f"retrieval benchmark on {cpu_name()}; two-tower runs OMP_NUM_THREADS=1 per rank, "
          f"implicit on all cores", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        data_cfg, name = prepare_data(args, scratch)
        write_config(scratch / "base.yaml", data_cfg, 1, 1, {})
        cfg = load_config(str(scratch / "base.yaml"))
        data = open_dataset(cfg.data, cfg.model)
        train_samples, test_users = data.num_samples("train"), data.num_samples("test")
        print(f"data {name}: {data.users} users, {data.items} items, engagements train "
              f"{train_samples} / val {data.num_samples('val')} / test {test_users}; split: "
              f"{data.meta.split_rule}; positive: {data.meta.positive}", flush=True)
        rows, tower = ([], {}) if args.towers == "history" else two_tower_rows(
            data_cfg, train_samples, scratch, args)
        print("history towers (validation after each epoch):", flush=True)
        history, by_history = history_rows(data_cfg, train_samples, scratch, args)
        print("SASRec-style reference (validation after each epoch, 1 thread):", flush=True)
        reference, setting = sasrec.run(data, cfg.retrieval, args.quick)
        history.append(row("SASRec-style reference", setting, reference, "",
                           reference["seconds"]))
        more, found = peer_rows(data, cfg.retrieval, args.quick)
        if tower:
            best_loss = max(tower, key=lambda k: tower[k][0]["val_recall@10"])
            chosen, run_dir = tower[best_loss]
            ann = ann_vs_exact(run_dir, chosen["step"], scratch, data)
    best_peer = max(("ALS", "BPR"), key=lambda k: found[k]["val_recall@10"])
    hnsw, ivf = IndexParams("hnsw"), IndexParams("ivf")
    print(f"\n{name}: {data.users} users, {data.items} items; {data.meta.split_rule}; positive "
          f"{data.meta.positive}; metrics over the whole corpus, each user's earlier items left "
          f"out; {cpu_name()}")
    print("| model | loss / setting | val recall@10 | test recall@10 | test recall@50 | "
          "test recall@100 | test NDCG@10 | test MRR | train samples/s | train s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows + history + more))
    best_history = max(by_history, key=lambda k: by_history[k]["val_recall@10"])
    histories = (f"history_tower_recall@10={by_history[best_history]['test_recall@10']:.4f} "
                 + " ".join(f"{k.replace(' ', '_')}_recall@10={m['test_recall@10']:.4f}"
                            for k, m in by_history.items())
                 + f" sasrec_recall@10={reference['test_recall@10']:.4f}")
    peers = (f"popularity_recall@10={found['popularity']['test_recall@10']:.4f} "
             f"peer_recall@10={found[best_peer]['test_recall@10']:.4f}")
    if not tower:
        print(f"retrieval: data={name} users={data.users} items={data.items} {histories} {peers}")
        return
    print(f"\nANN vs exact top-{K_ANN} ({best_loss}, {test_users} test users, {data.items} "
          f"items): HNSW (M {hnsw.hnsw_m}, efConstruction {hnsw.ef_construction}, efSearch "
          f"{hnsw.ef_search}) recall {ann['hnsw_recall']:.4f}; IVF (round(sqrt(items)) lists, "
          f"nprobe {ivf.nprobe}) recall {ann['ivf_recall']:.4f}; ms per query p50/p99: "
          + ", ".join(f"{kind} {ann[kind + '_p50_ms']:.3f}/{ann[kind + '_p99_ms']:.3f}"
                      for kind in ("flat", "ivf", "hnsw")))
    print(f"retrieval: data={name} users={data.users} items={data.items} "
          f"two_tower_recall@10={chosen['test_recall@10']:.4f} "
          f"two_tower_recall@100={chosen['test_recall@100']:.4f} {histories} {peers} "
          f"ann_recall_vs_exact={ann['hnsw_recall']:.4f}")


if __name__ == "__main__":
    main()
