"""`recommend`: a user's top K through the funnel the recsys survey describes (Instagram
Explore's, Pinterest's): candidates from several sources, a heavy ranker on the few hundred best,
a value model, final rules.

1. Sources, each `per_source` items best first, the excluded (seen) items left out:
   two_tower, the user tower's vector searched in the item index (serve/retrieve.py); history,
   each history item's neighbours in the same index, merged by their max; pixie, a Pixie walk
   from the history items on the item-user graph (graph/pixie.py).
2. Merge: each item once, with every source that found it, ordered by reciprocal-rank fusion
   sum_s 1 / (RRF_K + rank_s) (Cormack, Clarke and Buettcher, SIGIR 2009), which needs no
   calibration between the sources' scores (inner products, visit counts).
3. Rank: the first `rank_top` merged items through the multi-task ranker (an `export`ed file),
   ordered by the value model sum_t w_t p_t (ties: merged order).
4. Rules: the blocklist out; diversity, no two items of one category in a row (greedily the next
   best item whose category differs from the last taken; when none is left, the rest in order);
   the first K.

Ids are the retrieval folder's dense ids throughout: the graph must come from the same dataset
(graph.yaml's dataset digest is checked against the folder's seen items). The ranker reads its
own dataset's ids, reached through the raw ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.graph.commands import add_walk_arguments, walk_params
from dlrm_hybrid.output_paths import (refuse_overwriting_inputs, require_file_target,
                                      temporary_beside)

if TYPE_CHECKING:
    from dlrm_hybrid.graph.pixie import PixieParams

SOURCES = ("two_tower", "history", "pixie")
STAGES = (*SOURCES, "merged", "ranked")
RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al.'s)
DIVERSITY = ("auto", "on", "off")


def _walk_defaults() -> "PixieParams":
    from dlrm_hybrid.graph.pixie import PixieParams

    return PixieParams()


@dataclass
class RecommendSettings:
    k: int = 20
    sources: Tuple[str, ...] = SOURCES
    per_source: int = 200  # candidates each source gives
    rank_top: int = 300  # merged candidates the ranker scores
    value: Optional[Dict[str, float]] = None  # task -> weight; None: the ranker's value_model
    drop_seen: bool = True
    blocklist: Tuple[str, ...] = ()  # raw item ids
    diversity: str = "auto"  # auto: on where the graph knows the items' categories
    pixie: "PixieParams" = field(default_factory=_walk_defaults)
    device: str = "cpu"

    def check(self) -> None:
        if self.k < 1:
            raise UserError(f"--k: must be at least 1, got {self.k}")
        unknown = [s for s in self.sources if s not in SOURCES]
        if unknown or not self.sources or len(set(self.sources)) < len(self.sources):
            raise UserError(f"--sources: {','.join(self.sources)!r}; give some of "
                            f"{','.join(SOURCES)}, each once")
        if self.per_source < 1:
            raise UserError(f"--per-source: must be at least 1, got {self.per_source}")
        if self.rank_top < self.k:
            raise UserError(f"--rank-top: {self.rank_top} is less than --k {self.k}; the ranker "
                            f"must score at least the K items returned")
        if self.diversity not in DIVERSITY:
            raise UserError(f"--diversity: {self.diversity!r}; give one of {', '.join(DIVERSITY)}")
        self.pixie.check()


@dataclass
class Recommendation:
    """One request's answer: `items` (dense ids, final order) with their `value`, their tasks'
    `probabilities` [K, T] and the `sources` that found each; `stages`: each stage's list, best
    first (a source left out: empty); `ms`: each stage's milliseconds; `names`: the raw ids of
    `items` (from `recommend`)."""

    items: np.ndarray
    value: np.ndarray
    probabilities: np.ndarray
    tasks: List[str]
    sources: List[List[str]]
    stages: Dict[str, np.ndarray]
    ms: Dict[str, float]
    names: List[str] = field(default_factory=list)


class Recommender:
    """The retrieval folder, the graph, the ranker and its dataset's features, loaded and
    checked against each other once; then requests."""

    def __init__(self, retrieval: str, pixie: str, ranker: str, ranker_data: Optional[str] = None,
                 settings: Optional[RecommendSettings] = None) -> None:
        from dlrm_hybrid.graph.bipartite import read_graph
        from dlrm_hybrid.graph.pixie import PixieWalker
        from dlrm_hybrid.serve.ranking_features import RankingFeatures

        self.settings = settings = settings or RecommendSettings()
        settings.check()
        self.retriever = _retriever(retrieval)
        graph = read_graph(pixie)
        _check_graph(graph.description, self.retriever, pixie)
        self.walker = PixieWalker(graph, settings.device)
        self.ranker, description = _ranker(ranker)
        self.tasks: List[str] = list(description["tasks"])
        self.features = RankingFeatures(ranker_data or _trained_on(description, ranker))
        _check_ranker(description, self.features, ranker)
        self.ranking_item = _mapped(self.retriever.item_names, self.features.item_of)
        missing = np.flatnonzero(self.ranking_item < 0)
        if len(missing):
            raise UserError(f"--ranker: {len(missing)} of the retrieval model's items are not in "
                            f"{self.features.path}/items.txt (e.g. "
                            f"{self.retriever.item_names[missing[0]]!r}): the ranker was trained "
                            f"on other data; give one trained on the same log")
        self.ranking_user = _mapped(self.retriever.user_names, self.features.user_of)
        self.weights = _weights(settings.value, self.tasks, description)
        self.category = None if settings.diversity == "off" else graph.item_category
        if settings.diversity == "on" and self.category is None:
            raise UserError(f"--diversity on: {pixie} has no item categories; build the graph "
                            f"with --category-feature, or use --diversity off")
        known = [self.retriever.item_of[n] for n in settings.blocklist
                 if n in self.retriever.item_of]
        self.blocked = np.unique(np.array(known, np.int64))
        self.unknown_blocklist = [n for n in settings.blocklist if n not in self.retriever.item_of]

    def recommend(self, user: str, history: Optional[Sequence[str]] = None) -> Recommendation:
        """`user`'s top K by raw ids; `history` (raw item ids, most recent first) in place of
        their training items; the training items (and the history) left out unless the settings
        keep the seen items."""
        if user not in self.retriever.user_of:
            raise UserError(f"--user: unknown user {user!r}: not in the retrieval model's "
                            f"users.txt (the raw ids of its training log)")
        u = self.retriever.user_of[user]
        if history is None:
            items = self.retriever.seen(u)
        else:
            unknown = [name for name in history if name not in self.retriever.item_of]
            if unknown:
                raise UserError(f"--history: unknown item {unknown[0]!r}: not in the retrieval "
                                f"model's items.txt")
            if not history:
                raise UserError("--history: names no items; give item ids I1,I2,...")
            items = np.array([self.retriever.item_of[name] for name in history], np.int64)
        exclude = (np.union1d(self.retriever.seen(u), items) if self.settings.drop_seen
                   else np.zeros(0, np.int64))
        answer = self.recommend_dense(u, items, exclude)
        answer.names = [self.retriever.item_names[i] for i in answer.items]
        return answer

    def recommend_dense(self, user: int, history: np.ndarray,
                        exclude: np.ndarray) -> Recommendation:
        """`user`'s top K (retrieval dense ids throughout), the sources walking from `history`,
        every stage leaving `exclude` out."""
        s, ms, stages = self.settings, {}, {}
        history = np.asarray(history, np.int64)
        exclude = np.asarray(exclude, np.int64)
        for source in SOURCES:
            start = time.perf_counter()
            stages[source] = (self._source(source, user, history, exclude)
                              if source in s.sources else np.zeros(0, np.int64))
            ms[source] = _since(start)
        start = time.perf_counter()
        stages["merged"], found_by = merge({src: stages[src] for src in s.sources})
        ms["merge"] = _since(start)
        start = time.perf_counter()
        stages["ranked"], probabilities, value = self._rank(user, stages["merged"][:s.rank_top])
        ms["rank"] = _since(start)
        start = time.perf_counter()
        keep = np.flatnonzero(~np.isin(stages["ranked"], self.blocked))
        if self.category is not None:
            keep = keep[diversify(self.category[stages["ranked"][keep]], s.k)]
        keep = keep[:s.k]
        ms["rules"] = _since(start)
        items = stages["ranked"][keep]
        return Recommendation(items, value[keep], probabilities[keep], self.tasks,
                              [found_by[int(i)] for i in items], stages, ms)

    def _source(self, source: str, user: int, history: np.ndarray,
                exclude: np.ndarray) -> np.ndarray:
        per = self.settings.per_source
        if source == "two_tower":
            [(items, _)] = self.retriever.for_users(np.array([user]), per, exclude=[exclude])
            return items
        if not len(history):
            return np.zeros(0, np.int64)
        if source == "history":
            return self.retriever.from_history(history, per, exclude=exclude)[0]
        walk = self.walker.walk(history, params=self.settings.pixie, keep_queries=True)
        return walk.items[~np.isin(walk.items, exclude)][:per].astype(np.int64)

    def _rank(self, user: int, items: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`items` ordered by the value model (ties: their order), with [N, T] probabilities
        and [N] values."""
        import torch

        if not len(items):
            return items, np.zeros((0, len(self.tasks)), np.float32), np.zeros(0, np.float32)
        ranking_user = int(self.ranking_user[user])
        if ranking_user < 0:
            raise UserError(f"--user: {self.retriever.user_names[user]!r} is not in "
                            f"{self.features.path}/users.txt, the ranker's dataset: it was made "
                            f"from another log; give the ranking dataset of the retrieval log")
        dense, ids = self.features.rows(ranking_user, self.ranking_item[items])
        with torch.inference_mode():
            probabilities, value = self.ranker.score_with_value(
                torch.from_numpy(dense), torch.from_numpy(ids), None, self.weights)
        probabilities, value = probabilities.numpy(), value.numpy()
        order = np.argsort(-value, kind="stable")
        return items[order], probabilities[order], value[order]


