"""The funnel's candidate sources for one user, with the scores and ranks they give each item,
and the ranker's candidate features made from them: one definition, read by `recommend` at
serving time (recommender.py) and by `preprocess interactions --labels --candidates` when it
makes the ranker's training rows (data/interactions/ranking_negatives.py), so that both see
the same features.

Sources (each `per_source` items, best first, the excluded items left out): two_tower, the user
tower's vector searched in the item index; history, each history item's neighbours in the same
index, an item scoring its best; pixie, a Pixie walk from the history items.

Features of an item (CANDIDATE_FEATURES, in this order), 0 for a source that did not find it:
`rrf_<source>` = RRF_K / (RRF_K + rank) (1 at rank 1; the source's share of reciprocal-rank
fusion, scaled), `score_<source>`: two_tower and history the inner product the index gave
(towers with normalized outputs: a cosine); pixie the walk's score over the list's best (in
(0, 1]); then `rrf_merged`, the sum of the three rrf values (the merged order).

Similarity features (SIMILARITY_FEATURES, after them in a dataset that has them): the
candidate's largest and mean cosine to the item vectors of the user's RECENT most recent history
items (`cos_max_recent`, `cos_mean_recent`; the tower's item vectors; 0 without a history):
what the user engaged with last, which the bag of the whole history blurs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.serve.rank_fusion import RRF_K

if TYPE_CHECKING:
    from dlrm_hybrid.graph.pixie import PixieParams, PixieWalker

SOURCES = ("two_tower", "history", "pixie")
CANDIDATE_FEATURES = (*(f"{kind}_{source}" for source in SOURCES for kind in ("rrf", "score")),
                      "rrf_merged")

RECENT = 5  # the history items (most recent first) the similarity features read
SIMILARITY_FEATURES = ("cos_max_recent", "cos_mean_recent")
RANKER_CANDIDATE = (*CANDIDATE_FEATURES, *SIMILARITY_FEATURES)  # what --candidates writes

Ranked = Tuple[np.ndarray, np.ndarray]  # (items best first, their scores)


@dataclass
class CandidateSources:
    """A retrieval folder's Retriever and a Pixie walker over the graph of the same dataset."""

    retriever: object
    walker: "PixieWalker"
    per_source: int
    pixie: "PixieParams"
    sources: Sequence[str] = SOURCES

    def lists(self, user: int, history: np.ndarray, exclude: np.ndarray) -> Dict[str, Ranked]:
        """Each source's (items, scores) for `user` (dense ids of the retrieval folder), walking
        from `history`, `exclude` left out; a source not asked for: empty."""
        return {source: (self.source(source, user, history, exclude) if source in self.sources
                         else _empty()) for source in SOURCES}

    def source(self, source: str, user: int, history: np.ndarray, exclude: np.ndarray,
               timeline: Optional[np.ndarray] = None) -> Ranked:
        """One source's top items for the user and their scores; a history tower (two_tower)
        reads `timeline`, the user's items oldest first, where it is given."""
        per = self.per_source
        if source == "two_tower" and self.retriever.history_length and timeline is not None:
            [(items, scores)] = self.retriever.for_histories([timeline], per, False, [exclude])
            return items, scores
        if source == "two_tower":
            [(items, scores)] = self.retriever.for_users(np.array([user]), per, exclude=[exclude])
            return items, scores
        if not len(history):
            return _empty()
        if source == "history":
            return self.retriever.from_history(history, per, exclude=exclude)
        walk = self.walker.walk(history, params=self.pixie, keep_queries=True)
        keep = ~np.isin(walk.items, exclude)
        return walk.items[keep][:per].astype(np.int64), np.asarray(walk.scores)[keep][:per]


def candidate_features(lists: Dict[str, Ranked], items: np.ndarray) -> np.ndarray:
    """[len(items), len(CANDIDATE_FEATURES)] float32: each item's features from the sources'
    `lists` (module docstring); an item no source found has all zeros."""
    out = np.zeros((len(items), len(CANDIDATE_FEATURES)), np.float32)
    items = np.asarray(items, np.int64)
    for s, source in enumerate(SOURCES):
        found, scores = lists.get(source, _empty())
        if not len(found):
            continue
        scores = np.asarray(scores, np.float64)
        if source == "pixie":
            scores = scores / max(float(scores.max()), 1e-12)
        order = np.argsort(found, kind="stable")
        at = np.minimum(np.searchsorted(found[order], items), len(found) - 1)
        hit = found[order][at] == items
        rank = order[at] + 1
        out[hit, 2 * s] = RRF_K / (RRF_K + rank[hit])
        out[hit, 2 * s + 1] = scores[order][at][hit]
    out[:, -1] = out[:, 0:2 * len(SOURCES):2].sum(1)
    return out


def similarity_features(item_vectors: np.ndarray, recent: np.ndarray, items: np.ndarray
                        ) -> np.ndarray:
    """[len(items), len(SIMILARITY_FEATURES)] float32: each item's largest and mean cosine to
    the vectors of `recent` (the user's history, most recent first; its first RECENT read);
    zeros for an empty history."""
    recent = np.asarray(recent, np.int64)[:RECENT]
    if not len(recent):
        return np.zeros((len(items), len(SIMILARITY_FEATURES)), np.float32)
    unit = lambda v: v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)  # noqa: E731
    cos = unit(item_vectors[np.asarray(items, np.int64)]) @ unit(item_vectors[recent]).T
    return np.stack([cos.max(1), cos.mean(1)], axis=1).astype(np.float32)


def _empty() -> Ranked:
    return np.zeros(0, np.int64), np.zeros(0, np.float32)
