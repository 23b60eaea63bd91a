"""What benchmarks/recommend.py chooses in its validation world, on validation items only, with
the package's own choice (dlrm_hybrid/serve/funnel_tuning.py, behind `recommend-tune`): the
merge's source weights, each loss's ranker (steps, value model and the weight of the merged
order beside its own: `validation_hr`, `choose`), and in the three-stage funnel the first
stage's weight of the merged order, by the held-out item among the `--first-stage-keep` it
hands on, and the heavy ranker's weight of the first stage's list (`three_stage`). Here: the
benchmark's grids, and its world's requests (the world's test item is the real validation
item, asked with the validation item in the history, as a test request asks)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, NamedTuple, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

from recommend_build import VALUE  # noqa: E402

VALUES = (VALUE, {"liked": 1.0}, {"watched": 1.0})  # the value models validation chooses from
PER_SOURCE, RANK_TOP = 200, 300
THREE_PER_SOURCE = 400  # the three-stage funnel's candidates per source (645 merged on ml-100k)


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


def world_funnel(paths: Dict[str, str], ranker: str, args, first_stage: str = ""):
    """The validation world's funnel (`paths`: recommend_build.validation_log's log built) and
    its requests: each test user asking as a test request asks (history = its training and
    validation items, all excluded; the first args.val_users)."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieParams
    from dlrm_hybrid.serve.funnel_tuning import validation_requests
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    torch.set_num_threads(1)
    settings = RecommendSettings(k=10, per_source=THREE_PER_SOURCE if first_stage else PER_SOURCE,
                                 rank_top=RANK_TOP, value=VALUE,
                                 pixie=PixieParams(steps=args.pixie_steps),
                                 first_stage_keep=args.first_stage_keep)
    rec = Recommender(paths["tower"], paths["graph"], ranker, paths["ranking"], settings,
                      first_stage or None)
    return rec, validation_requests(rec, paths["retrieval"], "test", args.val_users)


def validation_hr(paths: Dict[str, str], args) -> Validation:
    """In the validation world (its models stop before the validation item exactly as the test
    world's stop before the test item): the merge weights chosen on funnel_tuning's grid, then
    HR@10 of each ranker of args.losses x args.ranker_steps, each value model of VALUES and
    each prior of PRIORS on the same RANK_TOP merged items."""
    from dlrm_hybrid.serve.funnel_tuning import evaluate

    keys = [(loss, steps) for loss in args.losses for steps in args.ranker_steps]
    rec, asked = world_funnel(paths, paths[f"ranker_{keys[0][0]}_{keys[0][1]}"], args)
    found = evaluate(rec, asked, {key: paths[f"ranker_{key[0]}_{key[1]}"] for key in keys},
                     VALUES, k=10)
    return Validation(found.found, float(found.merged.mean()), found.fusion,
                      {w: float(h.mean()) for w, h in found.fusion_found.items()})


def three_stage(paths: Dict[str, str], ranker: Tuple[str, int], path: str, first_stage: str,
                args, fusion: Dict[str, float], value: Dict[str, float]):
    """The validation world's three-stage funnel (its first stage `first_stage` of the chosen
    heavy ranker `ranker` = (loss, steps) at `path`, with the value model `value`; the merge
    weights `fusion` chosen on the two-stage funnel): funnel_tuning.Evaluation, whose
    first_stage_prior is judged by the held-out item among the args.first_stage_keep kept,
    and whose `found` holds the heavy ranker's hits at each prior against the kept list."""
    from dlrm_hybrid.serve.funnel_tuning import evaluate

    rec, asked = world_funnel(paths, path, args, first_stage)
    return evaluate(rec, asked, {ranker: path}, [value], k=10, fusion=fusion)


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