def merge(lists: Dict[str, np.ndarray]) -> Tuple[np.ndarray, Dict[int, List[str]]]:
    """The sources' lists as one, by reciprocal-rank fusion (ties: first found, in the sources'
    order), and the sources that found each item."""
    score: Dict[int, float] = {}
    found_by: Dict[int, List[str]] = {}
    for source, items in lists.items():
        for rank, item in enumerate(items.tolist(), 1):
            score[item] = score.get(item, 0.0) + 1.0 / (RRF_K + rank)
            found_by.setdefault(item, []).append(source)
    order = sorted(score, key=lambda item: -score[item])  # stable: first found first on ties
    return np.array(order, np.int64), found_by


def diversify(categories: np.ndarray, k: int) -> np.ndarray:
    """The first `k` positions of a list whose items have `categories`, reordered so that no two
    in a row share a category: each time the best left whose category differs from the last
    taken; when every one left shares it, the rest in order."""
    left, taken = list(range(len(categories))), []
    while left and len(taken) < k:
        last = categories[taken[-1]] if taken else None
        pick = next((j for j in left if categories[j] != last), None)
        if pick is None:
            taken.extend(left)
            break
        taken.append(pick)
        left.remove(pick)
    return np.array(taken[:k], np.int64)


def _since(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 3)


