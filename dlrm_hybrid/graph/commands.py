"""`pixie build` (an interaction dataset -> a graph folder) and `pixie query` (a walk's top
items for some items or a user; with --log-impressions, what it showed, for Memboost). torch is
imported only by `query`."""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path
from typing import List, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.graph.bipartite import (Pruning, check_out, graph_from_dataset, read_graph,
                                        write_graph)
from dlrm_hybrid.output_paths import refuse_overwriting_inputs, require_file_target
from dlrm_hybrid.serve.impressions import append_impressions, served
from dlrm_hybrid.serve.retrieve import lookup_id, read_raw_ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="an interaction dataset -> a graph folder")
    build.add_argument("--data", required=True, help="a folder `preprocess interactions` wrote")
    build.add_argument("--out", required=True, help="the new graph folder")
    build.add_argument("--splits", default="train", help="the splits whose engagements are edges "
                       "(default train: evaluation's items stay out)")
    build.add_argument("--category-feature", default="", metavar="NAME", help="the item feature "
                       "holding categories (default: `category` where the dataset has it)")
    for flag, default, what in (
            ("--max-item-degree", 0, "keep a seeded sample of this many users of a more popular "
                                     "item (0: no cap)"),
            ("--max-user-degree", 0, "the same for users' items (0: no cap)"),
            ("--min-item-degree", 1, "remove items with fewer users (default 1)"),
            ("--min-user-degree", 1, "remove users with fewer items (default 1)")):
        build.add_argument(flag, type=int, default=default, help=what)
    build.add_argument("--max-user-entropy", type=float, default=0.0, metavar="BITS",
                       help="remove users whose items' categories have a higher entropy (0: off)")
    build.add_argument("--seed", type=int, default=0, help="the degree caps' samples (default 0)")

    query = actions.add_parser("query", help="the top items of a Pixie walk")
    query.add_argument("--graph", required=True, help="a folder `pixie build` wrote")
    who = query.add_mutually_exclusive_group(required=True)
    who.add_argument("--items", metavar="I1[:W],I2,...", help="query items, each with an optional "
                     "weight (default 1)")
    who.add_argument("--user", help="walk from this user's items in the graph")
    query.add_argument("--k", type=int, default=100, help="items to return (default 100)")
    add_walk_arguments(query)
    query.add_argument("--dense-ids", action="store_true",
                       help="ids are the dataset's dense ids, in and out")
    query.add_argument("--json", action="store_true", help="print one JSON object")
    query.add_argument("--random-share", type=float, default=0.0, metavar="F",
                       help="the chance that the K items are shown in random order (Memboost "
                            "measures the position effect on them; default 0)")
    query.add_argument("--log-impressions", metavar="FILE", help="append what is shown to this "
                       "impression log (docs/memboost.md): query item:I1,I2,... or user:ID")


