"""The ranking dataset's negatives (ranking_log.py): uniform over the items a user never engaged
with (`sample_negatives`), and with `--candidates TOWER,GRAPH` the ranker's rows drawn from what
the retrieval stage returns, with the candidate features the funnel computes at serving time
(serve/candidate_sources.py).

Without leaks: TOWER (`export --retrieval`) and GRAPH (`pixie build`) are made from an *early*
retrieval dataset of the same log, `preprocess interactions --holdout-recent K` (each user's K
most recent positives, and the two the split holds out, left out), so they never saw a user's
last engagements. For every user they know:

- the user's cut: the latest row of the log (by time, then file order) whose (user, item) the
  candidate models trained on; only the engagements after it are the ranker's rows (their
  features come from models that did not see them, as a served request's candidates);
- the candidates: each source's top `per_source` from the user's early training items (those
  items left out, nothing else: a later engagement keeps its place), merged by reciprocal-rank
  fusion, the first RANK_TOP kept (what the ranker scores at serving time), with features;
- the similarity features (candidate_sources.py's SIMILARITY_FEATURES): each candidate's
  cosines to the user's RECENT latest early training items before the cut, in the early tower's
  item vectors (`recent_before_cut`: only pairs the early models trained on, never an
  evaluation one), as a served request's are to its latest history items;
- an engagement the candidates do not hold is left out (the ranker only ever orders
  candidates), counted;
- each engagement's negatives: round(N * ratio) drawn uniformly from the user's candidates
  outside ranking_log.never_negative (in train: the user's train engagements only, so a user's
  evaluation item is drawn as often as its other candidates and its absence tells the ranker
  nothing), the rest uniform over every such item (sample_negatives); a uniform negative the
  candidates hold gets its features, any other zeros.

Rows go in requests: an engagement then its N negatives, 1 + N consecutive rows; the train
split's requests shuffled as wholes, so a ranking loss (model.ranking_loss) sees them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError

RANK_TOP = 300  # merged candidates kept per user: `recommend --rank-top`'s default
PER_SOURCE = 200  # each source's candidates: `recommend --per-source`'s default
LEFT_OUT = ("before_cut", "user_without_candidates", "not_a_candidate", "user_engaged_every_item")


@dataclass
class CandidatePool:
    """Per user (the ranking dataset's ids): the cut (a position in the log's chronology; -1:
    no candidates), the candidate items best first and their features."""

    cut: np.ndarray
    items: Dict[int, np.ndarray] = field(default_factory=dict)
    features: Dict[int, np.ndarray] = field(default_factory=dict)
    source: str = ""

    def features_of(self, user: int, items: np.ndarray, width: int) -> np.ndarray:
        """[len(items), width]: the user's candidate features of `items`, zeros for the others."""
        out = np.zeros((len(items), width), np.float32)
        have = self.items.get(user)
        if have is None or not len(have):
            return out
        order = np.argsort(have, kind="stable")
        at = np.minimum(np.searchsorted(have[order], items), len(have) - 1)
        hit = have[order][at] == items
        out[hit] = self.features[user][order[at[hit]]]
        return out


def sample_negatives(users: np.ndarray, engaged: np.ndarray, items: int, per_row: int,
                     rng: np.random.Generator) -> np.ndarray:
    """[len(users), per_row] items drawn uniformly among those the row's user never engaged
    with; `engaged`: sorted keys user * items + item of every engagement. Rows of a user who
    engaged with every item must be left out by the caller."""
    drawn = rng.integers(0, items, (len(users), per_row))
    redo = np.ones(drawn.shape, bool)
    while redo.any():  # rejection: a redraw hits an engaged item with chance < its share
        keys = users[:, None].astype(np.int64) * items + drawn
        pos = np.minimum(np.searchsorted(engaged, keys), len(engaged) - 1)
        redo = engaged[pos] == keys
        drawn[redo] = rng.integers(0, items, int(redo.sum()))
    return drawn


