"""The whole funnel on one interaction log: each candidate source alone, the merged candidates and
the ranked list, against the retrieval peers, on the same leave-last-out test items; and what a
request costs.

    .venv/bin/python benchmarks/recommend.py --data ml-100k/u.data [--name NAME] [--quick]

1. Data: the log's retrieval dataset (`preprocess interactions`, positive = rating >= 4,
   leave-last-out per user); its early retrieval dataset (`--holdout-recent HOLDOUT_RECENT`: each
   user's 10 most recent positives left out too); the ranking dataset (`--labels LABELS
   --ranking-negatives NEGATIVES --holdout` the retrieval dataset `--candidates` the early
   models `--candidate-ratio CANDIDATE_RATIO`: the engagements after the early models' data that
   they retrieve, each with 7 negatives, 5 from the early funnel's candidates, 2 uniform, and the
   candidate features; docs/recommend.md). `--ranker-data uniform`: issue 44's ranking dataset
   instead (4 uniform negatives, no candidate features, pointwise).
2. Models: two-tower models of the retrieval and of the early dataset with benchmarks/
   retrieval.py's BASE and the settings its grid chose on ml-100k (TOWER: the default loss,
   temperature 0.2, table learning rate 0.05, 29 epochs), `export --retrieval` (exact index);
   one multi-task ranker of configs/multitask_demo.yaml per loss of `--losses` (pointwise;
   pairwise and listwise add `model.ranking_loss` over each request of 1 + NEGATIVES rows),
   CANDIDATE_RANKER_STEPS steps (RANKER_STEPS on the uniform dataset), tasks watched, liked,
   disliked as the README trains them, `export`; `pixie build` of each retrieval dataset's
   training split. The first-stage ranker: the first loss's ranker's top TOP_K_LABEL of each
   request of the ranking train split (`predict --top-k-label`), `preprocess first-stage
   --engagements` (with the retrieval training engagements; `--first-stage-labels-only`:
   without), a two-tower model of it as the retrieval one (TOWER, EPOCHS), `export --retrieval`.
   With `--work DIR`, what DIR already holds is reused (delete a part to rebuild it).
3. Requests: for each test user, one `Recommender.recommend_dense` (dlrm_hybrid/serve/
   recommend.py) with history = the user's training items and validation item, every one of
   them excluded; sources PER_SOURCE candidates each, the ranker scoring the RANK_TOP best
   merged, value model VALUE. HR@10 and recall@50 (one relevant item per user: recall@50 =
   HR@50) of each source's list, of the merged list and of the ranked list. Then the
   three-stage funnel (the first loss's ranker): sources THREE_PER_SOURCE each (about 1,000
   merged), the first stage scoring them all, the heavy ranker its best FIRST_STAGE_KEEP.
   Latency: one request at a time, 1 thread, after WARMUP requests; p50/p99 of each stage and
   of the whole request in CPU milliseconds (the thread's own time, `time.thread_time`: the
   machine may be shared), and of the whole request in wall milliseconds.
4. Peers (benchmarks/retrieval.py's): popularity, `implicit` ALS and BPR on the retrieval
   training split, each setting chosen on validation, scored by retrieval/evaluate.py with the
   same exclusions (training and validation items).

Prints the CPU, a markdown table (the first loss's requests; a ranked line for each other
loss) and last the summary line (hr@10_ranked: the first loss's):

    recommend: data=NAME hr@10_pixie=X hr@10_two_tower=X hr@10_history=X hr@10_merged=X
        hr@10_ranked=X hr@10_ranked_pointwise=X hr@10_ranked_pairwise=X
        hr@10_ranked_listwise=X p50_ms=X p99_ms=X p50_cpu_ms=X p99_cpu_ms=X
        hr@10_first_stage=X hr@10_ranked_three_stage=X p50_ms_three_stage=X
        p99_ms_three_stage=X p50_cpu_ms_three_stage=X p99_cpu_ms_three_stage=X
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import retrieval as retrieval_bench  # noqa: E402  (its BASE, cli, peers' grids)

LABELS = "watched,liked:rating>=4,disliked:rating<=2"
NEGATIVES = 7  # per engagement: 1 + 7 rows a request, a divisor of the ranker's batch
CANDIDATE_RATIO = 0.75  # of them from the early funnel's candidates
HOLDOUT_RECENT = 10  # the early retrieval dataset leaves out each user's 10 most recent
LOSSES = ("pointwise", "pairwise", "listwise")
TASKS = "[{name: watched}, {name: liked, head: [16]}, {name: disliked, head: [16]}]"
VALUE = {"watched": 0.5, "liked": 1.0, "disliked": -2.0}
TOWER = {"model.temperature": 0.2, "optim.embedding_lr": 0.05}
EPOCHS = 29  # retrieval.py's grid's choice on ml-100k
RANKER_STEPS = 2000  # configs/multitask_demo.yaml's: the uniform ranking dataset's
# the candidate dataset (about 97k rows) overfits in 2,000 steps of 1,024 (21 epochs; ml-100k
# HR@10 0.118, 300 steps 0.132, 150 steps 0.140): 150 steps, about 1.6 epochs
CANDIDATE_RANKER_STEPS = 150
PER_SOURCE, RANK_TOP = 200, 300
TOP_K_LABEL = 10  # the first stage learns the heavy ranker's top 10 of each request
THREE_PER_SOURCE, FIRST_STAGE_KEEP = 400, 100  # about 1,000 merged; the heavy ranker's 100
STAGES = ("pixie", "two_tower", "history", "merged", "ranked")
THREE_STAGES = ("merged", "first_stage", "ranked")
CUTS = (10, 50)
SOURCES_MS = {"pixie": "pixie", "two_tower": "two_tower", "history": "history",
              "merged": "merge", "first_stage": "first_stage", "ranked": "rank"}  # stage: ms key
WARMUP = 20


def train_tower(args, data: str, scratch: Path, name: str) -> str:
    """The two-tower model of `data` trained and exported (exact index): its folder."""
    cli = retrieval_bench.cli
    if (scratch / name).exists():
        return str(scratch / name)
    train = len(np.load(Path(data) / "train_user.npy"))
    per_epoch = retrieval_bench.write_config(scratch / f"{name}.yaml", {"path": data},
                                             args.epochs, train, TOWER)
    start = time.perf_counter()
    cli(["train", "--config", str(scratch / f"{name}.yaml"), "--set",
         f"train.run_dir={scratch / (name + '_run')}"])
    steps = max(1, args.epochs * per_epoch)
    print(f"  {name}: {args.epochs} epochs ({steps} steps) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    cli(["export", "--retrieval", "--checkpoint", str(scratch / f"{name}_run/checkpoints" /
                                                       f"step_{steps}"),
         "--out", str(scratch / name)])
    return str(scratch / name)


def train_ranker(args, ranking: str, scratch: Path, loss: str) -> str:
    """The multi-task ranker of configs/multitask_demo.yaml on `ranking`, with the ranking
    loss `loss` (pointwise: none), exported: its file."""
    cli, name = retrieval_bench.cli, f"ranker_{loss}"
    if (scratch / f"{name}.pt").exists():
        return str(scratch / f"{name}.pt")
    start = time.perf_counter()
    half = args.ranker_steps // 2
    sets = [f"data.path={ranking}", f"model.tasks={TASKS}", "data.label_missing=0",
            "value_model={" + ", ".join(f"{t}: {w}" for t, w in VALUE.items()) + "}",
            f"train.max_steps={args.ranker_steps}", "train.eval_every=0",
            f"train.log_every={args.ranker_steps}", f"optim.warmup_steps={min(20, half)}",
            f"optim.decay_start_step={half}", f"optim.decay_steps={args.ranker_steps - half}",
            "train.progress_bar=false", "train.tensorboard=false",
            f"train.run_dir={scratch / (name + '_run')}"]
    if loss != "pointwise":
        sets += [f"model.ranking_loss.kind={loss}",
                 f"model.ranking_loss.group={1 + args.negatives}"]
    cli(["train", "--config", str(ROOT / "configs/multitask_demo.yaml"),
         *[a for s in sets for a in ("--set", s)]])
    print(f"  ranker ({loss}): {args.ranker_steps} steps in {time.perf_counter() - start:.0f} s",
          flush=True)
    cli(["export", "--checkpoint", str(scratch / f"{name}_run/checkpoints" /
                                       f"step_{args.ranker_steps}"),
         "--out", str(scratch / f"{name}.pt")])
    return str(scratch / f"{name}.pt")


def build(args, scratch: Path) -> Dict[str, str]:
    """The datasets, the models exported and the graphs: {what: path}; `ranker_<loss>` for
    each of args.losses; `first_stage`, the first-stage ranker. A part `scratch` holds is
    reused."""
    out = {k: str(scratch / k) for k in ("retrieval", "early", "ranking", "graph",
                                         "early_graph")}
    kind = f"top{args.top_k_label}" + ("" if args.first_stage_labels_only else "_engaged")
    out["first_stage_data"] = str(scratch / f"first_stage_data_{kind}")

    def cli(argv: List[str]) -> None:  # each step writes the folder after --output or --out
        made = argv[argv.index("--output" if "--output" in argv else "--out") + 1]
        if not Path(made).exists():
            retrieval_bench.cli(argv)

    cli(["preprocess", "interactions", "--input", args.data, "--output", out["retrieval"],
         "--positive", "rating>=4"])
    ranking = ["preprocess", "interactions", "--input", args.data, "--output", out["ranking"],
               "--labels", LABELS, "--ranking-negatives", str(args.negatives),
               "--holdout", out["retrieval"]]
    if args.ranker_data == "candidates":
        cli(["preprocess", "interactions", "--input", args.data, "--output", out["early"],
             "--positive", "rating>=4", "--holdout-recent", str(args.holdout_recent)])
        early_tower = train_tower(args, out["early"], scratch, "early_tower")
        cli(["pixie", "build", "--data", out["early"], "--out", out["early_graph"]])
        ranking += ["--candidates", f"{early_tower},{out['early_graph']}",
                    "--candidate-ratio", str(args.candidate_ratio)]
    cli(ranking)
    out["tower"] = train_tower(args, out["retrieval"], scratch, "tower")
    for loss in args.losses:
        out[f"ranker_{loss}"] = train_ranker(args, out["ranking"], scratch, loss)
    cli(["pixie", "build", "--data", out["retrieval"], "--out", out["graph"]])
    labels = str(scratch / f"top{args.top_k_label}.txt")
    if not Path(labels).exists():
        retrieval_bench.cli(["predict", "--model", out[f"ranker_{args.losses[0]}"], "--data",
                             out["ranking"], "--split", "train", "--out",
                             str(scratch / "ranking_train_scores.csv"), "--top-k-label",
                             str(args.top_k_label), "--label-out", labels])
    cli(["preprocess", "first-stage", "--retrieval", out["retrieval"], "--ranking",
         out["ranking"], "--labels", labels, "--output", out["first_stage_data"],
         *([] if args.first_stage_labels_only else ["--engagements"])])
    out["first_stage"] = train_tower(args, out["first_stage_data"], scratch, f"first_stage_{kind}")
    return out


def requests(paths: Dict[str, str], users: np.ndarray, val: Dict[int, int], args,
             loss: str, three: bool = False
             ) -> Tuple[List[Dict[str, np.ndarray]], List[float], Dict[str, List[float]]]:
    """Each user's stages, the wall ms of each request, the CPU ms of each stage and of each
    request (`request`; after WARMUP requests);
    `three`: through the first stage (THREE_PER_SOURCE, args.first_stage_keep)."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    settings = RecommendSettings(k=10, per_source=THREE_PER_SOURCE if three else PER_SOURCE,
                                 rank_top=RANK_TOP, value=VALUE,
                                 pixie=PixieParams(steps=args.pixie_steps),
                                 first_stage_keep=args.first_stage_keep)
    rec = Recommender(paths["tower"], paths["graph"], paths[f"ranker_{loss}"], paths["ranking"],
                      settings, paths["first_stage"] if three else None)
    rec.clock = time.thread_time  # the stages' CPU time: other jobs may share the machine

    def ask(user: int):
        seen = rec.retriever.seen(user)
        history = np.concatenate([[val[user]] if user in val else [], seen]).astype(np.int64)
        timeline = None  # a history tower: the training items in time order, then validation's
        if rec.retriever.history_length:
            timeline = np.concatenate([rec.retriever.timeline(user),
                                       [val[user]] if user in val else []]).astype(np.int64)
        return rec.recommend_dense(user, history, np.unique(history), timeline)

    for user in users[:WARMUP]:
        ask(int(user))
    stages, total, per_stage = [], [], {}
    for user in users:
        start, cpu = time.perf_counter(), time.thread_time()
        answer = ask(int(user))
        total.append((time.perf_counter() - start) * 1e3)
        per_stage.setdefault("request", []).append((time.thread_time() - cpu) * 1e3)
        stages.append(answer.stages)
        for stage, ms in answer.ms.items():
            per_stage.setdefault(stage, []).append(ms)
    return stages, total, per_stage


