"""Planted interaction logs for two-tower retrieval: a known answer, as the ranker's synthetic
clicks have.

A teacher gives every user and item a latent vector (its segment's or category's centre plus
its own part) and every item a Zipf popularity; each user engages with `data.interactions_per_user`
distinct items drawn without replacement from softmax(scale * <u, v> + log popularity), in draw
order (the order is the timeline). The last engagement is test, the one before validation
(leave-last-out); the teacher's own ranking on those splits is the ceiling a learner can reach.
Every rank builds the same data from `data.seed`.
"""

from __future__ import annotations

import numpy as np

from dlrm_hybrid.data.interaction_meta import ITEM_CATEGORIES, USER_SEGMENTS, planted_meta

from dlrm_hybrid.data.interaction_data import InteractionData

def teacher(data_cfg):
    """(user vectors [U, d], item vectors [I, d], item log-popularity [I], user segments,
    item categories), a pure function of `data.seed`."""
    rng = np.random.default_rng(data_cfg.seed)
    d, users, items = data_cfg.teacher_dim, data_cfg.users, data_cfg.items
    segment = rng.integers(0, USER_SEGMENTS, users)
    category = rng.integers(0, ITEM_CATEGORIES, items)
    centres_u = rng.normal(size=(USER_SEGMENTS, d))
    centres_i = rng.normal(size=(ITEM_CATEGORIES, d))
    u = _unit(centres_u[segment] + rng.normal(size=(users, d)))
    v = _unit(centres_i[category] + rng.normal(size=(items, d)))
    rank = rng.permutation(items)  # popularity rank of each item
    log_pop = -data_cfg.zipf_exponent * np.log1p(rank)
    return u, v, log_pop, segment, category


def teacher_scores(data_cfg, u: np.ndarray, v: np.ndarray, log_pop: np.ndarray) -> np.ndarray:
    return 4.0 * data_cfg.teacher_scale * (u @ v.T) + log_pop


def planted_interactions(data_cfg) -> InteractionData:
    u, v, log_pop, segment, category = teacher(data_cfg)
    rng = np.random.default_rng(data_cfg.seed + 1)
    n = min(data_cfg.interactions_per_user, data_cfg.items)
    scores = teacher_scores(data_cfg, u, v, log_pop)
    gumbel = -np.log(-np.log(rng.uniform(size=scores.shape)))
    drawn = np.argsort(-(scores + gumbel), axis=1)[:, :n]  # without replacement, in draw order
    users = np.repeat(np.arange(data_cfg.users), n).reshape(-1, n)
    order = rng.permutation(data_cfg.users * (n - 2))  # a batch mixes users, as a shuffled log
    pairs = {"train": (users[:, :-2].ravel()[order], drawn[:, :-2].ravel()[order]),
             "val": (users[:, -2], drawn[:, -2]), "test": (users[:, -1], drawn[:, -1])}
    return InteractionData(planted_meta(data_cfg), pairs, segment[:, None], category[:, None])


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)
