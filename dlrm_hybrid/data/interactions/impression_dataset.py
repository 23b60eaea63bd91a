"""`preprocess impressions`: impression logs (docs/memboost.md's format) -> a ranking dataset for
the DLRM (split-binary) whose rows carry Memboost's statistics as dense features.

Why impressions and not engagements with sampled negatives: Memboost's features count what a
pair was shown and clicked before; a sampled negative was never shown, so its features would be
0 and would give its label away. Here every row was shown, so both labels have a history.

- Rows: one per impression (random-order requests too); the label is clicked > 0.
- Categorical: `query` (one vocabulary over (query_kind, query): user 7 and the item query 7
  are two ids), `item`, `position` (position p is id min(p, POSITIONS) - 1; at serving ask for
  position 1, id 0: the score of the item shown first).
- Dense: memboost_features.FEATURES (log1p C, log1p E, MB) of each row's (query, item) from the
  impressions strictly before its time (`features_before`, the rule `memboost features` has):
  a validation or test row reads train-period impressions, never its own request's or later.
- Splits by time: requests sorted by time (ties: the order of the logs), the last
  --test-fraction of them test, the --val-fraction before those validation, the rest train; a
  request's rows stay together and in position order; train's requests shuffled as wholes
  (--seed).
- Ids: every query and item of the logs, numbered in order of first appearance in time;
  `queries.txt` (`kind<TAB>query`) and `items.txt` (line n: id n) in the dataset folder.
- The whole log is held in memory (not bounded); the folder appears whole or not at all.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter, check_new_output
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import refuse_overwriting_inputs
from dlrm_hybrid.serve.impressions import (QUERY_KINDS, Impressions, apply_clicks, concat,
                                           read_impressions)
from dlrm_hybrid.serve.memboost import POSITIONS
from dlrm_hybrid.serve.memboost_features import FEATURES, features_before

CATEGORICAL = ("query", "item", "position")
QUERIES_FILE, ITEMS_FILE = "queries.txt", "items.txt"
SPLIT_NAMES = ("train", "validation", "test")


def add_arguments(parser) -> None:
    parser.add_argument("--impressions", required=True, action="append", metavar="LOG",
                        help="an impression log (docs/memboost.md); repeat for several, one "
                             "log together")
    parser.add_argument("--clicks", metavar="FILE", help="engagements to join to the logs: "
                        "lines `request<TAB>item`, one per engagement")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the share of requests, the latest before test, in validation "
                             "(default 0.1)")
    parser.add_argument("--test-fraction", type=float, default=0.1, metavar="F",
                        help="the share of requests, the latest, in test (default 0.1)")
    parser.add_argument("--prior", type=float, default=1.0, metavar="A",
                        help="Memboost's alpha in MB = log((C + A) / (E + A)) (default 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the order of train's requests (default 0)")


def read_logs(paths: List[str], clicks: str = "") -> Impressions:
    """The logs as one, each checked (a bad row: one line naming file, row and column); a
    request id may be in one log only; `clicks` joined."""
    logs, seen = [], {}
    for number, path in enumerate(paths):  # by its place: the same path twice is two logs
        log = read_impressions(path)
        for n, request in enumerate(log.request.tolist()):
            earlier = seen.get(request)
            if earlier is not None and earlier != number:
                raise UserError(f"--impressions: {path} row {n + 2} column request: request "
                                f"{request!r} is in {paths[earlier]} too; a request's rows are "
                                f"in one log (the same log twice?)")
        seen.update((request, number) for request in log.request.tolist())
        logs.append(log)
    log = concat(logs)
    return apply_clicks(log, clicks) if clicks else log


def split_requests(log: Impressions, val_fraction: float, test_fraction: float
                   ) -> Tuple[np.ndarray, np.ndarray]:
    """(each row's split, 0 train / 1 validation / 2 test; each row's request number in time
    order): the last requests by time are test, those before them validation."""
    for flag, value in (("--val-fraction", val_fraction), ("--test-fraction", test_fraction)):
        if not 0 <= value < 1:
            raise UserError(f"{flag}: a share of the requests in [0, 1), got {value}")
    if val_fraction + test_fraction >= 1:
        raise UserError(f"--val-fraction {val_fraction} + --test-fraction {test_fraction} leave "
                        f"no request for train; give shares that add up to less than 1")
    _, first, inverse = np.unique(log.request, return_index=True, return_inverse=True)
    order = np.lexsort((first, log.time[first]))  # by time, then where the request first is
    rank = np.empty(len(first), np.int64)
    rank[order] = np.arange(len(first))
    n = len(first)
    test, val = int(round(test_fraction * n)), int(round(val_fraction * n))
    for flag, share, count in (("--val-fraction", val_fraction, val),
                               ("--test-fraction", test_fraction, test)):
        if share and not count:  # training would find the split empty
            raise UserError(f"{flag} {share:g} of {n} requests is none; give a larger share "
                            f"or more requests")
    if n - test - val < 1:
        raise UserError(f"--impressions: {n} requests leave none for train after "
                        f"{val} validation and {test} test; give smaller shares or more "
                        f"requests")
    split = np.where(rank >= n - test, 2, np.where(rank >= n - test - val, 1, 0))
    return split[inverse].astype(np.int8), rank[inverse]


def number(keys: List[str], order: np.ndarray) -> Tuple[np.ndarray, List[str]]:
    """Dense ids of `keys` in order of first appearance along `order`, and the vocabulary."""
    ids: Dict[str, int] = {}
    for r in order.tolist():
        ids.setdefault(keys[r], len(ids))
    return np.array([ids[k] for k in keys], np.int64), list(ids)


def read_vocabulary(folder: str) -> Tuple[Dict[Tuple[str, str], int], Dict[str, int]]:
    """A dataset's raw ids -> dense ids: {(query_kind, query): id}, {item: id}, to make rows
    to score from raw ids."""
    root = Path(folder)
    try:
        queries = (root / QUERIES_FILE).read_text(encoding="utf-8").splitlines()
        items = (root / ITEMS_FILE).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise UserError(f"{folder}: no {QUERIES_FILE}/{ITEMS_FILE} ({e.strerror}); give a "
                        f"folder `preprocess impressions` wrote") from None
    return ({tuple(line.split("\t", 1)): n for n, line in enumerate(queries)},
            {item: n for n, item in enumerate(items)})


def build(log: Impressions, val_fraction: float, test_fraction: float, prior: float
          ) -> dict:
    """Every row's split, request rank, ids, features and label, and the vocabularies."""
    split, rank = split_requests(log, val_fraction, test_fraction)
    chronology = np.lexsort((np.arange(len(log)), log.position, rank))
    kinds = np.array(QUERY_KINDS)[log.kind]
    query_keys = [f"{k}\t{q}" for k, q in zip(kinds.tolist(), log.query.tolist())]
    query, queries = number(query_keys, chronology)
    item, items = number(log.item.tolist(), chronology)
    dense = features_before(log, log.kind, log.query, log.item, log.time, prior)
    return {"split": split, "rank": rank, "chronology": chronology, "query": query,
            "queries": queries, "item": item, "items": items,
            "position": np.minimum(log.position, POSITIONS).astype(np.int64) - 1,
            "dense": dense, "label": (log.clicked > 0).astype(np.float32)}


