"""A planted sequential log: a world whose next item depends on the history (and on its times)
in a way known exactly, so a sequence model (HSTU, `model.kind: hstu`) can be measured against
the best possible ranking rather than only against another model.

The world (`planted_sequences`), a pure function of its seed:
- TOPICS on a ring: the items are placed on a ring in a random order; topic t is the
  `topic_size` items around ring position t * items // topics, weighted Zipf(`zipf`) by their
  distance from that centre. Neighbouring topics share most of their items (defaults: 60 of
  100), far ones none: one item rarely names its topic, several of a session's do.
- A user: a home topic h (uniform) and a length L (uniform in [min_len, max_len], below
  topic_size so a topic is never used up). Item 0 starts a session; after each item the user
  continues the session with probability `continue_p` (the same topic), else starts a new one
  whose topic is h with probability `home_q`, the next topic on the ring (z + 1: a taste
  drifts, a series goes on) with probability `drift`, else uniform over all topics (the first
  session: h with probability `home_q`, else uniform). Each item
  is drawn from the session's topic among the items the user does not have yet (weights
  renormalised): no (user, item) repeats.
- Times (integer seconds, strictly increasing per user): a session's items are 1 s .. 1 h apart
  (log-normal, median 3 minutes), sessions 4 h .. 60 days apart (log-normal, median 2 days). The
  ranges do not meet, so the gaps tell exactly where sessions start, and a drift to z + 1 is
  hard to see in the items alone (its items are mostly z's): a model reading times knows which
  recent items share the current topic and that it moved on; one reading positions only
  (SASRec) must guess both.

Scores for each user's LAST item given everything before it (leave-last-out's test item), the
catalogue ranked with the user's earlier items left out (`ceiling`):
- `oracle` (the ceiling, `hr@10`...): knows h and the current session's topic z and ranks by the
  exact P(next = i) = continue_p * P(i | z) + (1 - continue_p) * sum_z' P(z' | h, z) P(i | z'),
  each P(. | topic) renormalised over the user's unseen items. Nothing seeing only the log can
  do better in expectation.
- `bayes` (what the log allows): the same mixture under the exact posterior of (h, z) given the
  items and the session starts the times show (a forward filter over the T x T states);
  `bayes_untimed`: the posterior given the items alone (session starts unknown, each step a
  continuation with probability continue_p). bayes / oracle is how close a learner can come;
  bayes - bayes_untimed is what the times are worth.
- `popularity`: training counts (all but each user's last two items).
Numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional

import numpy as np

K = 10  # hr@K, ndcg@K
USERS_PER_CHUNK = 512  # users scored at once: bounds memory at chunk x items (x topics^2)
IN_SESSION = (1, 3600, 180.0)  # seconds: min, max, median of a gap inside a session
BETWEEN = (4 * 3600, 60 * 86400, 2 * 86400.0)  # seconds between sessions: min, max, median
START = 1_600_000_000  # users start within a year of this (Unix seconds)


@dataclass
class World:
    """The settings; `planted_sequences` documents what each does."""

    users: int
    items: int
    seed: int = 0
    topics: int = 50
    topic_size: int = 100
    zipf: float = 1.0
    continue_p: float = 0.5
    home_q: float = 0.1
    drift: float = 0.8
    min_len: int = 8
    max_len: int = 40


@dataclass
class PlantedLog:
    """The world and its log: rows by user, then time; `topic` is each row's session topic."""

    world: World
    weights: np.ndarray  # [topics, items] each topic's distribution
    home: np.ndarray  # [users]
    user: np.ndarray  # [rows]
    item: np.ndarray
    time: np.ndarray  # int64 seconds
    topic: np.ndarray
    new_session: np.ndarray  # bool: the row starts a session
    starts: np.ndarray = field(init=False)  # [users + 1] row offsets

    def __post_init__(self) -> None:
        self.starts = np.searchsorted(self.user, np.arange(self.world.users + 1))

    def padded(self, what: np.ndarray) -> np.ndarray:
        """[users, max_len] of a per-row array, -1 past each user's length."""
        lengths = np.diff(self.starts)
        out = np.full((self.world.users, lengths.max()), -1, np.int64)
        out[np.arange(lengths.max())[None, :] < lengths[:, None]] = what
        return out


