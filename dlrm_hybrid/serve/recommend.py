"""`recommend`'s command line: one user's top K printed (or as one JSON object), or a file of
users' lists written as JSON lines; the funnel itself is recommender.py's."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.graph.commands import add_walk_arguments, walk_params
from dlrm_hybrid.output_paths import (refuse_overwriting_inputs, require_file_target,
                                      temporary_beside)
from dlrm_hybrid.serve.funnel_settings import TUNED, read_settings, tuned_inputs
from dlrm_hybrid.serve.impressions import Impressions, append_impressions, concat, served
from dlrm_hybrid.serve.recommender import (SOURCES, STAGES, Recommendation, Recommender,
                                           RecommendSettings)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--retrieval", required=True, help="a folder `export --retrieval` wrote")
    parser.add_argument("--pixie", required=True, help="a folder `pixie build` wrote from the "
                        "retrieval model's dataset")
    parser.add_argument("--ranker", help="a multi-task ranker `export` wrote, trained on a "
                        "`preprocess interactions --labels` dataset of the same log (required "
                        "unless --settings names one)")
    parser.add_argument("--settings", metavar="FILE", help="the file `recommend-tune` wrote: its "
                        "ranker, first stage, sources, candidate counts, merge weights, value "
                        "model and priors (a flag given here overrides the file's)")
    parser.add_argument("--ranker-data", help="that ranking dataset (default: the folder the "
                        "ranker was trained on, from its .json)")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", help="a user's id as in the log")
    who.add_argument("--users", metavar="FILE", help="a file of user ids, one per line: each "
                     "user's list goes to --out as one JSON line")
    parser.add_argument("--out", help="with --users: the file to write (JSON lines)")
    parser.add_argument("--k", type=int, default=20, help="items to return (default 20)")
    parser.add_argument("--history", metavar="I1,I2,...", help="the user's recent items (most "
                        "recent first) in place of their training items")
    parser.add_argument("--sources",
                        help=f"candidate sources (default {','.join(SOURCES)})")
    parser.add_argument("--per-source", type=int,
                        help="candidates each source gives (default 200)")
    parser.add_argument("--rank-top", type=int,
                        help="merged candidates the ranker scores without a first stage "
                             "(default 300)")
    parser.add_argument("--first-stage", metavar="DIR", help="a first-stage ranker (`export "
                        "--retrieval` of a model trained on `preprocess first-stage`'s dataset): "
                        "it scores every merged candidate and the ranker scores its best")
    parser.add_argument("--first-stage-keep", type=int, metavar="N",
                        help="--first-stage: candidates it passes to the ranker (default 100)")
    parser.add_argument("--fusion", metavar="SOURCE=W,...", help="the merge's "
                        "weight of each source in reciprocal-rank fusion (default 1 each; 0: its "
                        "items follow the weighted sources')")
    parser.add_argument("--first-stage-prior", type=float, metavar="W",
                        help="--first-stage: its order fused with the merged order of weight W "
                             "(default 0: its own order; inf: the merged order, the first stage "
                             "only cutting it to --first-stage-keep)")
    parser.add_argument("--rank-prior", type=float, metavar="W", help="the "
                        "ranked order fused with the order the ranker was handed of weight W "
                        "(default 0: the value model's order; inf: the handed order)")
    parser.add_argument("--value", metavar="TASK=W,...",
                        help="value model weights in place of the ranker's exported value_model")
    parser.add_argument("--keep-seen", action="store_true",
                        help="keep items the user already engaged with")
    parser.add_argument("--blocklist", metavar="FILE", help="item ids never to recommend, one "
                        "per line")
    parser.add_argument("--diversity", choices=("auto", "on", "off"), default="auto",
                        help="no two items of one category in a row (auto: on where the graph "
                             "knows categories)")
    parser.add_argument("--memboost", metavar="STATS", help="Memboost statistics (`memboost "
                        "update`): each item's value gains --memboost-weight x MB(user, item)")
    parser.add_argument("--memboost-weight", type=float, metavar="GAMMA", help="gamma of value + "
                        "gamma * MB (default 0, or the settings file's)")
    parser.add_argument("--random-share", type=float, default=0.0, metavar="F",
                        help="the share of requests whose K items are shown in random order "
                             "(Memboost measures the position effect on them; default 0)")
    parser.add_argument("--log-impressions", metavar="FILE", help="append what is shown to this "
                        "impression log (docs/memboost.md), engagements 0 until filled in")
    add_walk_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def run(args: argparse.Namespace) -> None:
    if args.users and not args.out:
        raise UserError("recommend: --users needs --out, the file to write (JSON lines)")
    if args.out and not args.users:
        raise UserError("recommend: --out is for --users (a batch); one user's list is printed")
    if args.users and args.history is not None:
        raise UserError("recommend: --history is for one --user")
    tuned = {}
    if args.settings:
        tuned = read_settings(args.settings)
        tuned_inputs(args, tuned)
    elif args.ranker is None:
        raise UserError("recommend: give --ranker FILE (or --settings FILE, which names one)")
    settings = settings_of(args, tuned)
    if settings.first_stage_prior and not args.first_stage:
        raise UserError("recommend: --first-stage-prior weighs the merged order beside a first "
                        "stage's; give --first-stage DIR too, or leave it out")
    inputs = [("--users", args.users), ("--retrieval", args.retrieval), ("--pixie", args.pixie),
              ("--ranker", args.ranker), ("--ranker-data", args.ranker_data),
              ("--first-stage", args.first_stage), ("--settings", args.settings),
              ("--blocklist", args.blocklist), ("--memboost", args.memboost)]
    if args.log_impressions:
        refuse_overwriting_inputs([("--log-impressions", args.log_impressions)],
                                  inputs + [("--out", args.out)], "recommend")
        require_file_target("--log-impressions", args.log_impressions)
    if args.out:
        refuse_overwriting_inputs([("--out", args.out)], [
            ("--users", args.users), ("--retrieval", args.retrieval), ("--pixie", args.pixie),
            ("--ranker", args.ranker), ("--ranker-data", args.ranker_data),
            ("--first-stage", args.first_stage), ("--settings", args.settings),
            ("--blocklist", args.blocklist), ("--memboost", args.memboost)], "recommend")
        require_file_target("--out", args.out)
    names = _lines("--users", args.users) if args.users else [args.user]
    recommender = Recommender(args.retrieval, args.pixie, args.ranker, args.ranker_data, settings,
                              args.first_stage, args.memboost)
    # the ranker's dataset where its description names it (no --ranker-data): an input too
    refuse_overwriting_inputs([("--out", args.out), ("--log-impressions", args.log_impressions)],
                              [("--ranker-data", recommender.features.path)], "recommend")
    if recommender.unknown_blocklist:
        print(f"warning: --blocklist: {len(recommender.unknown_blocklist)} items are not the "
              f"retrieval model's (e.g. {recommender.unknown_blocklist[0]!r}); nothing to block "
              f"there", file=sys.stderr)
    if args.users:
        unknown = next((n for n in names if n not in recommender.retriever.user_of), None)
        if unknown is not None:  # before any request: a batch stops at no late line
            raise UserError(f"--users: {args.users}: unknown user {unknown!r}: not in the "
                            f"retrieval model's users.txt (the raw ids of its training log)")
        return _run_batch(recommender, names, args.out, args.log_impressions)
    history = None if args.history is None else [
        i.strip() for i in args.history.split(",") if i.strip()]
    answer = recommender.recommend(args.user, history)
    if args.log_impressions:
        append_impressions(args.log_impressions, _shown(args.user, answer), "--log-impressions")
    if args.json:
        print(json.dumps(_answer(args.user, answer)))
        return
    for name, value, p, found in zip(answer.names, answer.value, answer.probabilities,
                                     answer.sources):
        print(f"{name}\t{value:.6f}\t"
              + " ".join(f"{t}={x:.4f}" for t, x in zip(answer.tasks, p)) + "\t" + ",".join(found))
    print(f"recommend: user={args.user} "
          + " ".join(f"{stage}={len(answer.stages[stage])}" for stage in STAGES)
          + f" returned={len(answer.items)} "
          + " ".join(f"ms_{stage}={ms:g}" for stage, ms in answer.ms.items())
          + f" ms_total={sum(answer.ms.values()):.3f}")


def settings_of(args: argparse.Namespace, tuned: Optional[dict] = None) -> RecommendSettings:
    """The request's settings: each flag given, else the settings file's (`tuned`, from
    `recommend-tune`), else the default."""
    given = {"sources": args.sources, "per_source": args.per_source, "rank_top": args.rank_top,
             "first_stage_keep": args.first_stage_keep,
             "fusion": parse_weights("--fusion", args.fusion, "pixie"),
             "value": parse_weights("--value", args.value, "liked"),
             "first_stage_prior": args.first_stage_prior, "rank_prior": args.rank_prior,
             "memboost_weight": args.memboost_weight}
    plain = RecommendSettings()  # what a flag left out means without a settings file
    defaults = {**{k: getattr(plain, k) for k in TUNED}, "sources": ",".join(plain.sources)}
    s = {key: flag if flag is not None else (tuned or {}).get(key, defaults[key])
         for key, flag in given.items()}
    for key in ("first_stage_prior", "rank_prior"):  # a file's none: no first stage tuned
        s[key] = defaults[key] if s[key] is None else s[key]
    settings = RecommendSettings(
        args.k, tuple(x.strip() for x in s["sources"].split(",") if x.strip()),
        s["per_source"], s["rank_top"], s["value"], not args.keep_seen,
        tuple(_lines("--blocklist", args.blocklist)) if args.blocklist else (), args.diversity,
        walk_params(args), args.device, s["first_stage_keep"], s["fusion"],
        s["first_stage_prior"], s["rank_prior"], s["memboost_weight"], args.random_share)
    settings.check()
    return settings


def parse_weights(flag: str, text: Optional[str], example: str
                  ) -> Optional[Dict[str, float]]:
    """`flag` NAME=W,...: None where not given (--value: the ranker's own value model;
    --fusion: 1 each)."""
    if text is None or not text.strip():
        return None
    weights: Dict[str, float] = {}
    what = "TASK" if flag == "--value" else "SOURCE"
    for item in text.split(","):
        name, _, number = (part.strip() for part in item.partition("="))
        try:
            weight = float(number)
        except ValueError:
            raise UserError(f"{flag}: {item.strip()!r}; write {what}=WEIGHT, e.g. "
                            f"{example}=1") from None
        if name in weights:
            raise UserError(f"{flag}: {name} is given twice ({text.strip()}); give each "
                            f"{what} once")
        weights[name] = weight
    return weights


def _lines(flag: str, path: str) -> List[str]:
    """A file's non-blank lines, stripped (a UTF-8 byte-order mark dropped)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path} ({getattr(e, 'strerror', None) or e})"
                        ) from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _run_batch(recommender: Recommender, names: List[str], out: str,
               log: Optional[str] = None) -> None:
    target = Path(out)
    partial = temporary_beside(target)
    shown = []
    try:
        with open(partial, "w") as stream:
            for name in names:
                answer = recommender.recommend(name)
                shown.append(_shown(name, answer))
                stream.write(json.dumps(_answer(name, answer)) + "\n")
        if log:  # the batch's rows in one write, before the answers appear
            append_impressions(log, concat(shown), "--log-impressions")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    print(f"recommend: wrote {out} users={len(names)} k={recommender.settings.k}")


def _shown(user: str, answer: Recommendation) -> Impressions:
    """The request's impression rows: a new request id, now, the user, the items in the order
    shown, whether in random order; engagements 0."""
    return served(uuid.uuid4().hex, time.time(), "user", user, answer.names, answer.random)


def _answer(user: str, answer: Recommendation) -> dict:
    extra = {"memboost": [round(float(b), 6) for b in answer.boost]} if len(answer.boost) and \
        answer.boost.any() else {}
    extra.update({"random_order": True} if answer.random else {})
    return {"user": user, "items": answer.names, **extra,
            "values": [round(float(v), 6) for v in answer.value],
            "probabilities": {t: [round(float(p), 6) for p in answer.probabilities[:, j]]
                              for j, t in enumerate(answer.tasks)},
            "sources": answer.sources,
            "candidates": {stage: len(answer.stages[stage]) for stage in STAGES},
            "ms": answer.ms}