def _mapped(names: List[str], index: Dict[str, int]) -> np.ndarray:
    return np.array([index.get(name, -1) for name in names], np.int64)


def _retriever(folder: str):
    from dlrm_hybrid.serve.retrieve import DESCRIPTION, Retriever

    if not (Path(folder) / DESCRIPTION).is_file():
        raise UserError(f"--retrieval: {folder} has no {DESCRIPTION}; give a folder `export "
                        f"--retrieval` wrote")
    retriever = Retriever(folder)
    if retriever.item_names is None or retriever.user_names is None:
        raise UserError(f"--retrieval: {folder} has no users.txt/items.txt (its dataset had no "
                        f"raw ids); recommend needs them to reach the ranker's ids")
    return retriever


def _check_graph(description: dict, retriever, pixie: str) -> None:
    """The graph and the retrieval folder come from one dataset (its train engagements)."""
    from dlrm_hybrid.graph.bipartite import dataset_digest

    have = (description.get("source") or {}).get("dataset_digest")
    want = dataset_digest(len(retriever.user_side), len(retriever.item_vectors),
                          retriever.seen_indptr, retriever.seen_items)
    if have != want:
        raise UserError(f"--pixie: {pixie} was built from another dataset than the retrieval "
                        f"model's (graph.yaml's dataset_digest {have} is not {want}); build it "
                        f"with `pixie build --data` the retrieval model's dataset")


def _ranker(path: str):
    from dlrm_hybrid.serve.export import FORMAT_MULTITASK
    from dlrm_hybrid.serve.predict import load_scoring_model

    module, description = load_scoring_model(Path(path))
    if description.get("format") != FORMAT_MULTITASK:
        raise UserError(f"--ranker: {path} is not a multi-task ranker (format "
                        f"{description.get('format')!r}); give one trained with model.tasks on "
                        f"a `preprocess interactions --labels` dataset")
    return module, description


def _trained_on(description: dict, ranker: str) -> str:
    data = (description.get("source") or {}).get("data")
    if not data:
        raise UserError(f"--ranker-data: {ranker}'s description does not say which dataset it "
                        f"was trained on; give --ranker-data, its ranking dataset folder")
    return data


