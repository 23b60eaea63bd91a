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
   multi-task rankers of configs/multitask_demo.yaml, one per loss of `--losses` (pointwise;
   pairwise and listwise add `model.ranking_loss` over each request of 1 + NEGATIVES rows) and
   per step count of `--ranker-steps` (CANDIDATE_RANKER_STEPS; RANKER_STEPS on the uniform
   dataset), tasks watched, liked, disliked as the README trains them, `export`; `pixie build`
   of each retrieval dataset's training split. `--work DIR` keeps them, each named by the
   settings it depends on, and a later run reuses what DIR holds.
3. The choice, on validation only: each user whose validation item is not a training item
   asks with history = the training items (excluded); each ranker orders the same RANK_TOP
   merged candidates with each value model of VALUES; per loss the steps and value model of
   the best validation HR@10 are kept (ties: fewer steps), and the loss best on validation is
   the ranked line. The test users are asked once, with the chosen rankers.
4. Requests: for each test user, one `Recommender.recommend_dense` (dlrm_hybrid/serve/
   recommend.py) with history = the user's training items and validation item, every one of
   them excluded; sources PER_SOURCE candidates each, the ranker scoring the RANK_TOP best
   merged, the chosen value model. HR@10 and recall@50 (one relevant item per user: recall@50
   = HR@50) of each source's list, of the merged list and of the ranked list. Latency: one
   request at a time, 1 thread, after WARMUP requests; p50/p99 of the whole request and of
   each stage.
5. Peers (benchmarks/retrieval.py's): popularity, `implicit` ALS and BPR on the retrieval
   training split, each setting chosen on validation, scored by retrieval/evaluate.py with the
   same exclusions (training and validation items).

Prints the CPU, a markdown table (the requests of the loss best on validation; a ranked line
for each other loss), the validation table of every ranker and value model, and last the
summary line (hr@10_ranked: the loss best on validation):

    recommend: data=NAME hr@10_pixie=X hr@10_two_tower=X hr@10_history=X hr@10_merged=X
        hr@10_ranked=X hr@10_ranked_pointwise=X hr@10_ranked_pairwise=X
        hr@10_ranked_listwise=X p50_ms=X p99_ms=X
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
VALUES = (VALUE, {"liked": 1.0}, {"watched": 1.0})  # the value models validation chooses from
TOWER = {"model.temperature": 0.2, "optim.embedding_lr": 0.05}
EPOCHS = 29  # retrieval.py's grid's choice on ml-100k
RANKER_STEPS = 2000  # configs/multitask_demo.yaml's: the uniform ranking dataset's
# the candidate dataset (about 97k rows): a grid of 1.6 to 12.6 epochs, chosen on validation
# (ml-100k validation HR@10, the best value model: 75 steps 0.127, 150 0.160, 300 0.164,
# 600 0.173, 1,200 0.164, 2,000 0.150; docs/recommend.md)
CANDIDATE_RANKER_STEPS = (150, 300, 600, 1200)
PER_SOURCE, RANK_TOP = 200, 300
STAGES = ("pixie", "two_tower", "history", "merged", "ranked")
CUTS = (10, 50)
WARMUP = 20


def train_tower(args, data: str, scratch: Path, name: str) -> str:
    """The two-tower model of `data` trained and exported (exact index): its folder (kept where
    --work already has it)."""
    cli = retrieval_bench.cli
    if (scratch / name).is_dir():
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


def train_ranker(args, ranking: str, scratch: Path, loss: str, steps: int) -> str:
    """The multi-task ranker of configs/multitask_demo.yaml on `ranking`, with the ranking
    loss `loss` (pointwise: none), `steps` steps, exported: its file (kept where --work already
    has it)."""
    cli, name = retrieval_bench.cli, f"{Path(ranking).name}_{loss}_{steps}"
    if (scratch / f"{name}.pt").is_file():
        return str(scratch / f"{name}.pt")
    start = time.perf_counter()
    half = steps // 2
    sets = [f"data.path={ranking}", f"model.tasks={TASKS}", "data.label_missing=0",
            "value_model={" + ", ".join(f"{t}: {w}" for t, w in VALUE.items()) + "}",
            f"train.max_steps={steps}", "train.eval_every=0", f"train.log_every={steps}",
            f"optim.warmup_steps={min(20, half)}", f"optim.decay_start_step={half}",
            f"optim.decay_steps={steps - half}", "train.progress_bar=false",
            "train.tensorboard=false", f"train.run_dir={scratch / (name + '_run')}"]
    if loss != "pointwise":
        sets += [f"model.ranking_loss.kind={loss}",
                 f"model.ranking_loss.group={1 + args.negatives}"]
    cli(["train", "--config", str(ROOT / "configs/multitask_demo.yaml"),
         *[a for s in sets for a in ("--set", s)]])
    print(f"  ranker ({loss}): {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    cli(["export", "--checkpoint", str(scratch / f"{name}_run/checkpoints" / f"step_{steps}"),
         "--out", str(scratch / f"{name}.pt")])
    return str(scratch / f"{name}.pt")