def split_rows(made: dict, seed: int) -> List[np.ndarray]:
    """Each split's rows in the order written: validation and test in time order, train's
    requests shuffled as wholes; a request's rows consecutive, in position order."""
    rng, out = np.random.default_rng(seed), []
    chronology = made["chronology"]
    for s in range(len(SPLIT_NAMES)):
        rows = chronology[made["split"][chronology] == s]
        if s == 0 and len(rows):
            _, starts = np.unique(made["rank"][rows], return_index=True)
            blocks = np.split(rows, starts[1:])
            rows = np.concatenate([blocks[b] for b in rng.permutation(len(blocks))])
        out.append(rows)
    return out


def write(made: dict, rows: List[np.ndarray], output: str, notes: dict
          ) -> None:
    spec = DataSpec(len(FEATURES), [len(made["queries"]), len(made["items"]), POSITIONS],
                    [1] * len(CATEGORICAL))
    with SplitBinaryWriter(output, spec) as writer:
        for name, r in zip(SPLIT_NAMES, rows):
            writer.write(name, made["label"][r], made["dense"][r],
                         [made[c][r][:, None] for c in CATEGORICAL])
        for key, value in notes.items():
            writer.note(key, value)
        writer.add_file(QUERIES_FILE, "".join(f"{q}\n" for q in made["queries"]))
        writer.add_file(ITEMS_FILE, "".join(f"{i}\n" for i in made["items"]))