def parse_candidates(text: str) -> Tuple[str, str]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise UserError(f"--candidates: {text!r}; give TOWER,GRAPH: the folders `export "
                        f"--retrieval` and `pixie build` wrote from an early retrieval dataset "
                        f"(`preprocess interactions --holdout-recent K`) of this log")
    return parts[0], parts[1]


def candidate_pool(text: str, raw_users: np.ndarray, raw_items: np.ndarray, log_users,
                   log_items, chronology: np.ndarray, evaluation: np.ndarray,
                   per_source: int = PER_SOURCE, rank_top: int = RANK_TOP) -> CandidatePool:
    """Every user's cut and candidates from the early models in `text` (TOWER,GRAPH).
    `raw_users`/`raw_items`: the ranking dataset's raw ids by id; `log_users`/`log_items`: each
    log row's ranking ids (-1: not kept); `chronology`: the log's rows, oldest first;
    `evaluation`: keys user * items + item the models must not have trained on (--holdout's
    pairs, the ranking dataset's validation and test, re-watches aside:
    ranking_holdout.fresh_evaluation), refused in one line if they did."""
    from dlrm_hybrid.graph.bipartite import read_graph
    from dlrm_hybrid.graph.pixie import PixieParams, PixieWalker
    from dlrm_hybrid.serve.candidate_sources import (CandidateSources, candidate_features,
                                                     similarity_features)
    from dlrm_hybrid.serve.rank_fusion import merge
    from dlrm_hybrid.serve.recommend_inputs import check_graph, open_retriever

    tower, graph_folder = parse_candidates(text)
    retriever = open_retriever(tower)
    user_of = {n.decode("utf-8"): i for i, n in enumerate(raw_users.tolist())}
    item_of = {n.decode("utf-8"): i for i, n in enumerate(raw_items.tolist())}
    to_user = _ids(retriever.user_names, user_of)
    to_item = _ids(retriever.item_names, item_of)
    if (to_item < 0).any() or (to_user < 0).any():
        raise UserError(f"--candidates: {tower} has users or items this log has not; make the "
                        f"early retrieval dataset from the same log")
    trained = np.unique(np.repeat(to_user, np.diff(retriever.seen_indptr)) * len(raw_items)
                        + to_item[retriever.seen_items])
    leaked = np.intersect1d(trained, evaluation)
    if len(leaked):
        user, item = divmod(int(leaked[0]), len(raw_items))
        raise UserError(f"--candidates: {tower} trained on {len(leaked)} evaluation pairs (e.g. "
                        f"user {raw_users[user].decode()}, item {raw_items[item].decode()}: "
                        f"first engaged in --holdout's or this dataset's validation/test), so "
                        f"its features would leak them; make the early dataset with "
                        f"--holdout-recent K (K >= 1)")
    graph = read_graph(graph_folder)
    check_graph(graph.description, retriever, graph_folder)
    sources = CandidateSources(retriever, PixieWalker(graph, "cpu"), per_source, PixieParams())
    pool = CandidatePool(_cuts(trained, to_user, len(raw_users), len(raw_items), log_users,
                               log_items, chronology), source=text)
    recent = recent_before_cut(trained, len(raw_items), log_users, log_items, chronology)
    early_item = np.full(len(raw_items), -1, np.int64)
    early_item[to_item] = np.arange(len(to_item))
    for early_user, user in enumerate(to_user.tolist()):
        history = retriever.seen(early_user)
        lists = sources.lists(early_user, history, history)
        merged = merge({s: items for s, (items, _) in lists.items()})[0][:rank_top]
        pool.items[user] = to_item[merged]
        latest = early_item[recent.get(user, np.zeros(0, np.int64))]
        pool.features[user] = np.concatenate(
            [candidate_features(lists, merged),
             similarity_features(retriever.item_vectors, latest, merged)], axis=1)
    return pool


