"""Memboost's statistics as features of a ranker's rows (the source's later step: its counters
became features of the learned ranker). A row (query, item, time) reads only impressions
strictly before its time, and the position curve of the random-order impressions before it
too, so no row's feature knows its own engagement or a later one.

Per row: log1p(C), log1p(E), MB = log((C + alpha) / (E + alpha)) of memboost.py, computed over
the pair's impressions before the row; before any random-order impression at position 1 the
curve is the overall rate of the impressions before the row (none before it: 0). Exact per
pair (no `max_pairs` bound): a training set is read once, in time order."""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.serve.impressions import Impressions
from dlrm_hybrid.serve.memboost import POSITIONS, measured_curve

FEATURES = ("memboost_clicks", "memboost_expected", "memboost")


def features_before(log: Impressions, kind: np.ndarray, query: np.ndarray, item: np.ndarray,
                    time: np.ndarray, prior: float = 1.0) -> np.ndarray:
    """[N, 3] float32 FEATURES of each row (`kind` index in QUERY_KINDS, `query`, `item`,
    `time`), from the impressions of `log` before the row's time."""
    if not (np.isfinite(prior) and prior > 0):
        raise UserError(f"memboost features: the prior must be above 0, got {prior}")
    if not np.all(np.isfinite(time)):
        raise UserError("memboost features: every row needs a finite time")
    seen = np.argsort(log.time, kind="stable")
    bucket = np.minimum(log.position, POSITIONS) - 1
    pairs: Dict[Tuple[int, str, str], Tuple[list, np.ndarray]] = {}
    random_clicks, random_shown = np.zeros(POSITIONS), np.zeros(POSITIONS)
    total_clicks = total_shown = 0.0
    out = np.zeros((len(time), 3), np.float32)
    j = 0
    for r in np.argsort(time, kind="stable").tolist():
        while j < len(seen) and log.time[seen[j]] < time[r]:  # strictly before the row
            i = seen[j]
            c, b = float(log.clicked[i]), int(bucket[i])
            entry = pairs.setdefault((int(log.kind[i]), str(log.query[i]), str(log.item[i])),
                                     ([0.0], np.zeros(POSITIONS)))
            entry[0][0] += c
            entry[1][b] += 1
            if log.random[i]:
                random_clicks[b] += c
                random_shown[b] += 1
            total_clicks, total_shown = total_clicks + c, total_shown + 1
            j += 1
        entry = pairs.get((int(kind[r]), str(query[r]), str(item[r])))
        if entry is None:
            continue
        clicks, shown = entry[0][0], entry[1]
        curve = (measured_curve(random_clicks, random_shown) if random_shown[0] else
                 np.full(POSITIONS, total_clicks / total_shown))
        expected = float(shown @ curve)
        out[r] = (np.log1p(clicks), np.log1p(expected),
                  np.log((clicks + prior) / (expected + prior)))
    return out
