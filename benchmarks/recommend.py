"""The whole funnel on one interaction log: each candidate source alone, the merged candidates and
the ranked list, against the retrieval peers, on the same leave-last-out test items; the
three-stage funnel with a first-stage ranker; and what a request costs.

    .venv/bin/python benchmarks/recommend.py --data ml-100k/u.data [--name NAME] [--quick]

1. Data: the log's retrieval dataset (`preprocess interactions`, positive = rating >= 4,
   leave-last-out per user); its early retrieval dataset (`--holdout-recent HOLDOUT_RECENT`: each
   user's 10 most recent positives left out too); the ranking dataset (`--labels LABELS
   --ranking-negatives NEGATIVES --holdout` the retrieval dataset `--candidates` the early
   models `--candidate-ratio CANDIDATE_RATIO`: the engagements after the early models' data that
   they retrieve, each with 15 negatives, 11 from the early funnel's candidates, 4 uniform, and
   the candidate features; docs/recommend.md). `--ranker-data uniform`: issue 44's ranking dataset
   instead (4 uniform negatives, no candidate features, pointwise).
2. Models (benchmarks/recommend_build.py builds them and the first stage): two-tower models of
   the retrieval and of the early dataset with benchmarks/retrieval.py's BASE and the settings
   its grid chose on ml-100k (TOWER: the default loss, temperature 0.2, table learning rate
   0.05, 29 epochs), `export --retrieval` (exact index);
   multi-task rankers of configs/multitask_demo.yaml, one per loss of `--losses` (pointwise;
   pairwise and listwise add `model.ranking_loss` over each request of 1 + NEGATIVES rows) and
   per step count of `--ranker-steps` (CANDIDATE_RANKER_STEPS; RANKER_STEPS on the uniform
   dataset), tasks watched, liked, disliked as the README trains them, `export`; `pixie build`
   of each retrieval dataset's training split. `--work DIR` keeps them, each named by the
   settings it depends on, in a folder named by the log's bytes (recommend_build.log_folder),
   and a later run on the same log reuses what DIR holds.
3. The choice, on validation only, in a validation world: the log without each user's test
   item and later rows (recommend_build.validation_log), built as in 1-2 in DIR/validation_world,
   so its test item is the real validation item and its towers, graph, candidate models and
   rankers stop before it exactly as the test world's stop before the test item (issue 44: the
   test world's rankers train on rows after the validation item, which made validation
   optimistic). Each of its test users asks as a test request asks (history = training and
   validation items, excluded). benchmarks/recommend_choice.py, with the package's choice
   (dlrm_hybrid/serve/funnel_tuning.py, behind `recommend-tune`): the merge's source weights
   (funnel_tuning.FUSION_GRID each, the largest 1) by the one-standard-error rule (the fewest
   weighted sources within one standard error of the best: a source earns weight only where
   validation shows more than noise); each ranker orders the same RANK_TOP merged candidates
   with each value model of VALUES and each weight of the merged order beside its own (PRIORS,
   `recommend --rank-prior`, inf: keep the merged order); per loss the steps and value model of
   the best HR@10 on half the validation users are kept (ties: fewer steps), with the largest
   prior within one standard error of the best on the other half (funnel_tuning.halves: a
   stage reorders only where users its setting was not picked on show more than noise), and
   the loss best on the picking half is the ranked line and the heavy ranker of the
   three-stage funnel; the test world's ranker of those settings serves.
4. The first-stage ranker, of that chosen heavy ranker (loss, steps, value model): its top
   `--top-k-label` (TOP_K_LABEL) of each request of the ranking train split (`predict
   --top-k-label`, with `--value` the chosen value model), `preprocess first-stage
   --engagements` (the retrieval training engagements beside those labels;
   `--first-stage-labels-only`: without), a two-tower model of it as the retrieval one
   (TOWER, EPOCHS), `export --retrieval`; each part named by the ranker, value model, K and
   labels-only or engaged it depends on, so --work keeps and reuses it too. The validation
   world builds its own of its chosen ranker, which chooses, each by the same rule on the
   judging half and on what it delivers in the three-stage funnel, the first stage's weight of
   the merged order (PRIORS, `recommend --first-stage-prior`) by the held-out item among the
   `--first-stage-keep` it hands on, then the heavy ranker's weight of the first stage's list
   by HR@10 of the funnel's ranked list.
5. Requests, only now asking the test users, with the chosen rankers: for each, one
   `Recommender.recommend_dense` (dlrm_hybrid/serve/recommend.py) with history = the user's
   training items and validation item, every one of them excluded; sources PER_SOURCE
   candidates each, merged with the chosen weights, each loss's chosen ranker scoring the
   RANK_TOP best merged with its chosen value model and prior. HR@10 and recall@50 (one
   relevant item per user: recall@50 = HR@50) of each source's list, of the merged list and of
   the ranked list. Then the three-stage funnel (the chosen heavy ranker of the best loss and
   its value model): sources THREE_PER_SOURCE each (645 merged on ml-100k), the first stage
   scoring them all (with its chosen prior), the heavy ranker its best `--first-stage-keep`
   (FIRST_STAGE_KEEP) with the prior chosen for it in that funnel. Latency: one request at a
   time, 1 thread, after WARMUP requests; p50/p99 of each stage and of the whole request in CPU
   milliseconds (the thread's own time, `time.thread_time`: the machine may be shared), and of
   the whole request in wall milliseconds.
6. Peers (benchmarks/retrieval.py's): popularity, `implicit` ALS and BPR on the retrieval
   training split, each setting chosen on validation, scored by retrieval/evaluate.py with the
   same exclusions (training and validation items).

Prints the CPU, a markdown table (the requests of the loss best on validation; a ranked line
for each other loss), the three-stage table, the validation table of every ranker and value
model, and last the summary line (hr@10_ranked: the loss best on validation; p50_ms, p99_ms:
wall; the losses in their validation order):

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

import recommend_build  # noqa: E402  (build, build_first_stage)
import recommend_choice  # noqa: E402  (validation_hr, three_stage)
import retrieval as retrieval_bench  # noqa: E402  (cli, peers' grids)
from recommend_build import asked_history  # noqa: E402
from recommend_choice import PER_SOURCE, RANK_TOP, THREE_PER_SOURCE, VALUES  # noqa: E402

from dlrm_hybrid.serve.funnel_tuning import PRIORS, choose  # noqa: E402

# Per engagement: 1 + 15 rows a request, a divisor of the ranker's batch. Chosen in ml-100k's
# validation world (2026-11-28, train negatives no longer marking the evaluation items): its
# best ranker 0.1777 with 15, 0.1713 with 7, 0.1723 with 7 and --holdout-recent 20.
NEGATIVES = 15
CANDIDATE_RATIO = 0.75  # of them from the early funnel's candidates
HOLDOUT_RECENT = 10  # the early retrieval dataset leaves out each user's 10 most recent
LOSSES = ("pointwise", "pairwise", "listwise")
EPOCHS = 29  # retrieval.py's grid's choice on ml-100k
HSTU_EPOCHS = 20  # --tower hstu: sequential.py's validation choice on ml-100k (19-24 epochs)
RANKER_STEPS = 2000  # configs/multitask_demo.yaml's: the uniform ranking dataset's
# the candidate dataset (about 97k rows): a grid of 1.6 to 12.6 epochs, chosen on validation
# (ml-100k's validation world with the similarity features, listwise, the best value model:
# 150 steps 0.173, 300 0.165, 600 0.157, 1,200 0.128; docs/recommend.md)
CANDIDATE_RANKER_STEPS = (150, 300, 600, 1200)
TOP_K_LABEL = 10  # the first stage learns the heavy ranker's top 10 of each request
FIRST_STAGE_KEEP = 100  # the heavy ranker's candidates in the three-stage funnel
STAGES = ("pixie", "two_tower", "history", "merged", "ranked")
THREE_STAGES = ("merged", "first_stage", "ranked")
CUTS = (10, 50)
SOURCES_MS = {"pixie": "pixie", "two_tower": "two_tower", "history": "history",
              "merged": "merge", "first_stage": "first_stage", "ranked": "rank"}  # stage: ms key
WARMUP = 20


def requests(paths: Dict[str, str], users: np.ndarray, val: Dict[int, int], args,
             loss: str, value: Dict[str, float], chosen: Dict[str, object], three: bool = False
             ) -> Tuple[List[Dict[str, np.ndarray]], List[float], Dict[str, List[float]]]:
    """Each user's stages, the wall ms of each request, the CPU ms of each stage and of each
    request (`request`; after WARMUP requests), with `loss`'s ranker, the value model `value`
    and what validation chose (`chosen`: fusion, rank_prior, first_stage_prior); `three`:
    through the first stage (THREE_PER_SOURCE, args.first_stage_keep)."""
    import torch

    from dlrm_hybrid.data.interactions.interaction_data import open_interactions
    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.funnel_tuning import request_times
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    settings = RecommendSettings(k=10, per_source=THREE_PER_SOURCE if three else PER_SOURCE,
                                 rank_top=RANK_TOP, value=value,
                                 pixie=PixieParams(steps=args.pixie_steps),
                                 first_stage_keep=args.first_stage_keep, **chosen)
    rec = Recommender(paths["tower"], paths["graph"], paths[f"ranker_{loss}"], paths["ranking"],
                      settings, paths["first_stage"] if three else None)
    rec.clock = time.thread_time  # the stages' CPU time: other jobs may share the machine

    when = request_times(open_interactions(paths["retrieval"]), "test")

    def ask(user: int):  # made at its test item's time: a sequence ranker reads what came before
        history, timeline = asked_history(rec, user, val)
        return rec.recommend_dense(user, history, np.unique(history), timeline,
                                   None if when is None else float(when[user]))

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


def prior_text(prior: float) -> str:
    """A stage's weight of the order it was handed: inf reads "keep" (the handed order)."""
    return "keep" if np.isinf(prior) else f"{prior:g}"