def run(args) -> None:
    """`preprocess impressions`: read, check, split, number, compute the features, write."""
    start = time.perf_counter()
    refuse_overwriting_inputs([("--output", args.output)],
                              [*(("--impressions", p) for p in args.impressions),
                               ("--clicks", args.clicks)], "preprocess impressions")
    check_new_output(args.output)
    if not (np.isfinite(args.prior) and args.prior > 0):
        raise UserError(f"--prior: Memboost's alpha, a number above 0; got {args.prior}")
    log = read_logs(args.impressions, args.clicks or "")
    if not len(log):
        raise UserError(f"--impressions: {', '.join(args.impressions)} hold no impression; "
                        f"give logs with rows")
    made = build(log, args.val_fraction, args.test_fraction, args.prior)
    rows = split_rows(made, args.seed)
    times = [log.time[r] for r in rows]
    notes = {
        "source": {"impressions": list(args.impressions), "clicks": args.clicks or None},
        "dataset": "impressions: one row per impression, label clicked > 0",
        "categorical_features": list(CATEGORICAL),
        "numerical_features": list(FEATURES),
        "memboost": {"prior": args.prior, "positions": POSITIONS,
                     "rule": "each row's statistics from the impressions strictly before its "
                             "time (serve/memboost_features.py)"},
        "position": f"id = min(position, {POSITIONS}) - 1; at serving, id 0 (position 1)",
        "vocabulary": {"query": f"{QUERIES_FILE} (kind<TAB>query; line n is id n)",
                       "item": f"{ITEMS_FILE} (line n is id n)"},
        "split_rule": (f"by request time: the last {args.test_fraction:g} of requests test, the "
                       f"{args.val_fraction:g} before them validation; train's requests "
                       f"shuffled (seed {args.seed})"),
        "time_ranges": {n: [float(t.min()), float(t.max())] if len(t) else None
                        for n, t in zip(SPLIT_NAMES, times)},
        "rows": {n: int(len(r)) for n, r in zip(SPLIT_NAMES, rows)},
        "requests": {n: int(len(np.unique(made["rank"][r]))) for n, r in zip(SPLIT_NAMES, rows)},
    }
    write(made, rows, args.output, notes)
    seconds = time.perf_counter() - start
    print(summary(log, made, rows, args.output, seconds))


def summary(log: Impressions, made: dict, rows: List[np.ndarray], output: str,
            seconds: float) -> str:
    """What was read and where each split's rows went; a `done:` line."""
    label = made["label"]
    with_history = int((made["dense"][:, 1] > 0).sum())
    lines = [f"wrote {output} in {seconds:.1f} s (a ranking dataset of impressions: "
             f"split-binary)",
             f"  read       {len(log):,} impressions of {len(np.unique(made['rank'])):,} "
             f"requests ({int(log.random.sum()):,} in random order), {len(made['queries']):,} "
             f"queries, {len(made['items']):,} items",
             f"  features   {', '.join(CATEGORICAL)}; {', '.join(FEATURES)} "
             f"({with_history:,} rows with impressions of their pair before them)"]
    for name, r in zip(SPLIT_NAMES, rows):
        lines.append(f"  {name:<10} {len(r):,} rows, click rate "
                     f"{label[r].mean() if len(r) else 0:.4f}")
    lines.append(f"done: rows={len(log)} " + " ".join(
        f"{n}={len(r)}" for n, r in zip(SPLIT_NAMES, rows))
        + f" queries={len(made['queries'])} items={len(made['items'])} "
          f"clicked={int(label.sum())} seconds={seconds:.2f}")
    return "\n".join(lines)
