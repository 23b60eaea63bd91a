"""Planted interaction logs for two-tower retrieval: a known answer, as the ranker's synthetic
clicks have.

A teacher gives every user and item a latent vector (its segment's or category's centre plus
its own part) and every item a Zipf popularity; each user engages with `data.interactions_per_user`
distinct items drawn without replacement from softmax(scale * <u, v> + log popularity), in draw
order (the order is the timeline). The last engagement is test, the one before validation
(leave-last-out). Given the earlier draws, the next one is a softmax over the items not drawn
yet, so ranking those items by the teacher's score is the best any model can do: its recall on
val and test (`ceiling`) is recorded in the dataset's `extra` as the ceiling a learner can reach,
beside a popularity ranking's (the floor a personalised model must beat). Every rank builds the
same data from `data.seed`.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from dlrm_hybrid.data.interactions.interaction_data import InteractionData
from dlrm_hybrid.data.interactions.interaction_meta import (ITEM_CATEGORIES, USER_SEGMENTS,
                                                            planted_meta)

CEILING_K = (10, 50, 100)
USERS_PER_CHUNK = 1024  # users scored at once by `ranking_metrics`: bounds its memory
AFFINITY = 8.0  # logit of a perfect user-item match (times data.teacher_scale)
OWN = 0.5  # weight of a user's (item's) own part beside its segment's (category's) centre


def teacher(data_cfg):
    """(user vectors [U, d], item vectors [I, d], item log-popularity [I], user segments,
    item categories), a pure function of `data.seed`."""
    rng = np.random.default_rng(data_cfg.seed)
    d, users, items = data_cfg.teacher_dim, data_cfg.users, data_cfg.items
    segment = rng.integers(0, USER_SEGMENTS, users)
    category = rng.integers(0, ITEM_CATEGORIES, items)
    centres_u = rng.normal(size=(USER_SEGMENTS, d))
    centres_i = rng.normal(size=(ITEM_CATEGORIES, d))
    u = _unit(centres_u[segment] + OWN * rng.normal(size=(users, d)))
    v = _unit(centres_i[category] + OWN * rng.normal(size=(items, d)))
    rank = rng.permutation(items)  # popularity rank of each item
    log_pop = -data_cfg.zipf_exponent * np.log1p(rank)
    return u, v, log_pop, segment, category


def teacher_scores(data_cfg, u: np.ndarray, v: np.ndarray, log_pop: np.ndarray) -> np.ndarray:
    return AFFINITY * data_cfg.teacher_scale * (u @ v.T) + log_pop


def planted_interactions(data_cfg) -> InteractionData:
    u, v, log_pop, segment, category = teacher(data_cfg)
    rng = np.random.default_rng(data_cfg.seed + 1)
    scores = teacher_scores(data_cfg, u, v, log_pop)
    drawn = draws(data_cfg, scores, rng)
    n = drawn.shape[1]
    users = np.repeat(np.arange(data_cfg.users), n).reshape(-1, n)
    order = rng.permutation(data_cfg.users * (n - 2))  # a batch mixes users, as a shuffled log
    pairs = {"train": (users[:, :-2].ravel()[order], drawn[:, :-2].ravel()[order]),
             "val": (users[:, -2], drawn[:, -2]), "test": (users[:, -1], drawn[:, -1])}
    meta = planted_meta(data_cfg)
    counts = np.bincount(drawn[:, :-2].ravel(), minlength=data_cfg.items)
    popularity = counts - np.arange(data_cfg.items) / data_cfg.items  # ties: the lower id first
    for split, column in (("val", n - 2), ("test", n - 1)):
        prefix = "" if split == "test" else "val_"
        for name, score in (("ceiling", lambda rows: scores[rows]),
                            ("popularity", lambda rows: np.broadcast_to(
                                popularity, (len(rows), data_cfg.items)))):
            found = ranking_metrics(score, drawn[:, :column], drawn[:, column])
            meta.extra.update({f"{name}_{prefix}{k}": round(x, 4) for k, x in found.items()})
    position = np.tile(np.arange(n - 2), data_cfg.users)[order]  # draw order is the timeline
    return InteractionData(meta, pairs, segment[:, None], category[:, None],
                           train_position=position)


def draws(data_cfg, scores: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each user's engagements [U, min(data.interactions_per_user, data.items)]: items drawn
    without replacement from softmax(`scores`) (Gumbel top-k), in draw order (the timeline)."""
    gumbel = -np.log(-np.log(rng.uniform(size=scores.shape)))
    return np.argsort(-(scores + gumbel), axis=1)[:, :data_cfg.interactions_per_user]


def ranking_metrics(score, seen: np.ndarray, target: np.ndarray) -> Dict[str, float]:
    """recall@K (= HR@K: one relevant item per user), NDCG@K and MRR of ranking all items by
    `score(user rows) -> [rows, items]`, leaving out each user's `seen` [U, s] items, for the
    relevant item `target` [U]; exact, in chunks of users. The target's rank is the number of
    items scored strictly higher, as retrieval/evaluate.py counts it."""
    ranks = np.empty(len(target), np.int64)
    for first in range(0, len(target), USERS_PER_CHUNK):
        rows = np.arange(first, min(first + USERS_PER_CHUNK, len(target)))
        s = np.array(score(rows), dtype=np.float64)
        own = s[np.arange(len(rows)), target[rows]]
        s[np.arange(len(rows))[:, None], seen[rows]] = -np.inf
        ranks[rows] = (s > own[:, None]).sum(1)
    out = {}
    for k in CEILING_K:
        hit = ranks < k
        out[f"recall@{k}"] = float(hit.mean())
        out[f"ndcg@{k}"] = float((hit / np.log2(ranks + 2.0)).mean())
    out["mrr"] = float((1.0 / (ranks + 1.0)).mean())
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)
