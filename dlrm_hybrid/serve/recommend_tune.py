"""`recommend-tune`: the funnel's choices on a log's validation pairs (funnel_tuning.py), written
as the settings file `recommend --settings` reads (funnel_settings.py). A user configures a
funnel on their own log the way benchmarks/recommend.py configures it on MovieLens."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.graph.commands import add_walk_arguments, walk_params
from dlrm_hybrid.output_paths import refuse_overwriting_inputs, require_file_target
from dlrm_hybrid.serve.candidate_sources import SOURCES
from dlrm_hybrid.serve.funnel_settings import FORMAT, write_settings


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--retrieval", required=True, help="a folder `export --retrieval` wrote")
    parser.add_argument("--pixie", required=True, help="a folder `pixie build` wrote from the "
                        "retrieval model's dataset")
    parser.add_argument("--ranker", required=True, action="append", metavar="FILE",
                        help="a multi-task ranker `export` wrote (repeat to choose among "
                             "several of one ranking dataset)")
    parser.add_argument("--ranker-data", help="the rankers' dataset (default: the folder the "
                        "first ranker was trained on)")
    parser.add_argument("--first-stage", metavar="DIR", help="a first-stage ranker: tune the "
                        "three-stage funnel")
    parser.add_argument("--data", metavar="DIR", help="the retrieval model's dataset, whose "
                        "validation pairs choose (default: the one it was trained on)")
    parser.add_argument("--out", required=True, metavar="FILE", help="the settings file to "
                        "write (YAML), for `recommend --settings`")
    parser.add_argument("--k", type=int, default=10, help="the list judged: HR@K (default 10)")
    parser.add_argument("--users", type=int, default=0, help="validation users asked (default "
                        "0: all)")
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help=f"candidate sources (default {','.join(SOURCES)})")
    parser.add_argument("--per-source", type=int, default=200,
                        help="candidates each source gives (default 200)")
    parser.add_argument("--rank-top", type=int, default=300,
                        help="merged candidates the ranker scores without a first stage "
                             "(default 300)")
    parser.add_argument("--first-stage-keep", type=int, default=100, metavar="N",
                        help="--first-stage: candidates it passes to the ranker (default 100)")
    parser.add_argument("--fusion", default="", metavar="SOURCE=W,...", help="fixed merge "
                        "weights (default: chosen on validation)")
    parser.add_argument("--value", action="append", default=[], metavar="TASK=W,...",
                        help="a value model to choose among (repeat; default: the ranker's "
                             "exported value_model)")
    parser.add_argument("--memboost", metavar="STATS", help="Memboost statistics (`memboost "
                        "update`): choose the weight gamma of value + gamma * MB too")
    add_walk_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> None:
    from dlrm_hybrid.serve import funnel_tuning
    from dlrm_hybrid.serve.recommend import parse_weights
    from dlrm_hybrid.serve.recommend_inputs import value_model_weights
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings


    refuse_overwriting_inputs([("--out", args.out)], [
        ("--retrieval", args.retrieval), ("--pixie", args.pixie), ("--first-stage",
        args.first_stage), ("--data", args.data), ("--memboost", args.memboost),
        ("--ranker-data", args.ranker_data),
        *(("--ranker", r) for r in args.ranker)],
        "recommend-tune")
    require_file_target("--out", args.out)
    if args.users < 0:
        raise UserError(f"recommend-tune: --users must be 0 (all) or more, got {args.users}")
    if len(set(args.ranker)) < len(args.ranker):
        raise UserError("recommend-tune: --ranker: a ranker is given twice; give each once")
    values = [parse_weights("--value", v, "liked") for v in args.value] or [None]
    fusion = parse_weights("--fusion", args.fusion, "pixie")
    settings = RecommendSettings(
        k=args.k, sources=tuple(s.strip() for s in args.sources.split(",") if s.strip()),
        per_source=args.per_source, rank_top=args.rank_top, diversity="off",
        pixie=walk_params(args), device=args.device, first_stage_keep=args.first_stage_keep,
        fusion=fusion)
    rec = Recommender(args.retrieval, args.pixie, args.ranker[0], args.ranker_data, settings,
                      args.first_stage, args.memboost)
    data = args.data or (rec.retriever.description.get("source") or {}).get("data")
    if not data:
        raise UserError(f"recommend-tune: {args.retrieval} does not say which dataset its model "
                        f"was trained on; give --data, the retrieval dataset")
    if not args.data and not Path(data).is_absolute() and not Path(data).exists():
        raise UserError(f"recommend-tune: {args.retrieval} names its dataset {data}, a path "
                        f"relative to where it was exported, not found from here; give --data, "
                        f"the retrieval dataset")
    # the datasets the models name (no --ranker-data, --data): inputs too
    refuse_overwriting_inputs([("--out", args.out)], [("--ranker-data", rec.features.path),
                                                      ("--data", data)], "recommend-tune")
    asked = funnel_tuning.validation_requests(rec, data, "val", args.users)
    if len(np.unique(asked.users)) < 2:  # halves: one user picks, another judges
        raise UserError("recommend-tune: the validation pairs asked are of one user (a "
                        "ranker's setting is picked on half the users, its prior judged on the "
                        "other); give --users 2 or more, or a dataset with more validation users")
    found = funnel_tuning.evaluate(rec, asked, {(n, 0): r for n, r in enumerate(args.ranker)},
                                   values, args.k, fusion, args.ranker_data)
    chosen = funnel_tuning.choose(found.found, asked.users)
    best = next(iter(chosen))
    _, value, rank_prior = chosen[best]
    tuned = {"sources": list(settings.sources), "per_source": args.per_source,
             "rank_top": args.rank_top, "first_stage_keep": args.first_stage_keep,
             "fusion": found.fusion, "value": values[value], "rank_prior": rank_prior,
             "first_stage_prior": found.first_stage_prior}
    measured = {"split": "val", "users": len(asked.users), "k": args.k,
                "hr_merged": float(found.merged.mean()),
                "hr_ranked": float(found.found[best, 0, value, rank_prior].mean())}
    if found.first_stage_prior is not None:
        measured["first_stage_keeps_held_out"] = float(
            found.first_found[found.first_stage_prior].mean())
    if args.memboost:
        chosen_rec, description = funnel_tuning.with_ranker(rec, args.ranker[best],
                                                            args.ranker_data)
        chosen_rec.weights = value_model_weights(values[value], chosen_rec.tasks, description)
        chosen_rec.settings = dataclasses.replace(
            settings, fusion=found.fusion, first_stage_prior=found.first_stage_prior or 0.0)
        boosted = funnel_tuning.memboost_found(chosen_rec, asked, args.k)
        gamma, prior = funnel_tuning.memboost_weight(boosted)
        tuned.update(memboost_weight=gamma, rank_prior=prior)
        measured["hr_memboost"] = float(boosted[gamma, prior].mean())
    write_settings(Path(args.out), {
        "format": FORMAT, "ranker": str(Path(args.ranker[best]).resolve()),
        "first_stage": str(Path(args.first_stage).resolve()) if args.first_stage else None,
        "memboost": str(Path(args.memboost).resolve()) if args.memboost else None,
        "retrieval": str(Path(args.retrieval).resolve()), "data": str(data),
        "settings": tuned, "validation": measured})
    print(f"recommend-tune: wrote {args.out} users={len(asked.users)} ranker={args.ranker[best]} "
          + " ".join(f"{key}={_text(tuned[key])}" for key in
                     ("fusion", "value", "rank_prior", "first_stage_prior")
                     + (("memboost_weight",) if args.memboost else ()))
          + f" hr@{args.k}_merged={measured['hr_merged']:.4f} "
            f"hr@{args.k}_ranked={measured['hr_ranked']:.4f}")


def _text(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{name}={weight:g}" for name, weight in value.items())
    return "none" if value is None else f"{value:g}"
