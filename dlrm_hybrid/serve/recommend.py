"""`recommend`: one request through the whole funnel (skeleton; see the module's final docstring)."""

from __future__ import annotations

import argparse

from dlrm_hybrid.graph.commands import add_walk_arguments

SOURCES = ("two_tower", "history", "pixie")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--retrieval", required=True, help="a folder `export --retrieval` wrote")
    parser.add_argument("--pixie", required=True, help="a folder `pixie build` wrote from the "
                        "retrieval model's dataset")
    parser.add_argument("--ranker", required=True, help="a multi-task ranker `export` wrote, "
                        "trained on a `preprocess interactions --labels` dataset of the same log")
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
    parser.add_argument("--sources", default=",".join(SOURCES),
                        help=f"candidate sources (default {','.join(SOURCES)})")
    parser.add_argument("--per-source", type=int, default=200,
                        help="candidates each source gives (default 200)")
    parser.add_argument("--rank-top", type=int, default=300,
                        help="merged candidates the ranker scores (default 300)")
    parser.add_argument("--value", default="", metavar="TASK=W,...",
                        help="value model weights in place of the ranker's exported value_model")
    parser.add_argument("--keep-seen", action="store_true",
                        help="keep items the user already engaged with")
    parser.add_argument("--blocklist", metavar="FILE", help="item ids never to recommend, one "
                        "per line")
    parser.add_argument("--diversity", choices=("auto", "on", "off"), default="auto",
                        help="no two items of one category in a row (auto: on where the graph "
                             "knows categories)")
    add_walk_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def run(args: argparse.Namespace) -> None:
    raise NotImplementedError("recommend: being built")