def planted_sequences(users: int, items: int, seed: int = 0, **settings) -> PlantedLog:
    """The world of `World(users, items, seed, **settings)` and its log."""
    w = World(users, items, seed, **settings)
    if not 3 <= w.min_len <= w.max_len < w.topic_size <= items or w.home_q + w.drift > 1:
        raise ValueError("need 3 <= min_len <= max_len < topic_size <= items, home_q + drift "
                         "<= 1")
    rng = np.random.default_rng(seed)
    weights = np.zeros((w.topics, items))
    zipf = 1.0 / np.arange(1, w.topic_size + 1) ** w.zipf
    ring, step = rng.permutation(items), items // w.topics
    offsets = np.arange(w.topic_size) - w.topic_size // 2
    near = np.argsort(np.abs(offsets + 0.25), kind="stable")  # nearest the centre first
    for t in range(w.topics):
        weights[t, ring[(t * step + offsets[near]) % items]] = zipf / zipf.sum()
    home = rng.integers(0, w.topics, users)
    length = rng.integers(w.min_len, w.max_len + 1, users)
    seen = np.zeros((users, items), bool)
    item = np.full((users, w.max_len), -1)
    topic, new = np.full_like(item, -1), np.zeros(item.shape, bool)
    z = np.zeros(users, np.int64)
    for step in range(w.max_len):
        live = np.flatnonzero(length > step)
        fresh = (rng.random(len(live)) >= w.continue_p) | (step == 0)
        u = rng.random(len(live))
        drifts = (u < w.home_q + w.drift) & (step > 0)  # the first session: home or uniform
        nxt = np.where(u < w.home_q, home[live], np.where(
            drifts, (z[live] + 1) % w.topics, rng.integers(0, w.topics, len(live))))
        z[live] = np.where(fresh, nxt, z[live])
        p = weights[z[live]] * ~seen[live]
        cum = np.cumsum(p, axis=1)
        pick = (cum < rng.random(len(live))[:, None] * cum[:, -1:]).sum(1)
        seen[live, pick] = True
        item[live, step], topic[live, step], new[live, step] = pick, z[live], fresh
    valid = item >= 0
    gaps = np.where(new, _log_normal(rng, BETWEEN, item.shape),
                    _log_normal(rng, IN_SESSION, item.shape))
    gaps[:, 0] = rng.integers(0, 365 * 86400, users)
    time = START + np.cumsum(gaps, axis=1)
    user = np.repeat(np.arange(users), w.max_len).reshape(users, -1)
    return PlantedLog(w, weights, home, user[valid], item[valid], time[valid], topic[valid],
                      new[valid])


def _log_normal(rng: np.random.Generator, bounds, shape) -> np.ndarray:
    low, high, median = bounds
    return np.clip(np.rint(rng.lognormal(np.log(median), 1.0, shape)), low, high).astype(np.int64)


def write_log(path, log: PlantedLog) -> None:
    """MovieLens u.data (`user\\titem\\trating\\ttimestamp`): ids from 1, every rating 5 (all
    positive), rows by user then time."""
    rows = np.stack([log.user + 1, log.item + 1, np.full_like(log.user, 5), log.time], 1)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savetxt(path, rows, fmt="%d", delimiter="\t")


def ceiling(log: PlantedLog, corpus: Optional[np.ndarray] = None) -> Dict[str, float]:
    """HR@K, NDCG@K and MRR of each ranking above for every user's last item given the rest,
    over `corpus` (the items a dataset of the log ranks; default every item that occurs)."""
    w, items = log.world, log.padded(log.item)
    lengths = np.diff(log.starts)
    target = items[np.arange(w.users), lengths - 1]
    if corpus is None:
        corpus = np.zeros(w.items, bool)
        corpus[log.item] = True
    counts = np.zeros(w.items)  # training rows: all but each user's last two
    np.add.at(counts, items[np.arange(items.shape[1])[None, :] < lengths[:, None] - 2], 1)
    out: Dict[str, float] = {}
    ranks = {name: np.empty(w.users, np.int64) for name in
             ("oracle", "bayes", "bayes_untimed", "popularity")}
    for first in range(0, w.users, USERS_PER_CHUNK):
        rows = np.arange(first, min(first + USERS_PER_CHUNK, w.users))
        scores = {"oracle": _mixture(log, rows, _state(log, rows)),
                  "bayes": _mixture(log, rows, _posterior(log, rows, timed=True)),
                  "bayes_untimed": _mixture(log, rows, _posterior(log, rows, timed=False)),
                  "popularity": np.broadcast_to(counts - np.arange(w.items) / w.items,
                                                (len(rows), w.items)).copy()}
        for name, s in scores.items():
            own = s[np.arange(len(rows)), target[rows]]
            s[:, ~corpus] = -np.inf
            earlier = np.arange(items.shape[1])[None, :] < lengths[rows, None] - 1
            s[np.nonzero(earlier)[0], items[rows][earlier]] = -np.inf
            ranks[name][rows] = (s > own[:, None]).sum(1)
    for name, r in ranks.items():
        prefix = "" if name == "oracle" else f"{name}_"
        hit = r < K
        out.update({f"{prefix}hr@{K}": float(hit.mean()),
                    f"{prefix}ndcg@{K}": float((hit / np.log2(r + 2.0)).mean()),
                    f"{prefix}mrr": float((1.0 / (r + 1.0)).mean())})
    out["users"] = w.users
    return out