def weights_text(weights: Dict[str, float]) -> str:
    """E.g. two_tower 1, history 0.25, pixie 0."""
    return ", ".join(f"{source} {w:g}" for source, w in weights.items())


def validation_tables(on_val, args, choices: Dict[str, Tuple[int, int, float]], three,
                      best: str) -> None:
    """What the validation world chose from: the merge weights (the best five, equal weights,
    the choice), each ranker's and value model's best prior (the chosen settings' prior
    marked), the three-stage funnel's priors (`three`, funnel_tuning.Evaluation: the first
    stage's, by the held-out item among its kept; the heavy ranker's `best`, against them)."""
    from dlrm_hybrid.serve.candidate_sources import SOURCES

    print("\nvalidation HR@10 (the validation world's test items: each user's validation item, "
          "models of the log before it), the choices marked *")
    print("| merge weights (" + ", ".join(SOURCES) + ") | HR@10 |\n|---|---:|")
    shown = sorted(on_val.fusion_hr, key=lambda w: -on_val.fusion_hr[w])[:5]
    chosen = tuple(on_val.fusion.values())
    for w in dict.fromkeys([*shown, (1.0,) * len(SOURCES), chosen]):
        print(f"| {', '.join(f'{x:g}' for x in w)}{' *' if w == chosen else ''} | "
              f"{on_val.fusion_hr[w]:.4f} |")
    print(f"\nrankers (keeping the merged order: {on_val.merged:.4f})")
    print("\n| loss | steps | " + " | ".join(value_text(v) for v in VALUES) + " |")
    print("|---|---:|" + "---:|" * len(VALUES))
    for loss in args.losses:
        for steps in args.ranker_steps:
            cells = []
            for v in range(len(VALUES)):
                hr = {p: on_val.hits[loss, steps, v, p].mean() for p in PRIORS}
                prior = max(PRIORS, key=lambda p: (hr[p], -p))
                mark = (f"; chosen {prior_text(choices[loss][2])} *"
                        if choices[loss][:2] == (steps, v) else "")
                cells.append(f"{hr[prior]:.4f} (prior {prior_text(prior)}; 0: {hr[0.0]:.4f}"
                             f"{mark})")
            print(f"| {loss} | {steps} | " + " | ".join(cells) + " |")
    three_prior = choose(three.found)[best][2]
    print("\n| three stages: the handed order's weight | " + " | ".join(
        prior_text(p) for p in PRIORS) + " |\n|---|" + "---:|" * len(PRIORS))
    for name, found, chosen in (
            (f"first stage (the merged order's): held-out item among its {args.first_stage_keep}",
             three.first_found, three.first_stage_prior),
            ("heavy ranker (the first stage's): HR@10",
             {p: three.found[best, choices[best][0], 0, p] for p in PRIORS}, three_prior)):
        print(f"| {name} | " + " | ".join(f"{found[p].mean():.4f}" + (" *" if p == chosen else "")
                                          for p in PRIORS) + " |")


