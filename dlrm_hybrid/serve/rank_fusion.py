"""Reciprocal-rank fusion of the candidate sources' lists (Cormack, Clarke and Buettcher, SIGIR
2009): an item's score is sum_s 1 / (RRF_K + rank_s), which needs no calibration between the
sources' scores (inner products, visit counts)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import numpy as np

RRF_K = 60  # reciprocal-rank fusion's constant (Cormack et al.'s)


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