def _check_ranker(description: dict, features, ranker: str) -> None:
    """The ranker reads the dataset's features: as many, with the same sizes."""
    sizes = [f["cardinality"] for f in description["features"]]
    want = list(features.spec.cardinalities)
    if sizes != want or description["num_dense"] != features.spec.num_dense:
        raise UserError(f"--ranker: {ranker} was trained on other data than {features.path} (its "
                        f"features' sizes {sizes} and {description['num_dense']} dense, the "
                        f"dataset's {want} and {features.spec.num_dense}); give the ranking "
                        f"dataset it was trained on")


def _weights(value: Optional[Dict[str, float]], tasks: List[str], description: dict):
    """The value model as a [T] tensor in `tasks` order; None: the ranker's own."""
    import torch

    from dlrm_hybrid.serve.export import value_weights

    if value is not None and not value:
        raise UserError(f"--value: names no task; give TASK=WEIGHT for some of {', '.join(tasks)}")
    if value is None:
        if not description.get("value_model"):
            raise UserError(f"--value: the ranker was exported without a value model; give "
                            f"weights, e.g. --value {','.join(f'{t}=1' for t in tasks)}")
        return None
    for name, weight in value.items():
        if name not in tasks:
            raise UserError(f"--value: no task {name!r}; the ranker's tasks are "
                            f"{', '.join(tasks)}")
        if not np.isfinite(weight):
            raise UserError(f"--value: {name}'s weight {weight} is not a finite number")
    return torch.tensor(value_weights(tasks, value), dtype=torch.float32)


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
    if args.users and not args.out:
        raise UserError("recommend: --users needs --out, the file to write (JSON lines)")
    if args.out and not args.users:
        raise UserError("recommend: --out is for --users (a batch); one user's list is printed")
    if args.users and args.history is not None:
        raise UserError("recommend: --history is for one --user")
    settings = settings_of(args)
    if args.out:
        refuse_overwriting_inputs([("--out", args.out)], [
            ("--users", args.users), ("--retrieval", args.retrieval), ("--pixie", args.pixie),
            ("--ranker", args.ranker), ("--ranker-data", args.ranker_data),
            ("--blocklist", args.blocklist)], "recommend")
        require_file_target("--out", args.out)
    names = _lines("--users", args.users) if args.users else [args.user]
    recommender = Recommender(args.retrieval, args.pixie, args.ranker, args.ranker_data, settings)
    if recommender.unknown_blocklist:
        print(f"warning: --blocklist: {len(recommender.unknown_blocklist)} items are not the "
              f"retrieval model's (e.g. {recommender.unknown_blocklist[0]!r}); nothing to block "
              f"there", file=sys.stderr)
    if args.users:
        return _run_batch(recommender, names, args.out)
    history = None if args.history is None else [
        i.strip() for i in args.history.split(",") if i.strip()]
    answer = recommender.recommend(args.user, history)
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


def settings_of(args: argparse.Namespace) -> RecommendSettings:
    sources = tuple(s.strip() for s in args.sources.split(",") if s.strip())
    settings = RecommendSettings(
        args.k, sources, args.per_source, args.rank_top, _parse_value(args.value),
        not args.keep_seen, tuple(_lines("--blocklist", args.blocklist)) if args.blocklist else (),
        args.diversity, walk_params(args), args.device)
    settings.check()
    return settings


def _parse_value(text: str) -> Optional[Dict[str, float]]:
    """--value TASK=W,...: None where not given (the ranker's own value model)."""
    if not text.strip():
        return None
    value: Dict[str, float] = {}
    for item in text.split(","):
        name, _, number = (part.strip() for part in item.partition("="))
        try:
            value[name] = float(number)
        except ValueError:
            raise UserError(f"--value: {item.strip()!r}; write TASK=WEIGHT, e.g. liked=1") from None
    return value


def _lines(flag: str, path: str) -> List[str]:
    """A file's non-blank lines, stripped (a UTF-8 byte-order mark dropped)."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path} ({getattr(e, 'strerror', None) or e})"
                        ) from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def _run_batch(recommender: Recommender, names: List[str], out: str) -> None:
    target = Path(out)
    partial = temporary_beside(target)
    try:
        with open(partial, "w") as stream:
            for name in names:
                stream.write(json.dumps(_answer(name, recommender.recommend(name))) + "\n")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    print(f"recommend: wrote {out} users={len(names)} k={recommender.settings.k}")


def _answer(user: str, answer: Recommendation) -> dict:
    return {"user": user, "items": answer.names,
            "values": [round(float(v), 6) for v in answer.value],
            "probabilities": {t: [round(float(p), 6) for p in answer.probabilities[:, j]]
                              for j, t in enumerate(answer.tasks)},
            "sources": answer.sources,
            "candidates": {stage: len(answer.stages[stage]) for stage in STAGES},
            "ms": answer.ms}
