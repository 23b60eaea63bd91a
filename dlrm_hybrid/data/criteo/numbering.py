"""Ids from counts: ids 1.. go to a feature's values counted at least `threshold` times, most
frequent first, ties by ascending value, at most `max_rows - 1` of them; id 0 is shared by missing,
rare and beyond-the-table values. So the ids depend neither on input order nor on worker count.

Two ways, same ids:
- in memory, when every count fits in one range: per feature, sort the kept values (`build_table`);
- by ranges of values: the id of value v with count c is 1 + (the feature's values counted more
  than c) + (values counted c in earlier ranges) + (values counted c, smaller than v, in this
  range). The first two need only each range's histogram of counts per feature
  (`range_bases`), so each range is numbered alone, in any process, in memory for one range.

The result is the feature's vocabulary: its kept values in id order (entry k is id k + 1), written
to `vocabulary/cat_<i>.bin` (uint32) with one write per run of consecutive ids.
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.data.criteo.counts import feature_of, value_of
from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL

Histogram = Tuple[np.ndarray, np.ndarray]  # (distinct counts ascending, values with each)


def build_table(values: np.ndarray, counts: np.ndarray, threshold: int,
                max_rows: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Ids 1.. for values counted at least `threshold` times, most frequent first (ties: smaller
    value first, as `values` is sorted), at most max_rows - 1 of them. Returns the kept values
    sorted, for searchsorted, and their ids."""
    keep = counts >= max(threshold, 1)
    ranked = values[keep][np.argsort(-counts[keep].astype(np.int64), kind="stable")]
    ranked = ranked[:None if max_rows is None else max_rows - 1]
    order = np.argsort(ranked)
    return ranked[order], (order + 1).astype(np.uint32)


def number_in_memory(keys: np.ndarray, counts: np.ndarray, threshold: int,
                     max_rows: Optional[int]) -> List[np.ndarray]:
    """Every feature's vocabulary (values in id order) from all the counts (keys ascending)."""
    features, vocabularies = feature_of(keys), []
    for f in range(NUM_CATEGORICAL):
        here = features == f
        values, ids = build_table(value_of(keys[here]), counts[here], threshold, max_rows)
        ordered = np.empty(len(values), np.uint32)
        ordered[ids.astype(np.int64) - 1] = values
        vocabularies.append(ordered)
    return vocabularies


def range_bases(histograms: Sequence[Sequence[Histogram]]) -> Tuple[list, List[int]]:
    """From histograms[range][feature] of the kept counts: per range and feature, (counts,
    ids before the first value with that count in that range); and per feature how many values
    are kept before the table-size cut."""
    bases: list = [[None] * NUM_CATEGORICAL for _ in histograms]
    kept = []
    for f in range(NUM_CATEGORICAL):
        every = np.unique(np.concatenate([h[f][0] for h in histograms] or [np.empty(0)]))
        per_range = []
        for h in histograms:
            n = np.zeros(len(every), np.int64)
            n[np.searchsorted(every, h[f][0])] = h[f][1]
            per_range.append(n)
        total = np.sum(per_range, axis=0) if per_range else np.zeros(0, np.int64)
        higher = total[::-1].cumsum()[::-1] - total  # values counted more than each count
        seen = np.zeros(len(every), np.int64)
        for r, n in enumerate(per_range):
            at = np.searchsorted(every, histograms[r][f][0])
            bases[r][f] = (histograms[r][f][0], (higher + seen)[at])
            seen += n
        kept.append(int(total.sum()))
    return bases, kept


def number_range(keys: np.ndarray, counts: np.ndarray, bases: Sequence[Histogram],
                 max_rows: Optional[int]) -> List[Tuple[np.ndarray, np.ndarray]]:
    """Per feature (values, ids ascending) of one range's kept keys (ascending), cut at the
    table size."""
    features = feature_of(keys)
    order = np.lexsort((-counts.astype(np.int64), features))  # stable: ties stay by value
    features, values, counts = features[order], value_of(keys)[order], counts[order]
    new_class = np.r_[True, (features[1:] != features[:-1]) | (counts[1:] != counts[:-1])]
    first = np.flatnonzero(new_class)
    rank = np.arange(len(keys)) - first[np.cumsum(new_class) - 1]
    out = []
    bounds = np.searchsorted(features, np.arange(NUM_CATEGORICAL + 1))
    for f in range(NUM_CATEGORICAL):
        at = slice(bounds[f], bounds[f + 1])
        known, base = bases[f]
        ids = 1 + base[np.searchsorted(known, counts[at])] + rank[at]
        keep = slice(None) if max_rows is None else ids <= max_rows - 1
        out.append((values[at][keep], ids[keep]))
    return out


def write_by_ids(path: str, values: np.ndarray, ids: np.ndarray) -> None:
    """Put `values` at entries ids - 1 of the vocabulary file (ids ascending), one write per run
    of consecutive ids."""
    if not len(ids):
        return
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    fd = os.open(path, os.O_WRONLY)
    try:
        for block, first in zip(np.split(values.astype("<u4"), breaks), ids[np.r_[0, breaks]]):
            os.pwrite(fd, block.tobytes(), 4 * (int(first) - 1))
    finally:
        os.close(fd)


def cardinalities(kept: Sequence[int], max_rows: Optional[int]) -> List[int]:
    """Rows of each table: id 0 and the kept values, at most max_rows."""
    return [1 + (k if max_rows is None else min(k, max_rows - 1)) for k in kept]
