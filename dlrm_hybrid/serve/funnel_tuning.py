"""The funnel's choices on validation (`recommend-tune`, funnel_settings.py): the merge's source
weights, the ranker and its value model, and each stage's weight of the order it was handed
(its prior, rank_fusion.with_prior). Each is judged on what that stage delivers in the funnel
it serves: the merge and the ranker by HR@K of their lists, the first stage by whether the
held-out item is among the `first_stage_keep` it hands on (its own order's top K is never
shown), and the heavy ranker behind a first stage against the list the first stage handed it.

Weights and priors by the one-standard-error rule (Hastie, Tibshirani and Friedman 7.10, on
the paired per-user difference): the simplest setting within one standard error of the best,
so a source earns weight and a stage reorders what it was handed only where validation shows
more than noise. A ranker's setting is picked on one half of the validation users and its
prior judged on the other (`halves`): the best of many settings on the users that picked it is
high by chance. Memboost's weight gamma (value + gamma * MB), with the ranker's prior beside it:
the smallest gamma within one standard error of the best (`memboost_weight`), so it is 0 where
the statistics add only noise."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.serve.candidate_sources import SOURCES
from dlrm_hybrid.serve.rank_fusion import merge, with_prior
from dlrm_hybrid.serve.recommend_inputs import (check_ranker, open_ranker, trained_on,
                                                value_model_weights)

FUSION_GRID = (0.0, 0.25, 0.5, 1.0)  # each source's merge weight; the largest is 1
# the incoming order's weight beside a stage's own; inf: the stage keeps the incoming order
PRIORS = (0.0, 0.5, 1.0, 2.0, 4.0, float("inf"))
Key = Tuple[Hashable, int, int, float]  # (ranker group, steps or position, value model, prior)
MEMBOOST_GRID = (0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0)  # gamma of value + gamma * MB


@dataclass
class Requests:
    """The validation requests, each asked as `recommend` asks: dense user, the held-out item
    it should find, the history the sources walk from (most recent first), what is left out,
    a history tower's timeline (None: the stored one), and when it is made (a sequence
    ranker reads the engagements before it; None: the latest)."""

    users: np.ndarray
    wanted: np.ndarray
    histories: List[np.ndarray]
    excludes: List[np.ndarray]
    timelines: List[Optional[np.ndarray]]
    times: List[Optional[float]] = field(default_factory=list)


@dataclass
class Evaluation:
    """Per-user hits of every setting tried: `fusion_found` (weights in the sources' order;
    empty where the weights were given), `first_found` (first-stage prior: the held-out item
    among the kept), `found` (Key: HR@K of the ranked list)."""

    fusion: Dict[str, float]
    merged: np.ndarray  # the chosen merge's hits at K
    fusion_found: Dict[Tuple[float, ...], np.ndarray] = field(default_factory=dict)
    first_found: Dict[float, np.ndarray] = field(default_factory=dict)
    first_stage_prior: Optional[float] = None
    found: Dict[Key, np.ndarray] = field(default_factory=dict)


def hits(orders: Sequence[np.ndarray], wanted: np.ndarray, k: int) -> np.ndarray:
    """1 where the user's item is in its order's first k, per user."""
    return np.array([item in order[:k] for order, item in zip(orders, wanted)], float)


def within_noise(best: np.ndarray, other: np.ndarray) -> bool:
    """`other`'s per-user hits within one standard error (of the paired difference per user)
    of `best`'s."""
    gap = best - other
    users = len(gap)
    return gap.mean() <= gap.std(ddof=1) / np.sqrt(users) if users > 1 else not gap.any()


def choose_fusion(found: Dict[Tuple[float, ...], np.ndarray]) -> Tuple[float, ...]:
    """The weighting (per-user hits of each) with the fewest weighted sources among those
    within one standard error of the best, the best of those; ties: the grid's order. On a
    log where one source dominates, that source alone."""
    best = found[max(found, key=lambda w: found[w].mean())]
    close = [w for w in found if within_noise(best, found[w])]
    return min(close, key=lambda w: (sum(x > 0 for x in w), -found[w].mean()))