def _state(log: PlantedLog, rows: np.ndarray) -> np.ndarray:
    """[rows, T, T] the point mass on the true (home, current topic) before the last item."""
    z = log.padded(log.topic)[rows, np.diff(log.starts)[rows] - 2]
    state = np.zeros((len(rows), log.world.topics, log.world.topics))
    state[np.arange(len(rows)), log.home[rows], z] = 1.0
    return state


def _home_prior(w: World) -> np.ndarray:
    """[h, z']: P(a new session's topic z' | home h), its drift (to z + 1) left out."""
    return w.home_q * np.eye(w.topics) + (1.0 - w.home_q - w.drift) / w.topics


def _remaining(log: PlantedLog, rows: np.ndarray, upto: np.ndarray) -> np.ndarray:
    """[rows, T]: each topic's weight on items the user has NOT had among its first `upto`."""
    items = log.padded(log.item)[rows]
    before = np.arange(items.shape[1])[None, :] < upto[:, None]
    return 1.0 - np.where(before[:, :, None], log.weights.T[np.maximum(items, 0)], 0.0).sum(1)


def _posterior(log: PlantedLog, rows: np.ndarray, timed: bool) -> np.ndarray:
    """[rows, T, T]: P(home, current topic | the items before the last and, `timed`, which of
    them start sessions), by a forward filter; emissions renormalised over unseen items."""
    w, prior = log.world, _home_prior(log.world)
    items, new = log.padded(log.item)[rows], log.padded(log.new_session)[rows]
    last = np.diff(log.starts)[rows] - 1  # the held-out item's index: filter items before it
    mass = np.ones((len(rows), w.topics))  # each topic's weight on the unseen items
    first = w.home_q * np.eye(w.topics) + (1.0 - w.home_q) / w.topics  # no drift yet
    alpha = np.full((len(rows), w.topics, w.topics), 1.0 / w.topics) * first  # before item 0
    for step in range(last.max()):
        on = step < last
        if step:
            fresh = alpha.sum(2, keepdims=True) * prior + w.drift * np.roll(alpha, 1, 2)
            if timed:  # the gap says whether this item starts a session
                moved = np.where(new[:, step, None, None] == 1, fresh, alpha)
            else:
                moved = w.continue_p * alpha + (1.0 - w.continue_p) * fresh
            alpha = np.where(on[:, None, None], moved, alpha)
        x = np.maximum(items[:, step], 0)
        emit = log.weights[:, x].T / np.maximum(mass, 1e-300)  # [rows, T]
        alpha = np.where(on[:, None, None], alpha * emit[:, None, :], alpha)
        alpha /= alpha.sum((1, 2), keepdims=True)
        mass = np.where(on[:, None], mass - log.weights[:, x].T, mass)
    return alpha


def _mixture(log: PlantedLog, rows: np.ndarray, state: np.ndarray) -> np.ndarray:
    """[rows, items]: P(next item) under a distribution `state` [rows, h, z] of (home, current
    topic): continue_p * P(. | z) + (1 - continue_p) * sum_z' P(z' | h, z) P(. | z'), each topic's
    distribution renormalised over the user's unseen items."""
    w = log.world
    fresh = state.sum(2) @ _home_prior(w) + w.drift * np.roll(state.sum(1), 1, 1)
    topic = w.continue_p * state.sum(1) + (1.0 - w.continue_p) * fresh  # [rows, T]
    mass = _remaining(log, rows, np.diff(log.starts)[rows] - 1)
    return (topic / np.maximum(mass, 1e-300)) @ log.weights