def add_walk_arguments(parser: argparse.ArgumentParser) -> None:
    """The walk's settings, shared by `pixie query` and `recommend`."""
    parser.add_argument("--steps", type=int, default=100_000, help="walk steps (default 100000)")
    parser.add_argument("--alpha", type=float, default=0.5,
                        help="restart probability after each step (default 0.5)")
    parser.add_argument("--early-stop", default="1000,20", metavar="N_P,N_V",
                        help="stop a query's walk once its N_P-th best item has N_V visits "
                             "(default 1000,20; 0 turns it off)")
    parser.add_argument("--walkers", type=int, default=4096,
                        help="walkers advanced together (default 4096)")
    parser.add_argument("--seed", type=int, default=0, help="the walk's seed (default 0)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def walk_params(args: argparse.Namespace):
    from dlrm_hybrid.graph.pixie import PixieParams

    n_p, n_v = parse_early_stop(args.early_stop)
    params = PixieParams(args.steps, args.alpha, args.walkers, n_p, n_v, seed=args.seed)
    params.check()
    return params


def parse_early_stop(text: str) -> Tuple[int, int]:
    parts = [p.strip() for p in str(text).split(",")]
    try:
        if parts == ["0"]:
            return 0, 1
        n_p, n_v = (int(p) for p in parts)
    except ValueError:
        raise UserError(f"--early-stop: {text!r}; give N_P,N_V (e.g. 1000,20) or 0 (off)") from None
    return n_p, n_v


def run(args: argparse.Namespace) -> None:
    return {"build": run_build, "query": run_query}[args.action](args)


def run_build(args: argparse.Namespace) -> None:
    refuse_overwriting_inputs([("--out", args.out)], [("--data", args.data)], "pixie build")
    check_out(args.out, args.data)
    splits = tuple(s.strip() for s in args.splits.split(",") if s.strip())
    pruning = Pruning(args.max_item_degree, args.max_user_degree, args.min_item_degree,
                      args.min_user_degree, args.max_user_entropy, args.seed)
    graph, report = graph_from_dataset(args.data, pruning, splits, args.category_feature)
    if not graph.edges:  # else `recommend` would run without its Pixie source, saying nothing
        removed = ", ".join(f"{k}={v}" for k, v in report.items() if k != "edges")
        raise UserError(f"pixie build: no edge is left ({removed}); lower --min-item-degree or "
                        f"--min-user-degree, or raise --max-user-entropy")
    write_graph(graph, args.out, raw_ids_from=args.data)
    d = graph.description
    print(f"wrote {args.out}: {graph.items:,} items, {graph.users:,} users, {graph.edges:,} "
          f"edges ({d['bytes_per_edge']} bytes per edge, both directions) in "
          f"{d['build_seconds']:.2f} s")
    print("done: " + " ".join(f"{k}={v}" for k, v in report.items())
          + f" bytes_per_edge={d['bytes_per_edge']}")


def run_query(args: argparse.Namespace) -> None:
    from dlrm_hybrid.graph.pixie import PixieWalker

    if args.k < 1:
        raise UserError("pixie query: --k must be at least 1")
    if not 0 <= args.random_share <= 1:  # NaN fails too
        raise UserError(f"pixie query: --random-share must be between 0 and 1 (the share of "
                        f"queries shown in random order), got {args.random_share}")
    if args.log_impressions:
        refuse_overwriting_inputs([("--log-impressions", args.log_impressions)],
                                  [("--graph", args.graph)], "pixie query")
        require_file_target("--log-impressions", args.log_impressions)
    params = walk_params(args)
    graph = read_graph(args.graph)
    names = RawIds(args.graph, args.dense_ids)
    if args.user is not None:
        user = names.user(args.user, graph.users)
        queries = graph.user_items[graph.user_indptr[user]:graph.user_indptr[user + 1]]
        if not len(queries):
            raise UserError(f"pixie query: user {args.user} has no items in the graph (pruned, "
                            f"or none in its splits); give --items")
        weights = None
    else:
        queries, weights = parse_items(args.items, names, graph.items)
    result = PixieWalker(graph, args.device).walk(queries, weights, params, k=args.k)
    shown = np.arange(len(result.items))
    shuffle = np.random.default_rng()  # not --seed's: each query of one seed would draw alike
    random = bool(args.random_share) and shuffle.random() < args.random_share
    if random:
        shown = shuffle.permutation(shown)
    answer = {"items": [names.item_name(int(i)) for i in result.items[shown]],
              "scores": [round(float(s), 3) for s in result.scores[shown]],
              "steps": int(result.walked.sum()), "steps_saved": result.steps_saved,
              **({"random_order": True} if random else {})}
    if args.log_impressions:
        query = (("user", args.user) if args.user is not None else
                 ("item", ",".join(names.item_name(int(i)) for i in queries)))
        append_impressions(args.log_impressions, served(
            uuid.uuid4().hex, time.time(), *query, answer["items"], random),
            "--log-impressions")
    if args.json:
        print(json.dumps(answer))
        return
    for name, score in zip(answer["items"], answer["scores"]):
        print(f"{name}\t{score:g}")
    print(f"pixie: steps={answer['steps']} steps_saved={answer['steps_saved']}")


def parse_items(text: str, names: "RawIds", items: int) -> Tuple[np.ndarray, List[float]]:
    queries, weights = [], []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        whole = part in names.item_of  # a raw id with a colon (spotify:track:7): no weight
        name, _, weight = part.rpartition(":") if ":" in part and not whole else (part, "", "1")
        try:
            weights.append(float(weight))
        except ValueError:
            raise UserError(f"--items: {part!r}; write ITEM or ITEM:WEIGHT") from None
        queries.append(names.item(name, items))
    if not queries:
        raise UserError("--items: names no items; give I1,I2,...")
    return np.array(queries, np.int64), weights


class RawIds:
    """users.txt / items.txt of a folder (the log's raw ids in dense-id order), or dense ids."""

    def __init__(self, folder: str, dense: bool) -> None:
        self.users = None if dense else read_raw_ids(Path(folder) / "users.txt")
        self.items = None if dense else read_raw_ids(Path(folder) / "items.txt")
        self.user_of = {n: i for i, n in enumerate(self.users or ())}
        self.item_of = {n: i for i, n in enumerate(self.items or ())}

    def user(self, name: str, count: int) -> int:
        return lookup_id(name, self.users, self.user_of, count, "user", "pixie query",
                         "the graph's")

    def item(self, name: str, count: int) -> int:
        return lookup_id(name, self.items, self.item_of, count, "item", "pixie query",
                         "the graph's")

    def item_name(self, item: int) -> str:
        return str(item) if self.items is None else self.items[item]

