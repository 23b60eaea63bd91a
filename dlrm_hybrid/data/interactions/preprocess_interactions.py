"""`preprocess interactions`: its arguments, and the command: a retrieval dataset folder from an
interaction log (interaction_split.py splits it), or with `--labels` a ranking dataset
(ranking_log.py)."""

from __future__ import annotations

import time
from typing import List

import numpy as np

from dlrm_hybrid.data.interactions.interaction_log import BAD_KINDS, parse_positive
from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta
from dlrm_hybrid.data.interactions.interaction_split import SPLIT_RULES, prepare, read_checked_log
from dlrm_hybrid.errors import UserError


def add_arguments(parser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="interaction logs, one log together: MovieLens u.data, ratings.dat, "
                             "ratings.csv, or any CSV/TSV/:: file with --columns")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--columns", metavar="ROLES",
                        help="the columns' roles in order, e.g. user,item,rating,timestamp,"
                             "user:age,item:genre (_ ignores a column); needed unless the "
                             "file is named as MovieLens names it")
    parser.add_argument("--delimiter", metavar="D",
                        help="field delimiter, e.g. ',' or '::' or tab (default: from the "
                             "first line)")
    parser.add_argument("--header", choices=("auto", "yes", "no"), default="auto",
                        help="whether each file's first line names the columns (auto: when a "
                             "number column is not a number, or it reads the roles' names)")
    parser.add_argument("--positive", metavar="RULE",
                        help="what is an engagement, e.g. 'rating>=4' (default: rating >= 4, "
                             "label == 1, or every row of a log without either)")
    parser.add_argument("--min-count", type=int, default=1, metavar="N",
                        help="leave out users and items with fewer than N positives (default 1)")
    parser.add_argument("--split", choices=SPLIT_RULES, default="leave-last-out",
                        help="leave-last-out (default): each user's last positive is test, the "
                             "one before validation; time: global cuts, see --cut")
    parser.add_argument("--cut", metavar="T1,T2",
                        help="--split time: before T1 train, [T1, T2) validation, from T2 test")
    parser.add_argument("--seed", type=int, default=0, help="the train rows' order (default 0)")
    parser.add_argument("--skip-bad-rows", action="store_true",
                        help="leave out malformed lines, counted, instead of stopping at the "
                             "first (FILE:LINE)")
    parser.add_argument("--labels", metavar="LABELS",
                        help="write a ranking dataset (split-binary, for the DLRM) with these "
                             "labels, e.g. watched,liked:rating>=4,disliked:rating<=2 (NAME "
                             "alone: 1 on every row; every row of the log is an engagement)")
    parser.add_argument("--ranking-negatives", type=int, default=0, metavar="N",
                        help="--labels: N sampled negatives per engagement, items the user "
                             "never engaged with, every label 0 (default 0)")
    parser.add_argument("--holdout", metavar="DIR",
                        help="--labels: leave out the validation and test pairs of DIR, the "
                             "retrieval dataset of the same log (from every split and from the "
                             "negatives), so a funnel scored on DIR's test never trained on them")
    parser.add_argument("--candidates", metavar="TOWER,GRAPH",
                        help="--labels: the ranker's rows from the funnel's candidates: TOWER "
                             "(`export --retrieval`) and GRAPH (`pixie build`) made from an early "
                             "retrieval dataset of this log (--holdout-recent K); each user's "
                             "engagements after those models' data, with the candidate features, "
                             "their negatives partly drawn from the candidates")
    parser.add_argument("--candidate-ratio", type=float, default=0.75, metavar="R",
                        help="--candidates: the share of each engagement's --ranking-negatives "
                             "drawn from the user's candidates, the rest uniform (default 0.75)")
    parser.add_argument("--history", type=int, default=0, metavar="L",
                        help="--labels: each row carries its user's last L engagements before "
                             "it with their actions (the labels they had), for a ranker with "
                             "model.sequence=hstu; and timelines.npz for serving (default 0)")
    parser.add_argument("--holdout-recent", type=int, default=0, metavar="K",
                        help="a retrieval dataset without each user's K most recent positives "
                             "(an early one, whose models give --candidates)")


def run(args) -> None:
    from dlrm_hybrid.data.interactions.interaction_data import write_interactions

    if args.labels:
        from dlrm_hybrid.data.interactions.ranking_log import run as run_ranking

        return run_ranking(args)
    for flag, given in (("--ranking-negatives", args.ranking_negatives),
                        ("--holdout", args.holdout), ("--candidates", args.candidates),
                        ("--history", args.history)):
        if given:
            raise UserError(f"{flag}: for a ranking dataset; give --labels too")
    if args.holdout_recent < 0:
        raise UserError(f"--holdout-recent: must be 0 or more, got {args.holdout_recent}")
    start = time.perf_counter()
    log, cut = read_checked_log(args)
    positive = parse_positive(args.positive, log.layout)
    prepared = prepare(log, positive, args.min_count, args.split, cut, args.seed,
                       args.holdout_recent)
    write_interactions(prepared.data, args.output, _text(prepared.raw_users),
                       _text(prepared.raw_items))
    print(summary(prepared.data.meta, args.output, time.perf_counter() - start))


def _text(raw: np.ndarray) -> List[str]:
    """The raw ids as text: the reader let only UTF-8 ids without line breaks through."""
    return [value.decode("utf-8") for value in raw.tolist()]


def summary(meta: InteractionMeta, output: str, seconds: float) -> str:
    """One screen: what was read, kept and left out, and how it was split."""
    e = meta.extra
    bad = {k: e[k] for k in BAD_KINDS if e.get(k)}
    sides = lambda side: ", ".join(f"{n} ({c})" for n, c in side.items()) or "none"  # noqa: E731
    kept = sum(meta.samples.values())
    return "\n".join([
        f"wrote {output} in {seconds:.1f} s",
        f"  read       {e['rows']:,} rows from {len(meta.source)} file(s), columns {e['columns']}",
        f"  bad rows   {sum(bad.values()):,} skipped"
        + (" (" + ", ".join(f"{k} {v:,}" for k, v in bad.items()) + ")" if bad else ""),
        *([f"  duplicate  {e['duplicate']:,} left out: rows equal to an earlier row in every "
           f"column (an engagement written twice is kept once)"] if e.get("duplicate") else []),
        f"  positive   {meta.positive}: {e['not_positive']:,} rows are not",
        f"  min-count  {e['min_count']}: {e['below_min_count']:,} positives left out with "
        f"{e['dropped_users']:,} users and {e['dropped_items']:,} items",
        *([f"  recent     {e['held_recent']:,} positives left out (--holdout-recent "
             f"{e['holdout_recent']}: each user's most recent), with "
             f"{e['recent_only_users']:,} users and {e['recent_only_items']:,} items that had "
             f"no other"] if e.get("holdout_recent") else []),
        f"  kept       {kept:,} positives of {meta.users:,} users and {meta.items:,} items",
        f"  features   user: {sides(meta.user_side)}; item: {sides(meta.item_side)}",
        f"  split      {meta.split_rule}"
        + (f" ({e['users_all_in_train']:,} such users)" if "leave-last-out" in meta.split_rule else ""),
        "             " + ", ".join(f"{s} {n:,}" for s, n in meta.samples.items()),
        f"done: users={meta.users} items={meta.items} "
        + " ".join(f"{s}={n}" for s, n in meta.samples.items())
        + f" skipped={sum(bad.values())} duplicate={e['duplicate']} "
          f"not_positive={e['not_positive']} below_min_count={e['below_min_count']}"
        + (f" held_recent={e['held_recent']}" if e.get("holdout_recent") else "")])