def recent_before_cut(trained: np.ndarray, items: int, log_users: np.ndarray,
                      log_items: np.ndarray, chronology: np.ndarray) -> Dict[int, np.ndarray]:
    """Per user, the items (ranking ids) of its RECENT latest log rows whose key user * items
    + item is `trained` (the candidate models' pairs), most recent first: the history the
    similarity features read. A row of any other pair (an evaluation one, one after the cut)
    is never read."""
    from dlrm_hybrid.serve.candidate_sources import RECENT

    rows = chronology[log_users[chronology] >= 0][::-1]  # newest first
    rows = rows[np.isin(log_users[rows] * items + log_items[rows], trained)]
    rows = rows[np.argsort(log_users[rows], kind="stable")]  # by user, newest first
    users = log_users[rows]
    rows = rows[np.arange(len(rows)) - np.searchsorted(users, users) < RECENT]  # RECENT each
    users = log_users[rows]
    bounds = np.flatnonzero(np.diff(users)) + 1
    return {int(u[0]): log_items[r] for r, u in zip(np.split(rows, bounds),
                                                    np.split(users, bounds)) if len(r)}


def _ids(names: List[str], index: Dict[str, int]) -> np.ndarray:
    return np.array([index.get(n, -1) for n in names], np.int64)


def _cuts(trained: np.ndarray, to_user: np.ndarray, users: int, items: int,
          log_users: np.ndarray, log_items: np.ndarray, chronology: np.ndarray) -> np.ndarray:
    """Per ranking user, the chronology position of its latest log row whose key user * items
    + item is `trained` (the candidate models' pairs; -1: a user they do not know)."""
    rows = chronology[log_users[chronology] >= 0]
    keys = log_users[rows] * items + log_items[rows]
    position = np.flatnonzero(log_users[chronology] >= 0)
    cut = np.full(users, -1, np.int64)
    cut[to_user] = 0  # known: at least the start
    hit = np.isin(keys, trained)
    np.maximum.at(cut, log_users[rows[hit]], position[hit])
    return cut


def candidate_blocks(users: np.ndarray, items: np.ndarray, positions: np.ndarray,
                     pool: CandidatePool, engaged: np.ndarray, catalogue: int, negatives: int,
                     ratio: float, width: int, rng: np.random.Generator
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, Dict[str, int]]:
    """For one split's engagements (`users`, `items`, their chronology `positions`): which are
    kept, [kept, 1 + negatives] item blocks (the engagement, then its negatives) and
    [kept, 1 + negatives, width] features, and how many were left out, by reason. `engaged`:
    sorted keys user * catalogue + item never to draw (every engagement, every held pair)."""
    known = pool.cut[users] >= 0
    after = positions > pool.cut[users]
    full = np.bincount(engaged // catalogue, minlength=len(pool.cut)) >= catalogue
    found = np.zeros(len(users), bool)
    for user in np.unique(users[known & after]).tolist():
        mine = np.flatnonzero((users == user) & known & after)
        found[mine] = np.isin(items[mine], pool.items[user])
    keep = known & after & found & ~full[users]
    n, from_pool = int(keep.sum()), int(round(negatives * ratio))
    blocks = np.empty((n, 1 + negatives), np.int64)
    blocks[:, 0] = items[keep]
    kept_users = users[keep]
    if negatives:
        blocks[:, 1:] = sample_negatives(kept_users, engaged, catalogue, negatives, rng)
    for user in np.unique(kept_users).tolist():
        mine = np.flatnonzero(kept_users == user)
        have = pool.items[user]
        free = have[~np.isin(user * catalogue + have, engaged)]
        if len(free) and from_pool:
            blocks[mine, 1:1 + from_pool] = rng.choice(
                free, (len(mine), from_pool), replace=len(free) < from_pool * len(mine))
    features = np.zeros((n, 1 + negatives, width), np.float32)
    for user in np.unique(kept_users).tolist():
        mine = np.flatnonzero(kept_users == user)
        features[mine] = pool.features_of(user, blocks[mine].ravel(), width).reshape(
            len(mine), 1 + negatives, width)
    left_out = {"before_cut": int((known & ~after).sum()), "user_without_candidates":
                int((~known).sum()), "not_a_candidate": int((known & after & ~found).sum()),
                "user_engaged_every_item": int((known & after & found & full[users]).sum())}
    return keep, blocks, features, left_out