def findable_test(root: Path):
    """(users, items) of the test pairs whose item the user did not engage with in train or
    validation: a re-engagement is never returned (seen items are left out), as the
    evaluation's rule says (docs/retrieval.md)."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    data = open_interactions(str(root))
    indptr, items = data.findable("test", ("train", "val"))
    return np.repeat(np.arange(data.users), np.diff(indptr)), items


def hit_rates(stages: List[Dict[str, np.ndarray]], wanted: np.ndarray,
              names: Tuple[str, ...] = STAGES) -> Dict[str, float]:
    """hr@K of each stage of `names`: the share of users whose test item is in the stage's
    first K."""
    return {f"{stage}_hr@{k}": float(np.mean([item in s[stage][:k]
                                              for s, item in zip(stages, wanted)]))
            for stage in names for k in CUTS}


def peers(retrieval: str, quick: bool) -> Dict[str, Dict[str, float]]:
    """Popularity, ALS and BPR (each setting chosen on validation): their test metrics."""
    from dlrm_hybrid.config import RetrievalConfig
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions
    from dlrm_hybrid.retrieval import peers as peer_models

    data, cfg = open_interactions(retrieval), RetrievalConfig(eval_k=list(CUTS))
    found = {"popularity": peer_models.evaluate_peer(peer_models.popularity(data), data, cfg)}
    if quick:
        retrieval_bench.PEER_GRIDS = {k: v[:1] for k, v in retrieval_bench.PEER_GRIDS.items()}
    for name in retrieval_bench.PEER_GRIDS:
        setting, metrics, _ = retrieval_bench.tune_peer(name, data, cfg)
        found[f"implicit {name} ({', '.join(f'{k} {v}' for k, v in setting.items())})"] = metrics
    return found


def value_text(value: Dict[str, float]) -> str:
    """E.g. 0.5 P(watched) + 1 P(liked) - 2 P(disliked)."""
    text = " ".join(f"{'-' if w < 0 else '+'} {abs(w):g} P({t})" for t, w in value.items())
    return text[2:] if text.startswith("+ ") else text


def summary_line(name: str, hr: Dict[str, float], total_ms: List[float],
                 ranked: Optional[Dict[str, Dict[str, float]]] = None,
                 three: Optional[Tuple[Dict[str, float], List[float], List[float]]] = None,
                 cpu_ms: Optional[List[float]] = None) -> str:
    """The benchmark's last line, for scripts: hr@10_ranked is the first loss's, then each
    loss's as hr@10_ranked_<loss>; the requests' wall p50/p99 (`cpu_ms`: and CPU); `three`
    (the three-stage funnel's hit rates, request wall ms and CPU ms): its first stage's and
    ranked list's hr@10 and its p50/p99."""
    return (f"recommend: data={name} "
            + " ".join(f"hr@10_{stage}={hr[f'{stage}_hr@10']:.4f}" for stage in STAGES)
            + "".join(f" hr@10_ranked_{loss}={h['ranked_hr@10']:.4f}"
                      for loss, h in (ranked or {}).items())
            + f" p50_ms={percentile(total_ms, 50):.2f} p99_ms={percentile(total_ms, 99):.2f}"
            + ("" if cpu_ms is None else f" p50_cpu_ms={percentile(cpu_ms, 50):.2f}"
                                         f" p99_cpu_ms={percentile(cpu_ms, 99):.2f}")
            + ("" if three is None else
               f" hr@10_first_stage={three[0]['first_stage_hr@10']:.4f}"
               f" hr@10_ranked_three_stage={three[0]['ranked_hr@10']:.4f}"
               f" p50_ms_three_stage={percentile(three[1], 50):.2f}"
               f" p99_ms_three_stage={percentile(three[1], 99):.2f}"
               f" p50_cpu_ms_three_stage={percentile(three[2], 50):.2f}"
               f" p99_cpu_ms_three_stage={percentile(three[2], 99):.2f}"))


def percentile(values: List[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an interaction log with ratings and "
                        "timestamps, e.g. ml-100k/u.data")
    parser.add_argument("--name", help="the data's name in the summary (default: the log's "
                        "folder, e.g. ml-100k)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="two-tower training epochs")
    parser.add_argument("--ranker-steps", type=int, help="multi-task ranker steps of 1,024 "
                        f"samples (default {CANDIDATE_RANKER_STEPS}; {RANKER_STEPS} with "
                        f"--ranker-data uniform)")
    parser.add_argument("--pixie-steps", type=int, default=100_000, help="walk steps a request")
    parser.add_argument("--users", type=int, default=0, help="test users to ask (0: all)")
    parser.add_argument("--work", help="build the datasets, models and graph in this new folder "
                        "and keep them (default: a temporary folder)")
    parser.add_argument("--ranker-data", choices=("candidates", "uniform"),
                        default="candidates", help="the ranker's negatives: the early funnel's "
                        "candidates with candidate features (default), or uniform (issue 44's "
                        "baseline: --ranking-negatives 4, pointwise)")
    parser.add_argument("--losses", default=",".join(LOSSES), help="rankers to train and "
                        f"measure, one per ranking loss (default {','.join(LOSSES)})")
    parser.add_argument("--negatives", type=int, default=NEGATIVES, help="--ranking-negatives")
    parser.add_argument("--candidate-ratio", type=float, default=CANDIDATE_RATIO)
    parser.add_argument("--holdout-recent", type=int, default=HOLDOUT_RECENT,
                        help="the early retrieval dataset's --holdout-recent K")
    parser.add_argument("--top-k-label", type=int, default=TOP_K_LABEL, help="the first stage's "
                        "labels: the heavy ranker's top K of each request (predict "
                        f"--top-k-label, default {TOP_K_LABEL})")
    parser.add_argument("--first-stage-labels-only", action="store_true", help="train the "
                        "first stage on the labels alone (default: with the retrieval "
                        "training engagements, `preprocess first-stage --engagements`)")
    parser.add_argument("--first-stage-keep", type=int, default=FIRST_STAGE_KEEP,
                        help="candidates the first stage passes to the heavy ranker "
                             f"(default {FIRST_STAGE_KEEP})")
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 1 epoch, "
                        "30 ranker steps, 10,000 walk steps, 40 users, one peer setting each")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and faiss load
    if args.ranker_steps is None:
        args.ranker_steps = RANKER_STEPS if args.ranker_data == "uniform" else \
            CANDIDATE_RANKER_STEPS
    if args.quick:
        args.epochs, args.ranker_steps, args.pixie_steps = 1, 30, 10_000
        args.users = args.users or 40
    args.losses = [loss.strip() for loss in args.losses.split(",") if loss.strip()]
    if args.ranker_data == "uniform":
        args.losses, args.negatives = ["pointwise"], 4
    if not args.losses or set(args.losses) - set(LOSSES):
        parser.error(f"--losses: some of {','.join(LOSSES)}")
    name = args.name or Path(args.data).resolve().parent.name
    cpu = retrieval_bench.cpu_name()
    print(f"recommend benchmark on {cpu}; training OMP_NUM_THREADS=1, requests 1 thread",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = build(args, work)
        root = Path(paths["retrieval"])
        users, wanted = findable_test(root)
        val = dict(zip(np.load(root / "val_user.npy").tolist(),
                       np.load(root / "val_item.npy").tolist()))
        if args.users:
            users, wanted = users[:args.users], wanted[:args.users]
        ranked = {}
        for n, loss in enumerate(args.losses):
            asked, took, took_per_stage = requests(paths, users, val, args, loss)
            ranked[loss] = hit_rates(asked, wanted)
            if not n:
                stages, total, per_stage = asked, took, took_per_stage
        three_asked, three_total, three_per_stage = requests(paths, users, val, args,
                                                             args.losses[0], three=True)
        found = peers(paths["retrieval"], args.quick)
    hr = hit_rates(stages, wanted)
    three_hr = hit_rates(three_asked, wanted, THREE_STAGES)
    mean = {stage: np.mean([len(s[stage]) for s in stages]) for stage in STAGES}
    what = {"pixie": f"Pixie walk from the history ({args.pixie_steps:,} steps)",
            "two_tower": "two-tower user tower, exact search", "history":
            "history: item-to-item neighbours (max)", "merged": "merged (reciprocal-rank fusion)",
            "ranked": f"ranked: multi-task ranker on the top {RANK_TOP}, value model "
                      f"({args.ranker_data} negatives, {args.losses[0]})"}
    print(f"\n{name}: {len(users)} test users (each user's last positive, rating >= 4); history "
          f"and exclusions: training + validation items; value = "
          + value_text(VALUE) + f"; {cpu}")
    print("| candidates | HR@10 | recall@50 | items per request | CPU ms p50 | CPU ms p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage in STAGES:
        times = per_stage.get(SOURCES_MS[stage], [])
        print(f"| {what[stage]} | {hr[f'{stage}_hr@10']:.4f} | {hr[f'{stage}_hr@50']:.4f} | "
              f"{mean[stage]:.0f} | {percentile(times, 50):.2f} | {percentile(times, 99):.2f} |")
    for loss, h in list(ranked.items())[1:]:
        print(f"| ranked, {loss} loss | {h['ranked_hr@10']:.4f} | {h['ranked_hr@50']:.4f} | | | |")
    for peer, m in found.items():
        print(f"| {peer} | {m['test_hr@10']:.4f} | {m['test_recall@50']:.4f} | | | |")
    print(f"| whole request (one at a time, after {WARMUP} warm-up) | | | | "
          f"{percentile(per_stage['request'], 50):.2f} | "
          f"{percentile(per_stage['request'], 99):.2f} |")
    print(f"| whole request, wall ms | | | | {percentile(total, 50):.2f} | "
          f"{percentile(total, 99):.2f} |")
    print(f"\nThree stages ({args.losses[0]} ranker): sources {THREE_PER_SOURCE} each, the first "
          f"stage (two-tower of the heavy ranker's top {args.top_k_label}) on every merged "
          f"candidate, the heavy ranker on its best {args.first_stage_keep}")
    print("| stage | HR@10 | recall@50 | items per request | CPU ms p50 | CPU ms p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    three_mean = {stage: np.mean([len(s[stage]) for s in three_asked]) for stage in SOURCES_MS}
    for stage, label in SOURCES_MS.items():
        times = three_per_stage.get(label, [])
        hr_cells = (f"{three_hr[f'{stage}_hr@10']:.4f} | {three_hr[f'{stage}_hr@50']:.4f}"
                    if stage in THREE_STAGES else " | ")
        print(f"| {stage} | {hr_cells} | {three_mean[stage]:.0f} | "
              f"{percentile(times, 50):.2f} | {percentile(times, 99):.2f} |")
    for what, times in (("", three_per_stage["request"]), (", wall ms", three_total)):
        print(f"| whole request{what} | | | | {percentile(times, 50):.2f} | "
              f"{percentile(times, 99):.2f} |")
    print(summary_line(name, hr, total, ranked,
                       (three_hr, three_total, three_per_stage["request"]), per_stage["request"]))


if __name__ == "__main__":
    main()