def build(args, scratch: Path) -> Dict[str, str]:
    """The datasets, the models exported and the graphs: {what: path}; `ranker_<loss>_<steps>`
    for each of args.losses and args.ranker_steps. Each is named by the settings it depends on
    and kept where `scratch` (--work) already has it, so a second run with other ranker
    settings makes only what they change."""
    cli, k = retrieval_bench.cli, args.holdout_recent
    kind = (f"{k}_e{args.epochs}_{args.negatives}_{args.candidate_ratio:g}"
            if args.ranker_data == "candidates"
            else f"uniform_{args.negatives}")
    out = {name: str(scratch / folder) for name, folder in (
        ("retrieval", "retrieval"), ("early", f"early_{k}"), ("ranking", f"ranking_{kind}"),
        ("graph", "graph"), ("early_graph", f"early_graph_{k}"))}

    def make(what: str, command: List[str], done: str) -> None:
        if not (Path(out[what]) / done).is_file():
            cli(command)

    make("retrieval", ["preprocess", "interactions", "--input", args.data, "--output",
                       out["retrieval"], "--positive", "rating>=4"], "interactions.yaml")
    ranking = ["preprocess", "interactions", "--input", args.data, "--output", out["ranking"],
               "--labels", LABELS, "--ranking-negatives", str(args.negatives),
               "--holdout", out["retrieval"]]
    if args.ranker_data == "candidates":
        make("early", ["preprocess", "interactions", "--input", args.data, "--output",
                       out["early"], "--positive", "rating>=4", "--holdout-recent", str(k)],
             "interactions.yaml")
        early_tower = train_tower(args, out["early"], scratch, f"early_tower_{k}_e{args.epochs}")
        make("early_graph", ["pixie", "build", "--data", out["early"], "--out",
                             out["early_graph"]], "graph.yaml")
        ranking += ["--candidates", f"{early_tower},{out['early_graph']}",
                    "--candidate-ratio", str(args.candidate_ratio)]
    make("ranking", ranking, "feature_spec.yaml")
    out["tower"] = train_tower(args, out["retrieval"], scratch, f"tower_e{args.epochs}")
    for loss in args.losses:
        for steps in args.ranker_steps:
            out[f"ranker_{loss}_{steps}"] = train_ranker(args, out["ranking"], scratch, loss,
                                                         steps)
    make("graph", ["pixie", "build", "--data", out["retrieval"], "--out", out["graph"]],
         "graph.yaml")
    return out


