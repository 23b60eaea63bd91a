"""The `recommend` funnel (`Recommender`): a user's top K as the recsys survey describes it
(Instagram Explore's, Pinterest's): candidates from several sources, a heavy ranker on the few
hundred best, a value model, final rules.

1. Sources, each `per_source` items best first, the excluded (seen) items left out:
   two_tower, the user tower's vector searched in the item index (serve/retrieve.py); history,
   each history item's neighbours in the same index, merged by their max; pixie, a Pixie walk
   from the history items on the item-user graph (graph/pixie.py).
2. Merge: each item once, with every source that found it, ordered by reciprocal-rank fusion
   with each source's `fusion` weight (rank_fusion.py; a source of weight 0 still gives
   candidates and the ranker's candidate features, after the weighted sources' items).
3. First stage (with a first-stage ranker, first_stage.py): every merged item scored by a light
   two-tower model of the heavy ranker's top-K choices, its best `first_stage_keep` kept.
   Rank: those (without a first stage: the first `rank_top` merged items) through the
   multi-task ranker (an `export`ed file), ordered by the value model sum_t w_t p_t (ties: the
   order they came in). `first_stage_prior`, `rank_prior` (default 0): each of the two
   orders fused with the order its stage was handed, with that weight; inf keeps the handed
   order (rank_fusion.with_prior: a benchmark chooses them on validation).
   With Memboost statistics (memboost.py) and `memboost_weight` gamma > 0, each item's value
   is value + gamma * MB(user, item) before the order (and its prior) is taken.
4. Rules: the blocklist out; diversity, no two items of one category in a row (greedily the next
   best item whose category differs from the last taken; when none is left, the rest in order);
   the first K. A `random_share` of requests (drawn afresh, not from the walk's seed) shows
   those K in random order: the unbiased traffic Memboost's position curve is measured on.

Ids are the retrieval folder's dense ids throughout: the graph must come from the same dataset
(graph.yaml's dataset digest is checked against the folder's seen items). The ranker reads its
own dataset's ids, reached through the raw ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.serve.candidate_sources import (SOURCES, CandidateSources, candidate_features,
                                                 similarity_features)
from dlrm_hybrid.serve.first_stage import FirstStage
from dlrm_hybrid.serve.rank_fusion import merge, with_prior
from dlrm_hybrid.serve.recommend_inputs import (check_graph, check_ranker, open_ranker,
                                                open_retriever, trained_on, value_model_weights)

if TYPE_CHECKING:
    from dlrm_hybrid.graph.pixie import PixieParams

STAGES = (*SOURCES, "merged", "first_stage", "ranked")
DIVERSITY = ("auto", "on", "off")


def _walk_defaults() -> "PixieParams":
    from dlrm_hybrid.graph.pixie import PixieParams

    return PixieParams()


@dataclass
class RecommendSettings:
    k: int = 20
    sources: Tuple[str, ...] = SOURCES
    per_source: int = 200  # candidates each source gives
    rank_top: int = 300  # merged candidates the ranker scores (without a first stage)
    value: Optional[Dict[str, float]] = None  # task -> weight; None: the ranker's value_model
    drop_seen: bool = True
    blocklist: Tuple[str, ...] = ()  # raw item ids
    diversity: str = "auto"  # auto: on where the graph knows the items' categories
    pixie: "PixieParams" = field(default_factory=_walk_defaults)
    device: str = "cpu"
    first_stage_keep: int = 100  # with a first stage: its best, which the ranker scores
    fusion: Optional[Dict[str, float]] = None  # source -> merge weight (None: 1 each)
    first_stage_prior: float = 0.0  # the merged order's weight beside the first stage's
    rank_prior: float = 0.0  # the incoming order's weight beside the value model's
    memboost_weight: float = 0.0  # gamma: value + gamma * MB (with Memboost statistics)
    random_share: float = 0.0  # the share of requests shown in random order

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
        fusion = self.fusion or {}
        if set(fusion) - set(self.sources):
            raise UserError(f"--fusion: {','.join(sorted(set(fusion) - set(self.sources)))} is "
                            f"not a source of --sources {','.join(self.sources)}")
        weights = [fusion.get(s, 1.0) for s in self.sources]
        if not all(np.isfinite(w) and w >= 0 for w in weights) or not max(weights) > 0:
            raise UserError(f"--fusion: weights must be 0 or more and one above 0, got "
                            f"{fusion}")
        for flag, prior in (("--first-stage-prior", self.first_stage_prior),
                            ("--rank-prior", self.rank_prior)):
            if not prior >= 0:  # NaN fails too; inf keeps the incoming order
                raise UserError(f"{flag}: must be 0 or more (inf: keep the incoming order), "
                                f"got {prior}")
        if not (np.isfinite(self.memboost_weight) and self.memboost_weight >= 0):
            raise UserError(f"--memboost-weight: must be a number 0 or more (gamma of "
                            f"value + gamma * MB), got {self.memboost_weight}")
        if not 0 <= self.random_share <= 1:  # NaN fails too
            raise UserError(f"--random-share: must be between 0 and 1 (the share of requests "
                            f"shown in random order), got {self.random_share}")
        if self.diversity not in DIVERSITY:
            raise UserError(f"--diversity: {self.diversity!r}; give one of {', '.join(DIVERSITY)}")
        self.pixie.check()


@dataclass
class Recommendation:
    """One request's answer: `items` (dense ids, final order) with their `value`, their tasks'
    `probabilities` [K, T] and the `sources` that found each; `stages`: each stage's list, best
    first (a source left out, or no first stage: empty); `ms`: each stage's milliseconds;
    `names`: the raw ids of `items` (from `recommend`); `boost`: each item's MB (zeros
    without Memboost); `random`: shown in random order; `handed`, `handed_value`: the items
    the ranker scored, in the order it was handed them, and their values without Memboost."""

    items: np.ndarray
    value: np.ndarray
    probabilities: np.ndarray
    tasks: List[str]
    sources: List[List[str]]
    stages: Dict[str, np.ndarray]
    ms: Dict[str, float]
    names: List[str] = field(default_factory=list)
    boost: np.ndarray = field(default_factory=lambda: np.zeros(0))
    random: bool = False
    handed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    handed_value: np.ndarray = field(default_factory=lambda: np.zeros(0))


class Recommender:
    """The retrieval folder, the graph, the ranker and its dataset's features (and a first-stage
    ranker), loaded and checked against each other once; then requests."""

    def __init__(self, retrieval: str, pixie: str, ranker: str, ranker_data: Optional[str] = None,
                 settings: Optional[RecommendSettings] = None,
                 first_stage: Optional[str] = None, memboost: Optional[str] = None) -> None:
        from dlrm_hybrid.graph.bipartite import read_graph
        from dlrm_hybrid.graph.pixie import PixieWalker
        from dlrm_hybrid.serve.ranking_features import RankingFeatures

        self.settings = settings = settings or RecommendSettings()
        settings.check()
        if first_stage and settings.first_stage_keep < settings.k:
            raise UserError(f"--first-stage-keep: {settings.first_stage_keep} is less than --k "
                            f"{settings.k}; the ranker must score at least the K items returned")
        self.retriever, self.retrieval_path = open_retriever(retrieval), retrieval
        graph = read_graph(pixie)
        check_graph(graph.description, self.retriever, pixie)
        self.walker = PixieWalker(graph, settings.device)
        self.sources = CandidateSources(self.retriever, self.walker, settings.per_source,
                                        settings.pixie, settings.sources)
        self.first_stage = FirstStage(first_stage, self.retriever) if first_stage else None
        self.ranker, description = open_ranker(ranker)
        self.tasks: List[str] = list(description["tasks"])
        self.features = RankingFeatures(ranker_data or trained_on(description, ranker))
        check_ranker(description, self.features, ranker)
        self.ranking_item = _mapped(self.retriever.item_names, self.features.item_of)
        missing = np.flatnonzero(self.ranking_item < 0)
        if len(missing):
            raise UserError(f"--ranker: {len(missing)} of the retrieval model's items are not in "
                            f"{self.features.path}/items.txt (e.g. "
                            f"{self.retriever.item_names[missing[0]]!r}): the ranker was trained "
                            f"on other data; give one trained on the same log")
        self.ranking_user = _mapped(self.retriever.user_names, self.features.user_of)
        self.weights = value_model_weights(settings.value, self.tasks, description)
        self.category = None if settings.diversity == "off" else graph.item_category
        if settings.diversity == "on" and self.category is None:
            raise UserError(f"--diversity on: {pixie} has no item categories; build the graph "
                            f"with --category-feature, or use --diversity off")
        known = [self.retriever.item_of[n] for n in settings.blocklist
                 if n in self.retriever.item_of]
        self.blocked = np.unique(np.array(known, np.int64))
        self.unknown_blocklist = [n for n in settings.blocklist if n not in self.retriever.item_of]
        self.memboost = None
        if memboost:
            from dlrm_hybrid.serve.memboost import load_stats

            self.memboost = load_stats(memboost, "--memboost")
        elif settings.memboost_weight:
            raise UserError("--memboost-weight: give --memboost STATS, the statistics "
                            "`memboost update` wrote")
        # fresh, not the walk's seed: one-request processes of one seed would all draw alike
        self.shuffle = np.random.default_rng()
        # what `ms` measures stages with: wall time; a benchmark on a shared machine may set
        # time.thread_time (the request's own CPU time: one thread does all its work)
        self.clock = time.perf_counter

    def recommend(self, user: str, history: Optional[Sequence[str]] = None) -> Recommendation:
        """`user`'s top K by raw ids; `history` (raw item ids, most recent first) in place of
        their training items; the training items (and the history) left out unless the settings
        keep the seen items."""
        if user not in self.retriever.user_of:
            raise UserError(f"--user: unknown user {user!r}: not in the retrieval model's "
                            f"users.txt (the raw ids of its training log)")
        u = self.retriever.user_of[user]
        if history is None:
            items = self.stored_latest_first(u)
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
        # a history tower reads the given history oldest first; none given: the stored one
        answer = self.recommend_dense(u, items, exclude, None if history is None else items[::-1])
        answer.names = [self.retriever.item_names[i] for i in answer.items]
        return answer

    def stored_latest_first(self, user: int) -> np.ndarray:
        """`user`'s training items, most recent first where the export stored their order (a
        ranker with similarity features reads the first RECENT; it refuses an export without
        the order, which would hand it arbitrary ones)."""
        if self.retriever.timelines is not None:
            return self.retriever.timeline(user)[::-1]
        if self.features is not None and self.features.similarity_features:
            raise UserError(f"--retrieval: {self.retrieval_path} has no training items in time "
                            f"order, which the ranker's similarity features read: export it "
                            f"again (export --retrieval) or give --history")
        return self.retriever.seen(user)

    def recommend_dense(self, user: int, history: np.ndarray, exclude: np.ndarray,
                        timeline: Optional[np.ndarray] = None,
                        at: Optional[float] = None) -> Recommendation:
        """`user`'s top K (retrieval dense ids throughout), the sources walking from `history`
        (most recent first: a ranker with similarity features reads its first RECENT), every
        stage leaving `exclude` out. A history tower (two_tower source) reads `timeline`
        (the user's items, oldest first; None: the user's stored training items). A ranker
        with a sequence feature reads the user's engagements of its dataset before time `at`
        (None: the latest)."""
        s, ms, stages = self.settings, {}, {}
        history = np.asarray(history, np.int64)
        exclude = np.asarray(exclude, np.int64)
        lists = {}
        for source in SOURCES:
            start = self.clock()
            lists[source] = (self.sources.source(source, user, history, exclude, timeline)
                             if source in s.sources else (np.zeros(0, np.int64), np.zeros(0)))
            stages[source] = lists[source][0]
            ms[source] = self._since(start)
        start = self.clock()
        stages["merged"], found_by = merge({src: stages[src] for src in s.sources},
                                           s.fusion)
        ms["merge"] = self._since(start)
        to_rank = stages["merged"][:s.rank_top]
        stages["first_stage"] = np.zeros(0, np.int64)
        if self.first_stage is not None:
            start = self.clock()
            # inf keeps the merged order: the first stage only cuts it, nothing to score
            scored = (stages["merged"] if np.isinf(s.first_stage_prior) else
                      self.first_stage.order(user, stages["merged"]))
            keep = with_prior(scored, stages["merged"], s.first_stage_prior)
            stages["first_stage"] = scored[keep[:s.first_stage_keep]]
            to_rank = stages["first_stage"]
            ms["first_stage"] = self._since(start)
        start = self.clock()
        stages["ranked"], probabilities, value = self._rank(user, to_rank, lists, history, at)
        at_handed = {int(i): n for n, i in enumerate(to_rank)}
        slot = np.array([at_handed[int(i)] for i in stages["ranked"]], np.int64)
        handed_value = np.zeros(len(to_rank), np.float64)
        handed_value[slot] = value
        boost = self.boost(user, stages["ranked"])
        if s.memboost_weight:  # the value model's order again, from the handed order
            total = np.zeros(len(to_rank))
            total[slot] = value + s.memboost_weight * boost
            resort = np.argsort(slot, kind="stable")[np.argsort(-total, kind="stable")]
            stages["ranked"], probabilities, boost = (
                stages["ranked"][resort], probabilities[resort], boost[resort])
            value = total[slot[resort]]
        order = with_prior(stages["ranked"], to_rank, s.rank_prior)
        stages["ranked"], probabilities, value, boost = (
            stages["ranked"][order], probabilities[order], value[order], boost[order])
        ms["rank"] = self._since(start)
        start = self.clock()
        keep = np.flatnonzero(~np.isin(stages["ranked"], self.blocked))
        if self.category is not None:
            keep = keep[diversify(self.category[stages["ranked"][keep]], s.k)]
        keep = keep[:s.k]
        shuffled = bool(s.random_share) and self.shuffle.random() < s.random_share
        if shuffled:
            keep = self.shuffle.permutation(keep)
        ms["rules"] = self._since(start)
        items = stages["ranked"][keep]
        return Recommendation(items, value[keep], probabilities[keep], self.tasks,
                              [found_by[int(i)] for i in items], stages, ms,
                              boost=boost[keep], random=shuffled, handed=to_rank,
                              handed_value=handed_value)

    def boost(self, user: int, items: np.ndarray) -> np.ndarray:
        """MB(user, item) of each of `items` (dense ids) from the Memboost statistics (zeros
        without them): the query is the user, by raw id."""
        if self.memboost is None:
            return np.zeros(len(items))
        return self.memboost.scores("user", self.retriever.user_names[user],
                                    [self.retriever.item_names[int(i)] for i in items])

    def _since(self, start: float) -> float:
        return round((self.clock() - start) * 1000, 3)

    def _rank(self, user: int, items: np.ndarray, lists: Dict[str, Tuple[np.ndarray, np.ndarray]],
              history: np.ndarray, at: Optional[float] = None
              ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`items` ordered by the value model (ties: their order), with [N, T] probabilities
        and [N] values; a ranker trained with candidate features reads them from the sources'
        `lists` (candidate_sources.py), and with similarity features from `history` (most
        recent first) and the retrieval model's item vectors, as its training rows had them."""
        import torch

        if not len(items):
            return items, np.zeros((0, len(self.tasks)), np.float32), np.zeros(0, np.float32)
        ranking_user = int(self.ranking_user[user])
        if ranking_user < 0:
            raise UserError(f"--user: {self.retriever.user_names[user]!r} is not in "
                            f"{self.features.path}/users.txt, the ranker's dataset: it was made "
                            f"from another log; give the ranking dataset of the retrieval log")
        extra = candidate_features(lists, items) if self.features.candidate_features else None
        if self.features.similarity_features:
            extra = np.concatenate([extra, similarity_features(self.retriever.item_vectors,
                                                               history, items)], axis=1)
        dense, ids = self.features.rows(ranking_user, self.ranking_item[items], extra, at)
        with torch.inference_mode():
            probabilities, value = self.ranker.score_with_value(
                torch.from_numpy(dense), torch.from_numpy(ids), None, self.weights)
        probabilities, value = probabilities.numpy(), value.numpy()
        order = np.argsort(-value, kind="stable")
        return items[order], probabilities[order], value[order]


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


def _mapped(names: List[str], index: Dict[str, int]) -> np.ndarray:
    return np.array([index.get(name, -1) for name in names], np.int64)
