"""`preprocess interactions --labels --holdout DIR`: which engagements a ranking dataset leaves
out so that a funnel evaluated on DIR's validation and test items never trained its ranker on
them, and which pairs the early models (--candidates) must not have trained on."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from dlrm_hybrid.data.interactions.interaction_log import Log
from dlrm_hybrid.data.interactions.interaction_meta import SPLITS
from dlrm_hybrid.data.interactions.interaction_split import Prepared, leave_last_out, split_pairs
from dlrm_hybrid.errors import DataError, UserError

SPLIT_FOLDERS = {"train": "train", "val": "validation", "test": "test"}  # interaction -> folder


def holdout_keys(folder: str, prepared: Prepared, splits: Tuple[str, ...] = ("val", "test")
                 ) -> np.ndarray:
    """user * items + item, in `prepared`'s ids, of the pairs of `splits` (default validation
    and test) of `folder`, a retrieval dataset of the same log, matched by the raw ids of its
    users.txt/items.txt."""
    from dlrm_hybrid.data.interactions.interaction_meta import is_interaction_folder

    root = Path(folder)
    hint = "give the retrieval dataset `preprocess interactions` (no --labels) made of this log"
    if not is_interaction_folder(folder):
        what = "not a retrieval dataset (no interactions.yaml)" if root.is_dir() else "not found"
        raise UserError(f"--holdout {folder}: {what}; {hint}")
    ids = []
    for side, known in (("user", prepared.raw_users), ("item", prepared.raw_items)):
        try:
            raw = (root / f"{side}s.txt").read_text(encoding="utf-8").splitlines()
            dense = np.concatenate([np.load(root / f"{s}_{side}.npy") for s in splits])
        except (OSError, ValueError) as e:
            raise DataError(f"--holdout {folder}: cannot read its {side}s ({e}); {hint}")
        if len(dense) and (dense.min() < 0 or dense.max() >= len(raw)):
            raise DataError(f"--holdout {folder}: {side} ids beyond its {side}s.txt; {hint}")
        names = np.array([n.encode("utf-8") for n in raw] or [b""])[dense]
        order = np.argsort(known)
        at = order[np.minimum(np.searchsorted(known[order], names), len(known) - 1)]
        if not (known[at] == names).all():
            first = names[known[at] != names][0].decode("utf-8", "replace")
            raise UserError(f"--holdout {folder}: {side} {first!r} of its "
                            f"{'/'.join(SPLIT_FOLDERS[s] for s in splits)} pairs is not in this "
                            f"log; {hint}")
        ids.append(at.astype(np.int64))
    return np.unique(ids[0] * prepared.data.items + ids[1])


def hold_out(prepared: Prepared, log: Log, keys: np.ndarray, folder: str, seed: int
             ) -> Prepared:
    """`prepared` without the engagements whose user * items + item is in `keys`, split again
    as `prepare` splits (leave-last-out over the rest: each user's last remaining engagement is
    test; a time cut keeps its splits). Ids stay the whole log's: every item keeps its id.
    meta.extra: the rows held out, and the users all in train now."""
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData

    data, extra = prepared.data, prepared.data.meta.extra
    split_of, user_of, item_of = (np.full(len(log), -1, t) for t in (np.int8, np.int64, np.int64))
    for code, split in enumerate(SPLITS):
        rows = prepared.rows[split]
        split_of[rows], (user_of[rows], item_of[rows]) = code, data.pairs[split]
    kept = np.flatnonzero(split_of >= 0)
    key = user_of[kept] * data.items + item_of[kept]
    held = np.isin(key, keys)
    missing = len(keys) - len(np.unique(key[held]))
    if missing:
        raise UserError(f"--holdout {folder}: {missing} of its {len(keys)} validation/test pairs "
                        f"are not rows of this log; make it from the same log")
    chronology, times = kept[~held], log.columns.get("timestamp")
    if times is not None:
        chronology = chronology[np.lexsort((chronology, times[chronology]))]
    if "leave-last-out" in data.meta.split_rule:
        split_of, extra["users_all_in_train"] = leave_last_out(user_of, chronology)
    pairs, rows = split_pairs(
        chronology, split_of, user_of, item_of, seed,
        lambda name: f"--holdout {folder}: the {SPLIT_FOLDERS[name]} split is empty without its "
                     f"pairs; a ranking dataset needs more of the log")
    extra.update(held_out=int(held.sum()), holdout=folder)
    return Prepared(InteractionData(data.meta, pairs, data.user_side, data.item_side),
                    prepared.raw_users, prepared.raw_items, rows)


def fresh_evaluation(prepared: Prepared, held: np.ndarray, holdout: Optional[str]) -> np.ndarray:
    """Keys user * items + item the candidate models must not have trained on: --holdout's
    validation and test pairs (`held`) but those also in its train split, and this dataset's
    validation and test pairs but those also in its own train split. Those are re-watches: the
    models may know them from the earlier training row (a split's training rows come before its
    validation and test rows), and the evaluation never asks for them."""
    data = prepared.data
    keys = {s: u.astype(np.int64) * data.items + i for s, (u, i) in data.pairs.items()}
    own = np.concatenate([k for s, k in keys.items() if s != "train"])
    if holdout:
        held = np.setdiff1d(held, holdout_keys(holdout, prepared, ("train",)))
    return np.union1d(held, np.setdiff1d(own, keys["train"]))