def defer(found: Dict[float, np.ndarray]) -> float:
    """The largest prior (per-user hits of each) within one standard error of the best: the
    stage defers to the order it was handed, wholly (inf) where its own order's gain is
    noise."""
    best = found[max(found, key=lambda p: (found[p].mean(), -p))]
    return max(p for p in found if within_noise(best, found[p]))


def halves(users: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Positions of the requests (`users`: each one's user) that pick a setting and of those
    that judge it: every other user in the order of their first request, so a user with
    several held-out items (a time split) sits on one side only."""
    _, first, inverse = np.unique(np.asarray(users), return_index=True, return_inverse=True)
    side = np.argsort(np.argsort(first))[inverse.reshape(-1)] % 2
    return np.flatnonzero(side == 0), np.flatnonzero(side == 1)


def _users_of(found: Dict, users: Optional[np.ndarray]) -> np.ndarray:
    """The requests' users; None: each request a user of its own."""
    return np.arange(len(next(iter(found.values())))) if users is None else users


def judged(found: Dict[float, np.ndarray], users: Optional[np.ndarray] = None) -> float:
    """`defer` on the judging half of the users: a stage's prior, per-request hits of each."""
    judge = halves(_users_of(found, users))[1]
    return defer({prior: hits[judge] for prior, hits in found.items()})


def choose(found: Dict[Key, np.ndarray], users: Optional[np.ndarray] = None
           ) -> Dict[Hashable, Tuple[int, int, float]]:
    """Per ranker group (per-request hits of each Key; `users`: each request's user), the
    steps and value model of the best HR@K at any prior on the picking half (ties: fewer
    steps, then the value models' order), and their prior `judged` on the other half; the
    group best on the picking half first."""
    pick = halves(_users_of(found, users))[0]
    rate: Dict[Tuple[Hashable, int, int], float] = {}  # (group, steps, value): best HR@K
    for (group, steps, value, _), hit in found.items():
        rate[group, steps, value] = max(rate.get((group, steps, value), 0.0), hit[pick].mean())
    best: Dict[Hashable, Tuple[int, int]] = {}
    for (group, steps, value), hr in rate.items():
        if group not in best or (hr, -steps, -value) > (rate[(group, *best[group])],
                                                        -best[group][0], -best[group][1]):
            best[group] = (steps, value)
    return {group: (*best[group], judged({prior: hit for (*setting, prior), hit in found.items()
                                          if tuple(setting) == (group, *best[group])}, users))
            for group in sorted(best, key=lambda g: -rate[(g, *best[g])])}


def fused_found(own: Sequence[np.ndarray], handed: Sequence[np.ndarray], wanted: np.ndarray,
                cut: int, priors: Sequence[float] = PRIORS) -> Dict[float, np.ndarray]:
    """Per prior, per-user hits among the first `cut` of a stage's order (`own`) fused with the
    order it was handed (`handed`) of that weight: a first stage's `cut` is what it keeps, a
    ranker's the K shown."""
    return {prior: hits([o[with_prior(o, h, prior)] for o, h in zip(own, handed)], wanted, cut)
            for prior in priors}


def validation_requests(rec, data: str, split: str = "val", limit: int = 0) -> Requests:
    """The requests of the dataset `data` (the retrieval model's; its split's pairs whose item
    the user did not engage with before: a seen item is never returned): split "val", each
    user asking with its training items, as `recommend --user` asks; "test", with its
    validation item before them (a world whose test item is the real validation item), but a
    user a sequence model has no history for (recommend refuses it). The pairs of the first
    `limit` users (0: all)."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    folder = Path(data)
    if not (folder / "interactions.yaml").is_file():
        raise UserError(f"--data: {data} has no interactions.yaml; give the retrieval model's "
                        f"dataset (a `preprocess interactions` folder)")
    dataset = open_interactions(data)
    if dataset.users != len(rec.retriever.user_side) or \
            dataset.items != len(rec.retriever.item_vectors):
        raise UserError(f"--data: {data} has {dataset.users} users and {dataset.items} items, "
                        f"the retrieval model {len(rec.retriever.user_side)} and "
                        f"{len(rec.retriever.item_vectors)}; give the dataset it was trained on")
    walked = (rec.walker.graph.description.get("source") or {}).get("splits") or []
    if split in walked:  # its walks would reach each held-out item through the user's own edge
        raise UserError(f"--pixie: the graph holds the {split} split's engagements (graph.yaml "
                        f"splits: {', '.join(walked)}), the pairs chosen on; build one without "
                        f"them (pixie build --splits train)")
    earlier = ("train",) if split == "val" else ("train", "val")
    indptr, wanted = dataset.findable(split, earlier)
    users = np.repeat(np.arange(dataset.users), np.diff(indptr))
    later: Dict[int, List[int]] = {}
    if split != "val":
        for user, item in zip(*(np.asarray(a).tolist() for a in dataset.pairs["val"])):
            later.setdefault(user, []).append(item)
    if (rec.retriever.description.get("user_history") or {}).get("encoder") == "hstu":
        # the sequence model reads the user's items: `recommend --user` refuses a user without
        answerable = np.array([len(rec.retriever.timeline(u)) + len(later.get(u, ())) > 0
                               for u in users.tolist()], bool)
        users, wanted = users[answerable], wanted[answerable]
    if limit:  # a user's pairs (several in a time split) are consecutive
        mine = np.isin(users, np.unique(users)[:limit])
        users, wanted = users[mine], wanted[mine]
    if not len(users):
        raise UserError(f"--data: {data} has no {split} pairs to choose on (each a user's "
                        f"held-out item not seen before); make it with a validation split")
    asked = Requests(users, np.asarray(wanted, np.int64), [], [], [])
    when = request_times(dataset, split)
    for user in users.tolist():
        history, timeline = request_history(rec, user, later.get(user, []))
        asked.histories.append(history)
        asked.excludes.append(np.union1d(rec.retriever.seen(user), history))
        asked.timelines.append(timeline)
        asked.times.append(None if when is None else float(when[user]))
    return asked


def request_times(dataset, split: str) -> Optional[np.ndarray]:
    """Per user, the time of its first engagement of `split` (a request of that split is made
    then; inf for a user without one), or None where the dataset kept no timestamps."""
    if dataset.times is None:
        return None
    when = np.full(dataset.users, np.inf)
    np.minimum.at(when, dataset.pairs[split][0], dataset.times[split])
    return when


def request_history(rec, user: int, later: Sequence[int]
                    ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """(history, timeline) of a request: the `later` items (held out of training, newest
    first) then the training items most recent first (`Recommender.stored_latest_first`: what
    the ranker's similarity features read); a history tower's timeline (the training items in
    time order, then `later`'s oldest first; None where nothing is later or there is no
    history tower: the stored one)."""
    latest = rec.stored_latest_first(user)
    history = np.concatenate([np.asarray(later, np.int64), latest]).astype(np.int64)
    timeline = None
    if len(later) and rec.retriever.history_length:
        timeline = np.concatenate([latest[::-1], np.asarray(later)[::-1]]).astype(np.int64)
    return history, timeline


def evaluate(rec, asked: Requests, rankers: Dict[Tuple[Hashable, int], str],
             values: Sequence[Optional[Dict[str, float]]], k: int = 10,
             fusion: Optional[Dict[str, float]] = None,
             ranker_data: Optional[str] = None) -> Evaluation:
    """Every setting's per-user hits on `asked`, with `rec`'s sources, first stage (if any) and
    settings (per_source, rank_top, first_stage_keep): the merge's weights of FUSION_GRID
    chosen by `choose_fusion` (or `fusion` as given); with a first stage, its prior by the
    held-out item among its kept (`judged`), the kept list at that prior handed to the
    rankers; each ranker of `rankers` ((group, steps) -> exported file) with each value model
    of `values` (None: the ranker's own) and each prior of PRIORS, by HR@k of its list
    (`ranker_data`: the ranking dataset all of them read, where given in place of theirs)."""
    s = rec.settings
    empty = (np.zeros(0, np.int64), np.zeros(0))
    lists = [{src: rec.sources.source(src, int(u), h, e, t) if src in s.sources else empty
              for src in SOURCES}
             for u, h, e, t in zip(asked.users, asked.histories, asked.excludes, asked.timelines)]

    def merged_with(weights: Dict[str, float]) -> List[np.ndarray]:
        return [merge({src: found[src][0] for src in s.sources}, weights)[0] for found in lists]

    result = Evaluation({}, np.zeros(0))
    if fusion is None:
        for w in itertools.product(FUSION_GRID, repeat=len(s.sources)):
            if max(w) == 1.0:
                result.fusion_found[w] = hits(merged_with(dict(zip(s.sources, w))),
                                              asked.wanted, k)
        fusion = dict(zip(s.sources, choose_fusion(result.fusion_found)))
    result.fusion = {src: float(fusion.get(src, 1.0)) for src in s.sources}
    merged = merged_with(result.fusion)
    result.merged = hits(merged, asked.wanted, k)
    handed = [m[:s.rank_top] for m in merged]
    if rec.first_stage is not None:
        scored = [rec.first_stage.order(int(u), m) for u, m in zip(asked.users, merged)]
        result.first_found = fused_found(scored, merged, asked.wanted, s.first_stage_keep)
        result.first_stage_prior = prior = judged(result.first_found, asked.users)
        handed = [o[with_prior(o, m, prior)][:s.first_stage_keep]
                  for o, m in zip(scored, merged)]
    for (group, steps), path in rankers.items():
        ranking, description = with_ranker(rec, path, ranker_data)
        for v, value in enumerate(values):
            ranking.weights = value_model_weights(value, ranking.tasks, description)
            own = [ranking._rank(int(u), top, found, h, t)[0] for u, top, found, h, t
                   in zip(asked.users, handed, lists, asked.histories,
                          asked.times or [None] * len(asked.users))]
            for prior, hit in fused_found(own, handed, asked.wanted, k).items():
                result.found[group, steps, v, prior] = hit
    return result


def with_ranker(rec, path: str, ranker_data: Optional[str] = None):
    """`rec` with the ranker `path` in place of its own (a shallow copy: the retrieval model,
    graph and ranking features shared) and the ranker's description; refused in one line
    where it was trained on another ranking dataset than `rec`'s (unless `ranker_data` names
    the one they all read)."""
    module, description = open_ranker(path)
    check_ranker(description, rec.features, path)
    data = (description.get("source") or {}).get("data")
    if data and not ranker_data and \
            Path(trained_on(description, path)).resolve() != Path(rec.features.path).resolve():
        raise UserError(f"--ranker: {path} was trained on {data}, the first --ranker on "
                        f"{rec.features.path}; compare rankers of one ranking dataset (or give "
                        f"--ranker-data)")
    other = copy.copy(rec)
    other.ranker, other.tasks = module, list(description["tasks"])
    return other, description


def memboost_found(rec, asked: Requests, k: int = 10, grid: Sequence[float] = MEMBOOST_GRID,
                   priors: Sequence[float] = PRIORS) -> Dict[Tuple[float, float], np.ndarray]:
    """Per (gamma of `grid`, rank prior of `priors`), per-user hits at k of `rec`'s funnel (its
    ranker, value model and Memboost statistics) with each handed item's value + gamma * MB,
    that order fused with the handed one at the prior: the funnel asked once per user, the
    ranked list re-sorted per setting as `recommend` sorts it."""
    weight, rec.settings.memboost_weight = rec.settings.memboost_weight, 0.0
    found: Dict[Tuple[float, float], List[float]] = {(g, p): [] for g in grid for p in priors}
    try:
        for u, h, e, t, at, item in zip(asked.users, asked.histories, asked.excludes,
                                        asked.timelines, asked.times or [None] * len(asked.users),
                                        asked.wanted):
            answer = rec.recommend_dense(int(u), h, e, t, at)
            handed, boost = answer.handed, rec.boost(int(u), answer.handed)
            for g, p in found:
                own = handed[np.argsort(-(answer.handed_value + g * boost), kind="stable")]
                found[g, p].append(float(item in own[with_prior(own, handed, p)][:k]))
    finally:
        rec.settings.memboost_weight = weight
    return {key: np.array(hit) for key, hit in found.items()}


def memboost_weight(found: Dict[Tuple[float, float], np.ndarray]) -> Tuple[float, float]:
    """(gamma, rank prior) (per-user hits of each): among the settings within one standard
    error of the best, the smallest gamma, then the largest prior (the ranker's own order
    deferring most to the order it was handed)."""
    best = found[max(found, key=lambda key: (found[key].mean(), -key[0], key[1]))]
    return min((key for key in found if within_noise(best, found[key])),
               key=lambda key: (key[0], -key[1]))