def requests(paths: Dict[str, str], users: np.ndarray, val: Dict[int, int], args,
             loss: str, value: Dict[str, float]) -> Tuple[List[Dict[str, np.ndarray]], List[float], Dict[str, List[float]]]:
    """Each user's stages, the ms of each request and of each stage (after WARMUP requests)."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    settings = RecommendSettings(k=10, per_source=PER_SOURCE, rank_top=RANK_TOP, value=value,
                                 pixie=PixieParams(steps=args.pixie_steps))
    rec = Recommender(paths["tower"], paths["graph"], paths[f"ranker_{loss}"], paths["ranking"],
                      settings)

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
        start = time.perf_counter()
        answer = ask(int(user))
        total.append((time.perf_counter() - start) * 1e3)
        stages.append(answer.stages)
        for stage, ms in answer.ms.items():
            per_stage.setdefault(stage, []).append(ms)
    return stages, total, per_stage


def validation_hr(paths: Dict[str, str], root: Path, args
                  ) -> Dict[Tuple[str, int, int], float]:
    """HR@10 on the validation items of each ranker of args.losses x args.ranker_steps with
    each value model of VALUES (key: loss, steps, the value model's place in VALUES): each user
    whose validation item is findable asks with history = the training items (those excluded),
    as the test requests ask with the validation item added. The sources and the merge are
    computed once per user; each ranker orders the same RANK_TOP merged items."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.candidate_sources import SOURCES
    from dlrm_hybrid.serve.rank_fusion import merge
    from dlrm_hybrid.serve.recommend_inputs import open_ranker, value_model_weights
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    users, wanted = findable(root, "val", ("train",))
    if args.val_users:
        users, wanted = users[:args.val_users], wanted[:args.val_users]
    settings = RecommendSettings(k=10, per_source=PER_SOURCE, rank_top=RANK_TOP, value=VALUE,
                                 pixie=PixieParams(steps=args.pixie_steps))
    keys = [(loss, steps) for loss in args.losses for steps in args.ranker_steps]
    rec = Recommender(paths["tower"], paths["graph"], paths[f"ranker_{keys[0][0]}_{keys[0][1]}"],
                      paths["ranking"], settings)
    asked = []
    for user in users.tolist():
        seen = rec.retriever.seen(user)
        timeline = rec.retriever.timeline(user) if rec.retriever.history_length else None
        lists = {s: rec.sources.source(s, user, seen, seen, timeline) for s in SOURCES}
        asked.append((user, merge({s: lists[s][0] for s in SOURCES})[0][:RANK_TOP], lists))
    found = {}
    for loss, steps in keys:
        rec.ranker, description = open_ranker(paths[f"ranker_{loss}_{steps}"])
        for v, value in enumerate(VALUES):
            rec.weights = value_model_weights(value, rec.tasks, description)
            found[loss, steps, v] = float(np.mean([
                item in rec._rank(user, merged, lists)[0][:10]
                for (user, merged, lists), item in zip(asked, wanted)]))
    return found


def choose(on_val: Dict[Tuple[str, int, int], float]) -> Dict[str, Tuple[int, int]]:
    """Per loss, the (steps, value model) of the best validation HR@10 (ties: fewer steps, then
    VALUES order); the loss best on validation first."""
    chosen = {}
    for (loss, steps, value), hr in on_val.items():
        best = chosen.get(loss)
        if best is None or (hr, -steps, -value) > (on_val[(loss, *best)], -best[0], -best[1]):
            chosen[loss] = (steps, value)
    return dict(sorted(chosen.items(), key=lambda kv: -on_val[(kv[0], *kv[1])]))


def findable(root: Path, split: str, earlier: Tuple[str, ...]):
    """(users, items) of `split`'s pairs whose item the user did not engage with in the
    `earlier` splits: a re-engagement is never returned (seen items are left out), as the
    evaluation's rule says (docs/retrieval.md)."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    data = open_interactions(str(root))
    indptr, items = data.findable(split, earlier)
    return np.repeat(np.arange(data.users), np.diff(indptr)), items


def hit_rates(stages: List[Dict[str, np.ndarray]], wanted: np.ndarray) -> Dict[str, float]:
    """hr@K of each stage: the share of users whose test item is in the stage's first K."""
    return {f"{stage}_hr@{k}": float(np.mean([item in s[stage][:k]
                                              for s, item in zip(stages, wanted)]))
            for stage in STAGES for k in CUTS}


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
                 ranked: Optional[Dict[str, Dict[str, float]]] = None) -> str:
    """The benchmark's last line, for scripts: hr@10_ranked is the first loss's, then each
    loss's as hr@10_ranked_<loss>."""
    return (f"recommend: data={name} "
            + " ".join(f"hr@10_{stage}={hr[f'{stage}_hr@10']:.4f}" for stage in STAGES)
            + "".join(f" hr@10_ranked_{loss}={h['ranked_hr@10']:.4f}"
                      for loss, h in (ranked or {}).items())
            + f" p50_ms={percentile(total_ms, 50):.2f} p99_ms={percentile(total_ms, 99):.2f}")


