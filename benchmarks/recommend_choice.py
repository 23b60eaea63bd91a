"""What benchmarks/recommend.py chooses in its validation world, on validation items only: the
merge's source weights (`choose_fusion`), each loss's ranker (steps, value model and the weight
of the merged order beside its own: `validation_hr`, `choose`), and the first stage's weight of
the merged order (`first_stage_prior`, `defer`). Weights and priors by the one-standard-error
rule (Hastie, Tibshirani and Friedman 7.10, on the paired per-user difference): the simplest
setting within one standard error of the best, where a source earns weight and a stage reorders
what it was handed only where validation shows more than noise; a ranker's setting is picked on
one half of the validation users and its prior judged on the other (`halves`)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

from recommend_build import VALUE, asked_history  # noqa: E402

VALUES = (VALUE, {"liked": 1.0}, {"watched": 1.0})  # the value models validation chooses from
PER_SOURCE, RANK_TOP = 200, 300
THREE_PER_SOURCE = 400  # the three-stage funnel's candidates per source (645 merged on ml-100k)
FUSION_GRID = (0.0, 0.25, 0.5, 1.0)  # each source's merge weight; the largest is 1
# the incoming order's weight beside a stage's own; inf: the stage keeps the incoming order
PRIORS = (0.0, 0.5, 1.0, 2.0, 4.0, float("inf"))


class Validation(NamedTuple):
    hits: Dict[Tuple[str, int, int, float], np.ndarray]  # (loss, steps, value, prior) -> per user
    merged: float  # the chosen merge's HR@10
    fusion: Dict[str, float]  # the chosen merge weights
    fusion_hr: Dict[Tuple[float, ...], float]  # every weighting's HR@10 (SOURCES order)


def findable(root: Path, split: str, earlier: Tuple[str, ...]):
    """(users, items) of `split`'s pairs whose item the user did not engage with in the
    `earlier` splits: a re-engagement is never returned (seen items are left out), as the
    evaluation's rule says (docs/retrieval.md)."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    data = open_interactions(str(root))
    indptr, items = data.findable(split, earlier)
    return np.repeat(np.arange(data.users), np.diff(indptr)), items


def hits(orders: List[np.ndarray], wanted: np.ndarray, k: int = 10) -> np.ndarray:
    """1 where the user's item is in its order's first k, per user."""
    return np.array([item in order[:k] for order, item in zip(orders, wanted)], float)


def within_noise(best: np.ndarray, other: np.ndarray) -> bool:
    """`other`'s per-user hits within one standard error (of the paired difference per user)
    of `best`'s."""
    gap = best - other
    users = len(gap)
    return gap.mean() <= gap.std(ddof=1) / np.sqrt(users) if users > 1 else not gap.any()


def choose_fusion(found: Dict[Tuple[float, ...], np.ndarray]) -> Tuple[float, ...]:
    """The weighting (per-user hits on validation of each) with the fewest weighted sources
    among those within one standard error of the best, the best of those; ties: the grid's
    order. On a log where one source dominates, that source alone."""
    best = found[max(found, key=lambda w: found[w].mean())]
    close = [w for w in found if within_noise(best, found[w])]
    return min(close, key=lambda w: (sum(x > 0 for x in w), -found[w].mean()))


def defer(found: Dict[float, np.ndarray]) -> float:
    """The largest prior (per-user hits on validation of each) within one standard error of
    the best: the stage defers to the order it was handed, wholly (inf) where its own order's
    gain is noise."""
    best = found[max(found, key=lambda p: (found[p].mean(), -p))]
    return max(p for p in found if within_noise(best, found[p]))


