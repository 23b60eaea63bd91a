"""The features a multi-task ranker trained on a `preprocess interactions --labels` dataset reads,
by user and by item: every row of that dataset is (user_id, item_id, user_<side>..., item_<side>...;
log1p of the user's and of the item's train engagements), so a user's side ids and count, and an
item's, are the same on each of its rows. Read once (numpy over the split files), they give the
rows for any (user, candidate items) pair a request scores. A dataset made with `--candidates`
has the candidate features (serve/candidate_sources.py) after the two counts, and since issue
44's similarity features the SIMILARITY_FEATURES after those (a dataset made before them has
the candidate features alone, and still serves): a request passes them in, computed from its own
sources and history. A dataset made with `--history L` has each row's history last: a
request's is the user's latest L engagements of the dataset (timelines.npz)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from dlrm_hybrid.data.interactions.ranking_history import history_features, read_timelines
from dlrm_hybrid.data.interactions.ranking_log import open_ranking_spec
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.serve.candidate_sources import CANDIDATE_FEATURES, RANKER_CANDIDATE


class RankingFeatures:
    """Per-user and per-item feature tables of a ranking dataset, with its raw ids."""

    def __init__(self, path: str) -> None:
        root = Path(path)
        fspec = open_ranking_spec(path, "--ranker-data")
        names = list(fspec.notes.get("categorical_features") or [])
        dense_names = list(fspec.notes.get("numerical_features") or [])
        # the request's features after the counts: none, the candidate features (a dataset
        # made before the similarity features), or both
        self.similarity_features = dense_names[2:] == list(RANKER_CANDIDATE)
        self.candidate_features = (self.similarity_features
                                   or dense_names[2:] == list(CANDIDATE_FEATURES))
        if fspec.spec.num_dense != len(dense_names) or (
                len(dense_names) != 2 and not self.candidate_features):
            raise UserError(f"--ranker-data: {path} is not a ranking dataset (`preprocess "
                            f"interactions --labels` writes user_id, item_id first, two counts "
                            f"(then, with --candidates, {','.join(RANKER_CANDIDATE)}) and "
                            f"users.txt/items.txt)")
        self.path, self.names = path, names
        self.spec = fspec.spec
        self.user_names = (root / "users.txt").read_text(encoding="utf-8").splitlines()
        self.item_names = (root / "items.txt").read_text(encoding="utf-8").splitlines()
        self.user_of = {name: i for i, name in enumerate(self.user_names)}
        self.item_of = {name: i for i, name in enumerate(self.item_names)}
        self.slots = int((fspec.notes.get("history") or {}).get("slots", 0))
        past = history_features(self.slots)  # the history's columns, last (--history)
        self.timelines = read_timelines(path, "--ranker-data") if self.slots else None
        user_cols = [f for f, n in enumerate(names) if n.startswith("user_") and f > 1
                     and n not in past]
        item_cols = [f for f, n in enumerate(names) if n.startswith("item_") and f > 1]
        # the rows' columns, from the tables, then the history's
        self.order = [0, 1, *user_cols, *item_cols, *[names.index(n) for n in past]]
        users, items = len(self.user_names), len(self.item_names)
        self.user_side = np.zeros((users, len(user_cols)), np.int64)
        self.item_side = np.zeros((items, len(item_cols)), np.int64)
        self.user_dense = np.zeros(users, np.float32)
        self.item_dense = np.zeros(items, np.float32)
        for files in fspec.splits.values():
            numbers = _column(files.numerical, np.float16)
            rows = len(numbers) // max(fspec.spec.num_dense, 1)
            cats = [_column(p, d, rows) for p, d in zip(files.categorical,
                                                        fspec.categorical_dtypes)]
            if len(numbers) != rows * fspec.spec.num_dense:
                raise _damaged(files.numerical, f"not rows of {fspec.spec.num_dense} values")
            dense = numbers.reshape(rows, fspec.spec.num_dense)[:, :2].astype(np.float32)
            u, i = cats[0].astype(np.int64), cats[1].astype(np.int64)
            for ids, names, what in ((u, self.user_names, "users"), (i, self.item_names, "items")):
                if len(ids) and not 0 <= ids.min() <= ids.max() < len(names):
                    raise _damaged(files.categorical[0 if what == "users" else 1],
                                   f"ids outside its {len(names)} {what}.txt")
            self.user_side[u] = np.column_stack([cats[f] for f in user_cols] or
                                                [np.zeros((len(u), 0))])
            self.item_side[i] = np.column_stack([cats[f] for f in item_cols] or
                                                [np.zeros((len(i), 0))])
            self.user_dense[u], self.item_dense[i] = dense[:, 0], dense[:, 1]

    def rows(self, user: int, items: np.ndarray, candidate: Optional[np.ndarray] = None,
             at: Optional[float] = None) -> Tuple[np.ndarray, np.ndarray]:
        """(dense [N, D] float32, ids [N, F] int64 in the dataset's feature order) of `user`
        with each of `items` (the dataset's dense ids); `candidate`: the items' candidate
        features (and, where the dataset has them, the similarity features after them), which a
        dataset made with --candidates needs (and no other takes). `at`: the request's time,
        whose history is the user's engagements before it (None: the latest)."""
        if (candidate is not None) != self.candidate_features:
            raise UserError(f"--ranker-data: {self.path} "
                            + ("has candidate features; give the sources' features" if
                               self.candidate_features else "has no candidate features"))
        n = len(items)
        columns: List[np.ndarray] = [np.full(n, user), items,
                                     *np.repeat(self.user_side[user][None], n, 0).T,
                                     *self.item_side[items].T]
        if self.timelines is not None:  # the user's latest engagements, every candidate's
            columns += [np.full(n, v) for v in np.concatenate(
                self.timelines.latest(user, self.slots, at))]
        ids = np.empty((n, len(self.order)), np.int64)
        for column, f in zip(columns, self.order):
            ids[:, f] = column
        dense = np.column_stack([np.full(n, self.user_dense[user]), self.item_dense[items],
                                 *([] if candidate is None else [candidate])])
        # as the dataset stored them: float16
        return dense.astype(np.float16).astype(np.float32), ids


def _column(path, dtype, rows: Optional[int] = None) -> np.ndarray:
    """A split's column file, `rows` long where given; a one-line error naming it otherwise."""
    try:
        values = np.fromfile(path, dtype)
    except OSError as e:
        raise _damaged(path, f"cannot read ({e.strerror or e})") from None
    if rows is not None and len(values) != rows:
        raise _damaged(path, f"{len(values)} rows, its split's numerical.bin {rows}")
    return values


def _damaged(path, what: str) -> UserError:
    return UserError(f"--ranker-data: {path}: {what}; the ranking dataset is damaged: "
                     f"preprocess it again")