def percentile(values: List[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an interaction log with ratings and "
                        "timestamps, e.g. ml-100k/u.data")
    parser.add_argument("--name", help="the data's name in the summary (default: the log's "
                        "folder, e.g. ml-100k)")
    parser.add_argument("--epochs", type=int, default=EPOCHS, help="two-tower training epochs")
    parser.add_argument("--tower", choices=("two_tower", "hstu"), default="two_tower",
                        help="the retrieval model (the two_tower source, the history source's "
                        "item vectors, the early model of the candidate features): the "
                        "two-tower model, or the sequence model (HSTU, "
                        "recommend_build.HSTU_FUNNEL)")
    parser.add_argument("--hstu-epochs", type=int, default=HSTU_EPOCHS,
                        help=f"--tower hstu: training epochs (default {HSTU_EPOCHS})")
    parser.add_argument("--ranker-steps", help="multi-task ranker steps of 1,024 samples, "
                        "comma-separated: one ranker each, the best on validation kept (default "
                        f"{','.join(map(str, CANDIDATE_RANKER_STEPS))}; {RANKER_STEPS} with "
                        "--ranker-data uniform)")
    parser.add_argument("--ranker-history", type=int, default=0, metavar="L",
                        help="rankers with the sequence feature (model.sequence=hstu) over each "
                        "row's last L engagements (the ranking dataset made with --history L); "
                        "0: without (default)")
    parser.add_argument("--pixie-steps", type=int, default=100_000, help="walk steps a request")
    parser.add_argument("--users", type=int, default=0, help="test users to ask (0: all)")
    parser.add_argument("--val-users", type=int, default=0, help="validation users that choose "
                        "the ranker (0: all)")
    parser.add_argument("--work", help="build the datasets, models and graph in this folder and "
                        "keep them; what it already holds of this log (named by its bytes "
                        "and the settings) is reused (default: a temporary folder)")
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
                        "labels: the chosen heavy ranker's top K of each request (predict "
                        f"--top-k-label, default {TOP_K_LABEL})")
    parser.add_argument("--first-stage-labels-only", action="store_true", help="train the "
                        "first stage on the labels alone (default: with the retrieval "
                        "training engagements, `preprocess first-stage --engagements`)")
    parser.add_argument("--first-stage-keep", type=int, default=FIRST_STAGE_KEEP,
                        help="candidates the first stage passes to the heavy ranker "
                             f"(default {FIRST_STAGE_KEEP})")
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 1 epoch, "
                        "10 and 30 ranker steps, 10,000 walk steps, 40 test and 40 validation "
                        "users, one peer setting each")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and faiss load
    # absolute: the commands it runs start in the checkout's root
    args.data = str(Path(args.data).resolve())
    args.work = args.work and str(Path(args.work).resolve())
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
        args.hstu_epochs = 1
        args.users, args.val_users = args.users or 40, args.val_users or 40
    args.losses = [loss.strip() for loss in args.losses.split(",") if loss.strip()]
    if args.ranker_data == "uniform":
        args.losses, args.negatives = ["pointwise"], 4
    if not args.losses or set(args.losses) - set(LOSSES):
        parser.error(f"--losses: some of {','.join(LOSSES)}")
    name = args.name or Path(args.data).resolve().parent.name
    cpu = retrieval_bench.cpu_name()
    print(f"recommend benchmark on {cpu}; retrieval model {args.tower}; training "
          f"OMP_NUM_THREADS=1, requests 1 thread", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = recommend_build.build(args, work)
        users, wanted, val = recommend_choice.test_users(paths["retrieval"], args.users)
        world = work / "validation_world"
        world_paths = recommend_build.build(args, world,
                                            recommend_build.validation_log(args.data, world))
        on_val = recommend_choice.validation_hr(world_paths, args)
        chosen = choose(on_val.hits)
        args.losses = list(chosen)
        for loss in args.losses:
            paths[f"ranker_{loss}"] = paths[f"ranker_{loss}_{chosen[loss][0]}"]
        best, value = args.losses[0], VALUES[chosen[args.losses[0]][1]]
        world_ranker = world_paths[f"ranker_{best}_{chosen[best][0]}"]
        three_val = recommend_choice.three_stage(
            world_paths, (best, chosen[best][0]), world_ranker,
            recommend_build.build_first_stage(args, world, world_paths, world_ranker, value),
            args, on_val.fusion, value)
        first_prior = three_val.first_stage_prior
        three_prior = choose(three_val.found)[best][2]
        paths["first_stage"] = recommend_build.build_first_stage(
            args, work, paths, paths[f"ranker_{best}"], value)
        ranked = {}
        for n, loss in enumerate(args.losses):
            asked, took, took_per_stage = requests(
                paths, users, val, args, loss, VALUES[chosen[loss][1]],
                {"fusion": on_val.fusion, "rank_prior": chosen[loss][2]})
            ranked[loss] = hit_rates(asked, wanted)
            if not n:
                stages, total, per_stage = asked, took, took_per_stage
        three_asked, three_total, three_per_stage = requests(
            paths, users, val, args, best, value,
            {"fusion": on_val.fusion, "rank_prior": three_prior,
             "first_stage_prior": first_prior}, three=True)
        found = peers(paths["retrieval"], args.quick)
    hr = hit_rates(stages, wanted)
    three_hr = hit_rates(three_asked, wanted, THREE_STAGES)
    mean = {stage: np.mean([len(s[stage]) for s in stages]) for stage in STAGES}
    what = {"pixie": f"Pixie walk from the history ({args.pixie_steps:,} steps)",
            "two_tower": "two-tower user tower, exact search", "history":
            "history: item-to-item neighbours (max)",
            "merged": f"merged (reciprocal-rank fusion, weights {weights_text(on_val.fusion)})",
            "ranked": "ranked: multi-task ranker"
                      + (f" with the sequence feature (HSTU over the last {args.ranker_history} "
                         f"engagements)" if args.ranker_history else "")
                      + f" on the top {RANK_TOP}, value model "
                      f"({args.ranker_data} negatives, {args.losses[0]}, "
                      f"{chosen[args.losses[0]][0]} steps, merged order's weight "
                      f"{prior_text(chosen[args.losses[0]][2])})"}
    print(f"\n{name}: {len(users)} test users (each user's last positive, rating >= 4); history "
          f"and exclusions: training + validation items; value = "
          + value_text(VALUES[chosen[args.losses[0]][1]]) + f"; {cpu}")
    print("| candidates | HR@10 | recall@50 | items per request | CPU ms p50 | CPU ms p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    for stage in STAGES:
        times = per_stage.get(SOURCES_MS[stage], [])
        print(f"| {what[stage]} | {hr[f'{stage}_hr@10']:.4f} | {hr[f'{stage}_hr@50']:.4f} | "
              f"{mean[stage]:.0f} | {percentile(times, 50):.2f} | {percentile(times, 99):.2f} |")
    for loss, h in list(ranked.items())[1:]:
        print(f"| ranked, {loss} loss, {chosen[loss][0]} steps, value "
              f"{value_text(VALUES[chosen[loss][1]])}, merged order's weight "
              f"{prior_text(chosen[loss][2])} | {h['ranked_hr@10']:.4f} | "
              f"{h['ranked_hr@50']:.4f} | | | |")
    for peer, m in found.items():
        print(f"| {peer} | {m['test_hr@10']:.4f} | {m['test_recall@50']:.4f} | | | |")
    print(f"| whole request (one at a time, after {WARMUP} warm-up) | | | | "
          f"{percentile(per_stage['request'], 50):.2f} | "
          f"{percentile(per_stage['request'], 99):.2f} |")
    print(f"| whole request, wall ms | | | | {percentile(total, 50):.2f} | "
          f"{percentile(total, 99):.2f} |")
    print(f"\nThree stages ({best} ranker, {chosen[best][0]} steps, value {value_text(value)}): "
          f"sources {THREE_PER_SOURCE} each, the first stage (two-tower of the heavy ranker's "
          f"top {args.top_k_label}) on every merged candidate, its order fused with the "
          f"merged order of weight {prior_text(first_prior)}, the heavy ranker on its best "
          f"{args.first_stage_keep}, its order fused with theirs of weight "
          f"{prior_text(three_prior)}")
    print("| stage | HR@10 | recall@50 | items per request | CPU ms p50 | CPU ms p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    three_mean = {stage: np.mean([len(s[stage]) for s in three_asked]) for stage in SOURCES_MS}
    for stage, label in SOURCES_MS.items():
        times = three_per_stage.get(label, [])
        hr_cells = (f"{three_hr[f'{stage}_hr@10']:.4f} | {three_hr[f'{stage}_hr@50']:.4f}"
                    if stage in THREE_STAGES else " | ")
        print(f"| {stage} | {hr_cells} | {three_mean[stage]:.0f} | "
              f"{percentile(times, 50):.2f} | {percentile(times, 99):.2f} |")
    for what_ms, times in (("", three_per_stage["request"]), (", wall ms", three_total)):
        print(f"| whole request{what_ms} | | | | {percentile(times, 50):.2f} | "
              f"{percentile(times, 99):.2f} |")
    validation_tables(on_val, args, chosen, three_val, best)
    print(summary_line(name, hr, total, ranked,
                       (three_hr, three_total, three_per_stage["request"]), per_stage["request"]))


if __name__ == "__main__":
    main()