def validation_hr(paths: Dict[str, str], args) -> Validation:
    """In the validation world (`paths`: recommend_build.validation_log's log built, so its
    test item is the real validation item and its models stop before it exactly as the test
    world's stop before the test item), each test user asking as a test request asks (history
    = its training and validation items, all excluded): the merge weights chosen among
    FUSION_GRID's, then HR@10 of each ranker of args.losses x args.ranker_steps, each value
    model of VALUES and each prior of PRIORS on the same RANK_TOP merged items."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.candidate_sources import SOURCES
    from dlrm_hybrid.serve.rank_fusion import merge, with_prior
    from dlrm_hybrid.serve.recommend_inputs import open_ranker, value_model_weights
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    users, wanted, val = test_users(paths["retrieval"], args.val_users)
    settings = RecommendSettings(k=10, per_source=PER_SOURCE, rank_top=RANK_TOP, value=VALUE,
                                 pixie=PixieParams(steps=args.pixie_steps))
    keys = [(loss, steps) for loss in args.losses for steps in args.ranker_steps]
    rec = Recommender(paths["tower"], paths["graph"], paths[f"ranker_{keys[0][0]}_{keys[0][1]}"],
                      paths["ranking"], settings)
    asked = []
    for user in users.tolist():
        history, timeline = asked_history(rec, user, val)
        exclude = np.unique(history)
        asked.append((user, {s: rec.sources.source(s, user, history, exclude, timeline)
                             for s in SOURCES}, history))
    merged, fusion_hits = {}, {}
    for w in itertools.product(FUSION_GRID, repeat=len(SOURCES)):
        if max(w) == 1.0:
            weights = dict(zip(SOURCES, w))
            merged[w] = [merge({s: lists[s][0] for s in SOURCES}, weights)[0][:RANK_TOP]
                         for _, lists, _ in asked]
            fusion_hits[w] = hits(merged[w], wanted)
    chosen = choose_fusion(fusion_hits)
    found = {}
    for loss, steps in keys:
        rec.ranker, description = open_ranker(paths[f"ranker_{loss}_{steps}"])
        for v, value in enumerate(VALUES):  # each ordered as a request orders it
            rec.weights = value_model_weights(value, rec.tasks, description)
            own = [rec._rank(user, top, lists, history)[0]
                   for (user, lists, history), top in zip(asked, merged[chosen])]
            for prior in PRIORS:
                found[loss, steps, v, prior] = hits(
                    [o[with_prior(o, top, prior)] for o, top in zip(own, merged[chosen])],
                    wanted)
    return Validation(found, float(fusion_hits[chosen].mean()), dict(zip(SOURCES, chosen)),
                      {w: float(h.mean()) for w, h in fusion_hits.items()})


def halves(users: int) -> Tuple[np.ndarray, np.ndarray]:
    """Positions of the validation users that pick a setting (even) and of those that judge it
    (odd). The best of many settings on the users that picked it is high by chance (the
    winner's curse): a stage's prior, which decides whether it reorders at all, is judged on
    users its setting was not picked on."""
    return np.arange(0, users, 2), np.arange(1, users, 2)


def judged(found: Dict[float, np.ndarray]) -> float:
    """`defer` on the judging half of the users (`halves`): a stage's prior, per-user hits of
    each on all validation users."""
    judge = halves(len(next(iter(found.values()))))[1]
    return defer({prior: hits[judge] for prior, hits in found.items()})


def choose(on_val: Dict[Tuple[str, int, int, float], np.ndarray]
           ) -> Dict[str, Tuple[int, int, float]]:
    """Per loss (per-user validation hits of each setting), the steps and value model of the
    best HR@10 at any prior on the picking half (ties: fewer steps, then VALUES order), and
    their prior `judged` on the other half; the loss best on the picking half first."""
    pick = halves(len(next(iter(on_val.values()))))[0]
    rate: Dict[Tuple[str, int, int], float] = {}  # (loss, steps, value): its best HR@10
    for (loss, steps, value, _), found in on_val.items():
        rate[loss, steps, value] = max(rate.get((loss, steps, value), 0.0), found[pick].mean())
    best: Dict[str, Tuple[int, int]] = {}  # loss: (steps, value)
    for (loss, steps, value), hr in rate.items():
        if loss not in best or (hr, -steps, -value) > (rate[(loss, *best[loss])],
                                                       -best[loss][0], -best[loss][1]):
            best[loss] = (steps, value)
    return {loss: (*best[loss], judged({prior: found for (*setting, prior), found
                                        in on_val.items() if tuple(setting) == (loss, *best[loss])}))
            for loss in sorted(best, key=lambda loss: -rate[(loss, *best[loss])])}


def first_stage_prior(paths: Dict[str, str], ranker: str, first_stage: str, args,
                      fusion: Dict[str, float]) -> Dict[float, np.ndarray]:
    """Per-user validation hits of the validation world's first stage (`first_stage`, of its
    chosen heavy ranker `ranker`) with each prior of PRIORS: its order of the
    THREE_PER_SOURCE-per-source merge (weights `fusion`) fused with the merged order of that
    weight, asked as validation_hr asks."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.rank_fusion import merge, with_prior
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    users, wanted, val = test_users(paths["retrieval"], args.val_users)
    settings = RecommendSettings(k=10, per_source=THREE_PER_SOURCE, value=VALUE,
                                 pixie=PixieParams(steps=args.pixie_steps))
    rec = Recommender(paths["tower"], paths["graph"], ranker, paths["ranking"], settings,
                      first_stage)
    orders = []
    for user in users.tolist():
        history, timeline = asked_history(rec, user, val)
        exclude = np.unique(history)
        lists = {s: rec.sources.source(s, user, history, exclude, timeline)[0] for s in fusion}
        merged = merge(lists, fusion)[0]
        orders.append((rec.first_stage.order(user, merged), merged))
    return {prior: hits([own[with_prior(own, merged, prior)] for own, merged in orders], wanted)
            for prior in PRIORS}


def test_users(retrieval: str, limit: int):
    """A retrieval dataset's test users and their findable test items (the first `limit`;
    0: all) and its validation items by user."""
    root = Path(retrieval)
    users, wanted = findable(root, "test", ("train", "val"))
    val = dict(zip(np.load(root / "val_user.npy").tolist(),
                   np.load(root / "val_item.npy").tolist()))
    if limit:
        users, wanted = users[:limit], wanted[:limit]
    return users, wanted, val
