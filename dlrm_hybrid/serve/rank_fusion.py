"""Reciprocal-rank fusion (Cormack, Clarke and Buettcher, SIGIR 2009): an item's score is
sum_s w_s / (RRF_K + rank_s), which needs no calibration between the scores of what is fused
(inner products, visit counts, a value model). Two uses: the candidate sources' lists merged
into one, and a stage's own order fused with the order it was handed (`with_prior`), the
score interpolation of multi-stage rankers that keeps a later stage from undoing an earlier
one where validation says the earlier one knows more."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np

RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al.'s)


def merge(lists: Dict[str, np.ndarray], weights: Optional[Dict[str, float]] = None
          ) -> Tuple[np.ndarray, Dict[int, List[str]]]:
    """The sources' lists as one, by reciprocal-rank fusion with each source's weight
    (`weights`: source -> w >= 0, 1 where not named; ties: first found, in the sources'
    order), and the sources that found each item. A source of weight 0 still finds items:
    they follow every item a weighted source found, in the order found."""
    weights = weights or {}
    score: Dict[int, float] = {}
    found_by: Dict[int, List[str]] = {}
    for source, items in lists.items():
        weight = weights.get(source, 1.0)
        for rank, item in enumerate(items.tolist(), 1):
            score[item] = score.get(item, 0.0) + weight / (RRF_K + rank)
            found_by.setdefault(item, []).append(source)
    order = sorted(score, key=lambda item: -score[item])  # stable: first found first on ties
    return np.array(order, np.int64), found_by


def with_prior(own: np.ndarray, incoming: np.ndarray, prior: float) -> np.ndarray:
    """Positions into `own` (a stage's order of some of `incoming`'s items) that order them by
    reciprocal-rank fusion of `own` (weight 1) and `incoming` (the order the stage was handed,
    weight `prior`); prior 0: `own` as it is; prior inf: `incoming`'s order (the stage keeps
    what it was handed, a choice where validation shows the stage's gain is noise). Ties:
    `own`'s order."""
    if prior == 0 or not len(own):
        return np.arange(len(own))
    rank_in = {item: rank for rank, item in enumerate(incoming.tolist(), 1)}
    if np.isinf(prior):
        return np.argsort([rank_in[item] for item in own.tolist()], kind="stable")
    score = [1.0 / (RRF_K + rank) + prior / (RRF_K + rank_in[item])
             for rank, item in enumerate(own.tolist(), 1)]
    return np.argsort(-np.array(score), kind="stable")
