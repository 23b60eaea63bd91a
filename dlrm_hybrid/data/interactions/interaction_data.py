"""Interaction logs for retrieval (`model.kind: two_tower`): who engaged with what, split.

A dataset folder (written by `preprocess interactions` or the planted generator) holds

    interactions.yaml            what the folder is: counts, features, split and positive rules
    <split>_user.npy / _item.npy one row per positive engagement (dense ids), split = train|val|test
    user_side.npy [users, Fu]    the users' categorical side features, by dense user id
    item_side.npy [items, Fi]    the items' (the corpus the evaluation ranks), by dense item id
    users.txt / items.txt        the raw ids of the log, one per line in dense-id order
    train_position.npy           each training row's place in its user's timeline (histories.py;
                                 older folders lack it: only a history user tower needs it)
    <split>_time.npy             each engagement's timestamp (float64), where the log had them
                                 (interactions.yaml `timestamps: true`): hstu's time bias
    engaged_user.npy / _item.npy where the training pairs are not the users' engagements (a first
                                 stage's labels, first_stage_labels.py): the engagements, what
                                 evaluation and serving exclude as seen (absent: the train pairs)

A training sample is one engagement: the user tower's features (user_id and user_<name> side
features) and the item tower's (item_id, item_<name>), as categorical features of one batch, so
the ranker's loaders, placer, sharding and train pipeline carry it unchanged. A history user
tower's features are instead the user's earlier items, one slot each (histories.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import yaml

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.batch import ClickDataset, Columns, stacked
from dlrm_hybrid.data.interactions.histories import (POSITION_FILE, Histories, History,
                                                     window_rows)
from dlrm_hybrid.data.interactions.interaction_meta import (META_FILE, SPLITS, InteractionMeta,
                                                            history_length, read_meta,
                                                            tower_features)
from dlrm_hybrid.data.split_binary_writer import check_output_folders
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.partial_folder import finish_partial, start_partial

ENGAGED = "engaged"  # engaged_user.npy / engaged_item.npy
TIME = "time"  # <split>_time.npy


class InteractionData(ClickDataset):
    """Engagement pairs per split and the side features of every user and item, in memory
    (`open_interactions` memory-maps a folder's arrays)."""

    def __init__(self, meta: InteractionMeta, pairs: Dict[str, Tuple[np.ndarray, np.ndarray]],
                 user_side: np.ndarray, item_side: np.ndarray, root: str = "",
                 train_position: Optional[np.ndarray] = None,
                 engaged_train: Optional[Tuple[np.ndarray, np.ndarray]] = None,
                 times: Optional[Dict[str, np.ndarray]] = None) -> None:
        """`train_position`: each training row's place in its user's timeline (None: not
        recorded, as in folders written before history towers). `engaged_train`: the users'
        training engagements where the train pairs are other targets (None: the train
        pairs), what `engaged` and `findable` read for the train split. `times`: each split's
        engagement times, aligned with its pairs (None: the log had none)."""
        self.meta, self.pairs, self.root, self.times = meta, pairs, root, times
        self.train_position, self.engaged_train = train_position, engaged_train
        self.histories: Optional[Histories] = None  # set by for_model for a history tower
        # set by for_model for the sequence model: the training rows it reads (window_rows)
        self.train_rows: Optional[np.ndarray] = None
        self.user_side, self.item_side = user_side, item_side  # [users, Fu], [items, Fi]
        self.spec = meta.spec()
        self.users, self.items = meta.users, meta.items
        self.negatives = (0, 1, 0)  # set_uniform_negatives: (per global batch, its size, seed)
        self._engaged: Dict[Tuple[str, ...], Tuple[np.ndarray, np.ndarray]] = {}

    def num_samples(self, split: str) -> int:
        if split == "train" and self.train_rows is not None:
            return len(self.train_rows)
        return len(self.pairs[split][0]) if split in self.pairs else 0

    def for_model(self, model_cfg) -> "InteractionData":
        """The side features the towers read (`tower_features`), the rest left out of batches;
        for a history user tower, the users' histories instead of their features."""
        meta = tower_features(self.meta, model_cfg)
        user_cols = [list(self.meta.user_side).index(n) for n in meta.user_side]
        item_cols = [list(self.meta.item_side).index(n) for n in meta.item_side]
        data = InteractionData(meta, self.pairs, self.user_side[:, user_cols],
                               self.item_side[:, item_cols], self.root, self.train_position,
                               self.engaged_train, self.times)
        if meta.history:
            data.histories = self.histories_of(history_length(model_cfg))
        if model_cfg.kind == "hstu":
            data.train_rows = window_rows(self.pairs["train"][0], self.train_position,
                                          meta.history)
        return data

    def histories_of(self, length: int) -> Histories:
        """The users' timelines, each sample's history `length` items long."""
        if self.train_position is None:
            raise DataError(f"{self.root or 'the dataset'}: has no {POSITION_FILE} (written "
                            f"before history towers), which model.user_tower.encoder history_* "
                            f"needs; preprocess the log again")
        later = {s: p for s, p in self.pairs.items() if s != "train"}
        return Histories(self.users, self.pairs["train"], self.train_position, later, length,
                         self.times)

    def columns(self, split: str, first: int, count: int) -> Columns:
        """Samples [first, first + count) of `split`; rows past its end are padding (valid
        False) that repeat its last sample."""
        users, items = self.pairs[split]
        index = np.arange(first, first + count)
        valid = index < self.num_samples(split)
        index = np.minimum(index, self.num_samples(split) - 1)
        if split == "train" and self.train_rows is not None:
            index = self.train_rows[index]
        users = users[index].astype(np.int64)
        history, times = None, None
        if self.histories is not None:
            train = split == "train"
            history = (self.histories.of_rows(index) if train
                       else self.histories.before(split, users))
            if self.meta.history_times:
                times = (self.histories.times_of_rows(index) if train
                         else self.histories.times_before(split, users))
        return self.tower_columns(users, items[index].astype(np.int64), valid, history=history,
                                  times=times)

    def user_columns(self, users: np.ndarray, valid: np.ndarray, split: str) -> Columns:
        """The user tower's input for `users` when evaluating `split` (the item features are
        item 0's, unread): their features, or their history before `split`."""
        history, times = None, None
        if self.histories is not None:
            history = self.histories.before(split, users)
            if self.meta.history_times:
                times = self.histories.times_before(split, users)
        return self.tower_columns(users, np.zeros_like(users), valid, history=history,
                                  times=times)

    def slice_columns(self, split: str, piece) -> Columns:
        """A rank's slice of a global batch; in training, followed by its uniform negatives."""
        engaged = super().slice_columns(split, piece)
        if split != "train" or not self.negatives[0]:
            return engaged
        count = sum(n for _, n in piece.runs)
        return stacked([engaged, self._uniform_negatives(piece.step, piece.offset, count)])

    def set_uniform_negatives(self, count: int, global_batch: int, seed: int) -> None:
        """Training slices get their share of `count` items per global batch drawn uniformly
        from the corpus (mixed negative sampling), after their engagements: label 0 (negatives
        only), user features empty. The draw depends on (seed, the global batch's step) only,
        so 1 rank and N ranks read the same global set."""
        self.negatives = (count, global_batch, seed)

    def _uniform_negatives(self, place: int, offset: int, count: int) -> Columns:
        """This slice's share of global batch `place`'s draw (`offset`: where it starts)."""
        total, batch, seed = self.negatives
        lo, rest_lo = divmod(offset * total, batch)
        hi, rest_hi = divmod((offset + count) * total, batch)
        if rest_lo or rest_hi:
            raise ConfigError(f"retrieval.uniform_negatives: {total} do not split evenly over the "
                              f"ranks' slices of the global batch ({batch}); use a multiple of the "
                              f"number of ranks")
        items = np.random.default_rng([seed, place]).integers(0, self.items, total)[lo:hi]
        negatives = self.tower_columns(np.zeros_like(items), items, np.ones(len(items), bool),
                                       with_users=False)
        negatives.labels[:] = 0
        return negatives

    def tower_columns(self, users: np.ndarray, items: np.ndarray, valid: np.ndarray,
                      with_users: bool = True, history: Optional[History] = None,
                      times: Optional[np.ndarray] = None) -> Columns:
        """Both towers' ids for these (user, item) pairs; `with_users` False gives the user
        features empty bags (an item-only batch: the corpus). A history tower's user features
        are the `history` slots (slot j: an empty bag past the row's count). Where the model
        reads the slots' times (meta.history_times), they are the dense values: seconds after
        the history's latest item (<= 0; 0 past the end), which float32 holds exactly enough
        for the log2 buckets they go into."""
        n = len(items)
        dense = np.zeros((n, self.meta.history if self.meta.history_times else 0), np.float32)
        if times is not None and with_users:
            counts = history[1]
            latest = times[np.arange(n), np.maximum(counts - 1, 0)]
            used = np.arange(dense.shape[1])[None, :] < counts[:, None]
            dense[:] = np.where(used, times - latest[:, None], 0.0)
        user_ids = [users, *self.user_side[users].T] if len(self.user_side.T) else [users]
        user_len = [np.full(n, int(with_users), np.int32)] * len(user_ids)
        if self.histories is not None:
            length = self.histories.length
            slots, counts = history if history is not None and with_users else (
                np.zeros((n, length), np.int64), np.zeros(n, np.int64))
            user_ids = list(slots.T)
            user_len = [(counts > j).astype(np.int32) for j in range(length)]
        item_ids = [items, *self.item_side[items].T] if len(self.item_side.T) else [items]
        ids = [np.ascontiguousarray(c, dtype=np.int64).reshape(n, 1) for c in (*user_ids, *item_ids)]
        lengths = user_len + [np.ones(n, np.int32)] * len(item_ids)
        return Columns(dense, np.ones(n, np.float32), valid, ids, lengths=lengths)

    def corpus_columns(self, first: int, count: int) -> Columns:
        """Items [first, first + count) for the item tower alone (past the end: padding)."""
        index = np.arange(first, first + count)
        valid = index < self.items
        items = np.minimum(index, self.items - 1)
        return self.tower_columns(np.zeros_like(items), items, valid, with_users=False)

    def engaged(self, splits: Tuple[str, ...]) -> Tuple[np.ndarray, np.ndarray]:
        """CSR (indptr [users + 1], items) of the distinct items each user engaged with in
        `splits`: what the evaluation excludes, or what it asks to find. Computed once per
        `splits` (every evaluation of a run asks again)."""
        if splits not in self._engaged:
            self._engaged[splits] = self._csr(splits)
        return self._engaged[splits]

    def findable(self, split: str, earlier: Tuple[str, ...]) -> Tuple[np.ndarray, np.ndarray]:
        """CSR of the distinct items each user engaged with in `split` but in none of the
        `earlier` splits: a re-engagement cannot be found, as serving never returns an item the
        user engaged with before. What the evaluation asks to find."""
        name = (split, "not", *earlier)
        if name not in self._engaged:
            self._engaged[name] = self._csr((split,), without=self._keys(earlier))
        return self._engaged[name]

    def _keys(self, splits: Tuple[str, ...]) -> np.ndarray:
        """Sorted distinct user * items + item of the engagements of `splits` (train's:
        `engaged_train` where given)."""
        pairs = dict(self.pairs)
        if self.engaged_train is not None:
            pairs["train"] = self.engaged_train
        users = np.concatenate([pairs[s][0] for s in splits if s in pairs] or [[]])
        items = np.concatenate([pairs[s][1] for s in splits if s in pairs] or [[]])
        return np.unique(users.astype(np.int64) * self.items + items.astype(np.int64))

    def _csr(self, splits: Tuple[str, ...], without: np.ndarray = np.zeros(0, np.int64)
             ) -> Tuple[np.ndarray, np.ndarray]:
        key = self._keys(splits)
        key = key[~np.isin(key, without)]
        users, items = key // self.items, key % self.items
        indptr = np.zeros(self.users + 1, np.int64)
        np.add.at(indptr, users + 1, 1)
        return np.cumsum(indptr), items


def open_interactions(path: str) -> InteractionData:
    """A folder written by `write_interactions`, its arrays memory-mapped."""
    meta, root = read_meta(path), Path(path)

    def load(name: str) -> np.ndarray:
        try:
            return np.load(root / name, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise DataError(f"{root / name}: cannot read ({e}); preprocess the log again")

    pairs = {}
    for split in SPLITS:
        if not (root / f"{split}_user.npy").exists():
            continue
        users, items = load(f"{split}_user.npy"), load(f"{split}_item.npy")
        if len(users) != len(items):
            raise DataError(f"{root}/{split}_item.npy: {len(items)} rows, its users file has "
                            f"{len(users)}; preprocess the log again")
        pairs[split] = (users, items)
    engaged = None
    if (root / f"{ENGAGED}_user.npy").exists():
        engaged = (load(f"{ENGAGED}_user.npy"), load(f"{ENGAGED}_item.npy"))
        if len(engaged[0]) != len(engaged[1]):
            raise DataError(f"{root}/{ENGAGED}_item.npy: {len(engaged[1])} rows, its users file "
                            f"has {len(engaged[0])}; preprocess first-stage again")
    position = load(POSITION_FILE) if (root / POSITION_FILE).exists() else None
    times = ({split: load(f"{split}_{TIME}.npy") for split in pairs} if meta.timestamps
             else None)
    for split, stamps in (times or {}).items():
        if len(stamps) != len(pairs[split][0]):
            raise DataError(f"{root}/{split}_{TIME}.npy: {len(stamps)} rows, the {split} split "
                            f"has {len(pairs[split][0])}; preprocess the log again")
    if position is not None and len(position) != len(pairs["train"][0]):
        raise DataError(f"{root / POSITION_FILE}: {len(position)} rows, the training split has "
                        f"{len(pairs['train'][0])}; preprocess the log again")
    data = InteractionData(meta, pairs, load("user_side.npy"), load("item_side.npy"), str(root),
                           position, engaged, times)
    _check_ranges(data, root)
    return data


def _check_ranges(data: InteractionData, root: Path) -> None:
    expect = {"user_side.npy": (data.user_side, data.users, list(data.meta.user_side.values())),
              "item_side.npy": (data.item_side, data.items, list(data.meta.item_side.values()))}
    for name, (table, rows, cards) in expect.items():
        if table.shape != (rows, len(cards)):
            raise DataError(f"{root / name}: shape {table.shape}, interactions.yaml says "
                            f"({rows}, {len(cards)}); preprocess the log again")
        for j, card in enumerate(cards):
            if rows and (table[:, j].min() < 0 or table[:, j].max() >= card):
                raise DataError(f"{root / name}: column {j} has ids outside [0, {card}); "
                                f"preprocess the log again")
    named = dict(data.pairs)
    if data.engaged_train is not None:
        named[ENGAGED] = data.engaged_train
    for split, (users, items) in named.items():
        for what, ids, rows in (("user", users, data.users), ("item", items, data.items)):
            if len(ids) and (ids.min() < 0 or ids.max() >= rows):
                raise DataError(f"{root}/{split}_{what}.npy: ids outside [0, {rows}); "
                                f"preprocess the log again")


def write_interactions(data: InteractionData, path: str, raw_users: List[str] = (),
                       raw_items: List[str] = ()) -> None:
    """Write `data` as a folder at `path`, atomically: built beside it, then renamed, so a
    reader never sees half a dataset. An existing folder is not overwritten."""
    target = Path(path)
    if target.exists():
        raise DataError(f"{target}: already exists; choose another --output or remove it")
    check_output_folders(path)
    partial = start_partial(target, "preprocess interactions")
    try:
        for split, (users, items) in data.pairs.items():
            np.save(partial / f"{split}_user.npy", np.asarray(users, np.int32))
            np.save(partial / f"{split}_item.npy", np.asarray(items, np.int32))
        np.save(partial / "user_side.npy", np.asarray(data.user_side, np.int32))
        np.save(partial / "item_side.npy", np.asarray(data.item_side, np.int32))
        if data.engaged_train is not None:
            for what, ids in zip(("user", "item"), data.engaged_train):
                np.save(partial / f"{ENGAGED}_{what}.npy", np.asarray(ids, np.int32))
        if data.train_position is not None:
            np.save(partial / POSITION_FILE, np.asarray(data.train_position, np.int32))
        for split, stamps in (data.times or {}).items():
            np.save(partial / f"{split}_{TIME}.npy", np.asarray(stamps, np.float64))
        for name, raw in (("users.txt", raw_users), ("items.txt", raw_items)):
            if len(raw):
                (partial / name).write_text("".join(f"{r}\n" for r in raw), encoding="utf-8")
        meta = data.meta
        meta.samples = {s: int(len(p[0])) for s, p in data.pairs.items()}
        meta.timestamps = data.times is not None
        (partial / META_FILE).write_text(yaml.safe_dump(meta.to_yaml(), sort_keys=False))
        finish_partial(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