def percentile(values: List[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an interaction log with ratings and "
                        "timestamps, e.g. ml-100k/u.data")
    parser.add_argument("--name", help="the data's name in the summary (default: the log's "
                        "folder, e.g. ml-100k)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="two-tower training epochs")
    parser.add_argument("--ranker-steps", help="multi-task ranker steps of 1,024 samples, "
                        "comma-separated: one ranker each, the best on validation kept (default "
                        f"{','.join(map(str, CANDIDATE_RANKER_STEPS))}; {RANKER_STEPS} with "
                        "--ranker-data uniform)")
    parser.add_argument("--pixie-steps", type=int, default=100_000, help="walk steps a request")
    parser.add_argument("--users", type=int, default=0, help="test users to ask (0: all)")
    parser.add_argument("--val-users", type=int, default=0, help="validation users that choose "
                        "the ranker (0: all)")
    parser.add_argument("--work", help="build the datasets, models and graph in this folder and "
                        "keep them; what it already holds (named by its settings) is reused "
                        "(default: a temporary folder)")
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
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 1 epoch, "
                        "10 and 30 ranker steps, 10,000 walk steps, 40 test and 40 validation "
                        "users, one peer setting each")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and faiss load
    if args.ranker_steps is None:
        args.ranker_steps = str(RANKER_STEPS) if args.ranker_data == "uniform" else \
            ",".join(map(str, CANDIDATE_RANKER_STEPS))
    try:
        args.ranker_steps = sorted({int(s) for s in args.ranker_steps.split(",") if s.strip()})
    except ValueError:
        parser.error(f"--ranker-steps: {args.ranker_steps!r}; give step counts, e.g. 75,150")
    if not args.ranker_steps or min(args.ranker_steps) < 2:
        parser.error("--ranker-steps: give step counts of 2 or more")
    if args.quick:
        args.epochs, args.ranker_steps, args.pixie_steps = 1, [10, 30], 10_000
        args.users, args.val_users = args.users or 40, args.val_users or 40
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
        users, wanted = findable(root, "test", ("train", "val"))
        val = dict(zip(np.load(root / "val_user.npy").tolist(),
                       np.load(root / "val_item.npy").tolist()))
        if args.users:
            users, wanted = users[:args.users], wanted[:args.users]
        on_val = validation_hr(paths, root, args)
        chosen = choose(on_val)
        args.losses = list(chosen)
        ranked = {}
        for n, loss in enumerate(args.losses):
            paths[f"ranker_{loss}"] = paths[f"ranker_{loss}_{chosen[loss][0]}"]
            asked, took, took_per_stage = requests(paths, users, val, args, loss,
                                                   VALUES[chosen[loss][1]])
            ranked[loss] = hit_rates(asked, wanted)
            if not n:
                stages, total, per_stage = asked, took, took_per_stage
        found = peers(paths["retrieval"], args.quick)
    hr = hit_rates(stages, wanted)
    mean = {stage: np.mean([len(s[stage]) for s in stages]) for stage in STAGES}
    stage_ms = {"pixie": "pixie", "two_tower": "two_tower", "history": "history",
                "merged": "merge", "ranked": "rank"}
    what = {"pixie": f"Pixie walk from the history ({args.pixie_steps:,} steps)",
            "two_tower": "two-tower user tower, exact search", "history":
            "history: item-to-item neighbours (max)", "merged": "merged (reciprocal-rank fusion)",
            "ranked": f"ranked: multi-task ranker on the top {RANK_TOP}, value model "
                      f"({args.ranker_data} negatives, {args.losses[0]}, "
                      f"{chosen[args.losses[0]][0]} steps)"}
    print(f"\n{name}: {len(users)} test users (each user's last positive, rating >= 4); history "
          f"and exclusions: training + validation items; value = "
          + value_text(VALUES[chosen[args.losses[0]][1]]) + f"; {cpu}")
    print("| candidates | HR@10 | recall@50 | items per request | ms p50 | ms p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage in STAGES:
        times = per_stage.get(stage_ms[stage], [])
        print(f"| {what[stage]} | {hr[f'{stage}_hr@10']:.4f} | {hr[f'{stage}_hr@50']:.4f} | "
              f"{mean[stage]:.0f} | {percentile(times, 50):.2f} | {percentile(times, 99):.2f} |")
    for loss, h in list(ranked.items())[1:]:
        print(f"| ranked, {loss} loss, {chosen[loss][0]} steps, value "
              f"{value_text(VALUES[chosen[loss][1]])} | {h['ranked_hr@10']:.4f} | "
              f"{h['ranked_hr@50']:.4f} | | | |")
    for peer, m in found.items():
        print(f"| {peer} | {m['test_hr@10']:.4f} | {m['test_recall@50']:.4f} | | | |")
    print(f"| whole request (one at a time, after {WARMUP} warm-up) | | | | "
          f"{percentile(total, 50):.2f} | {percentile(total, 99):.2f} |")
    print("\nvalidation HR@10 of each ranker (loss, steps) and value model: the best chosen")
    print("| loss | steps | " + " | ".join(value_text(v) for v in VALUES) + " |")
    print("|---|---:|" + "---:|" * len(VALUES))
    for loss in args.losses:
        for steps in args.ranker_steps:
            print(f"| {loss} | {steps} | " + " | ".join(
                f"{on_val[loss, steps, v]:.4f}" for v in range(len(VALUES))) + " |")
    print(summary_line(name, hr, total, ranked))


if __name__ == "__main__":
    main()
