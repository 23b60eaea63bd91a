"""`preprocess first-stage`: the first-stage ranker's dataset, a two-tower (interaction) dataset
whose training engagements are the heavy ranker's choices (Instagram Explore's distillation).

    predict --model ranker.pt --data RANKING --split train --out p.csv --top-k-label 10 \
        --label-out top10.txt
    preprocess first-stage --retrieval RETRIEVAL --ranking RANKING --split train \
        --labels top10.txt --output FIRST

- Input: RANKING, the ranking dataset the heavy ranker was trained on (`preprocess interactions
  --labels`), one of its splits, and `predict --top-k-label`'s file of that split: one 0/1 per
  row, in row order (1: the row is among its request's K of highest value). The file must have
  exactly as many lines as the split has rows, each 0 or 1; anything else is refused.
- Output: RETRIEVAL (the retrieval dataset of the same log) with its training engagements
  replaced by the split's rows labelled 1, mapped by raw id: its users, items, side features,
  raw ids, validation and test pairs stay, so the first stage's dense ids are the funnel's and
  its evaluation is the retrieval dataset's. A row labelled 1 whose user or item RETRIEVAL
  lacks (an item never engaged with positively) is left out, counted in interactions.yaml's
  `extra.first_stage`, which also records every input and the counts (rows = labelled 1 kept
  + left out + labelled 0). A pair labelled 1 in several requests stays once per label.
- Evaluation pairs among the labels: a train request's negatives are drawn from every item the
  user did not engage with in train (ranking_log.never_negative), its validation and test
  items among them, so the heavy ranker may put one in its top K. Such a row stays (counted:
  `evaluation_pairs`): its label is the ranker's choice, which never read that engagement, and
  leaving it out would teach the first stage to score the user's evaluation item below what
  the ranker does. The users' engagements are kept apart (`engaged_user.npy`/`_item.npy`:
  RETRIEVAL's training pairs), and the evaluation and the export's seen items exclude those,
  not the labels, so such a pair is still asked for, as in RETRIEVAL's own evaluation.
- `--engagements`: RETRIEVAL's own training engagements stay as well, the two sets shuffled
  together (seeded by `--seed`): the model learns the users' tastes from the engagements and the
  heavy ranker's choices from the labels (on ml-100k, HR@10 of the first stage alone 0.062 ->
  0.109, docs/recommend.md).
- The output folder appears whole or not at all and never replaces an input.

Trained with the two-tower model's global in-batch softmax and logQ correction (the defaults),
the model learns log P(item | user) over the catalogue for "the heavy ranker puts it in its top
K", so its order over any candidate list is the order of that probability (docs/recommend.md).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional

import numpy as np

from dlrm_hybrid.data.interactions.interaction_meta import (META_FILE, InteractionMeta,
                                                            is_interaction_folder)
from dlrm_hybrid.data.interactions.ranking_log import open_ranking_spec
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import refuse_overwriting_inputs

if TYPE_CHECKING:
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData

SPLIT_FOLDERS = {"train": "train", "val": "validation", "test": "test"}  # --split -> folder
POSITIVE = "in the heavy ranker's top K of its request (predict --top-k-label)"


def add_arguments(parser) -> None:
    parser.add_argument("--retrieval", required=True, metavar="DIR",
                        help="the retrieval dataset of the log (`preprocess interactions`): the "
                             "ids, side features, validation and test the output keeps")
    parser.add_argument("--ranking", required=True, metavar="DIR",
                        help="the ranking dataset (`preprocess interactions --labels`) whose "
                             "split the heavy ranker scored")
    parser.add_argument("--split", choices=tuple(SPLIT_FOLDERS), default="train",
                        help="the split of --ranking that `predict --split` scored (default "
                             "train)")
    parser.add_argument("--labels", required=True, metavar="FILE",
                        help="`predict --top-k-label K --label-out FILE`'s file: one 0/1 per "
                             "row of the split, in row order")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--engagements", action="store_true",
                        help="keep --retrieval's training engagements beside the labelled rows "
                             "(shuffled together)")
    parser.add_argument("--seed", type=int, default=0, help="--engagements: the training "
                        "rows' order (default 0)")


def run(args) -> None:
    from dlrm_hybrid.data.interactions.interaction_data import (open_interactions,
                                                                write_interactions)

    start = time.perf_counter()
    refuse_overwriting_inputs([("--output", args.output)],
                              [("--retrieval", args.retrieval), ("--ranking", args.ranking),
                               ("--labels", args.labels)], "preprocess first-stage")
    if not is_interaction_folder(args.retrieval):
        raise UserError(f"--retrieval: {args.retrieval} has no {META_FILE}; give the retrieval "
                        f"dataset `preprocess interactions` wrote")
    retrieval = open_interactions(args.retrieval)
    if retrieval.meta.extra.get("first_stage"):
        raise UserError(f"--retrieval: {args.retrieval} is a first-stage dataset; give the "
                        f"retrieval dataset of the log (`preprocess interactions`)")
    users, items = ranking_rows(args.ranking, args.split)
    labels = read_labels(args.labels, len(users), args.ranking, args.split)
    data, counts = first_stage_data(retrieval, args.retrieval, args.ranking, users, items, labels,
                                    args.seed if args.engagements else None)
    counts.update(ranking=str(args.ranking), split=args.split, labels=str(args.labels),
                  retrieval=str(args.retrieval))
    data.meta.extra["first_stage"] = counts
    write_interactions(data, args.output, _names(args.retrieval, "users.txt"),
                       _names(args.retrieval, "items.txt"))
    print(f"wrote {args.output} in {time.perf_counter() - start:.1f} s\n"
          f"done: rows={counts['rows']} labelled={counts['labelled']} kept={counts['kept']} "
          f"left_out={counts['left_out']} evaluation_pairs={counts['evaluation_pairs']} "
          f"engagements={counts['engagements']} "
          f"users={data.users} items={data.items} "
          + " ".join(f"{s}={data.num_samples(s)}" for s in data.pairs))


def ranking_rows(ranking: str, split: str) -> tuple:
    """The raw (user, item) ids of each row of `ranking`'s `split`, in row order."""
    fspec = open_ranking_spec(ranking, "--ranking")
    folder = SPLIT_FOLDERS[split]
    if folder not in fspec.splits:
        raise UserError(f"--split: {ranking} has no {folder} split")
    files = fspec.splits[folder]
    user = np.fromfile(files.categorical[0], fspec.categorical_dtypes[0]).astype(np.int64)
    item = np.fromfile(files.categorical[1], fspec.categorical_dtypes[1]).astype(np.int64)
    user_names = np.array(_names(ranking, "users.txt"), dtype=object)
    item_names = np.array(_names(ranking, "items.txt"), dtype=object)
    return user_names[user], item_names[item]


def read_labels(path: str, rows: int, ranking: str, split: str) -> np.ndarray:
    """`predict --label-out`'s 0/1 per row; refused unless one per row of the split."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig").split()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--labels: cannot read {path} "
                        f"({getattr(e, 'strerror', None) or e})") from None
    if len(text) != rows:
        raise UserError(f"--labels: {path} has {len(text)} labels, {ranking}'s {split} split has "
                        f"{rows} rows; give the --label-out of `predict --data {ranking} --split "
                        f"{split} --top-k-label K`")
    bad = next((n for n, t in enumerate(text) if t not in ("0", "1")), None)
    if bad is not None:
        raise UserError(f"--labels: {path} line {bad + 1} is {text[bad]!r}; each line is 0 or 1 "
                        f"(predict --top-k-label's file)")
    return np.array(text) == "1"


def first_stage_data(retrieval: "InteractionData", retrieval_path: str, ranking: str,
                     users: np.ndarray, items: np.ndarray, labels: np.ndarray,
                     engagements_seed: Optional[int] = None) -> tuple:
    """`retrieval` with its train pairs the labelled rows (module docstring), and the counts;
    `engagements_seed` not None: retrieval's train pairs too, shuffled with the labelled ones
    by this seed."""
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData

    user_of = {n: i for i, n in enumerate(_names(retrieval_path, "users.txt"))}
    item_of = {n: i for i, n in enumerate(_names(retrieval_path, "items.txt"))}
    if not user_of or not item_of:
        raise UserError(f"--retrieval: {retrieval_path} has no users.txt/items.txt (raw ids); "
                        f"preprocess the log again")
    chosen = np.flatnonzero(labels)
    user = np.array([user_of.get(n, -1) for n in users[chosen]], np.int64)
    item = np.array([item_of.get(n, -1) for n in items[chosen]], np.int64)
    known = (user >= 0) & (item >= 0)
    if len(chosen) and not known.any():
        raise UserError(f"--ranking: none of {ranking}'s labelled users and items are in "
                        f"{retrieval_path}; give the retrieval dataset of the same log")
    pairs: Dict[str, tuple] = {"train": (user[known], item[known])}
    engaged = 0
    if engagements_seed is not None:
        both = [np.concatenate([np.asarray(a, np.int64), b]) for a, b in
                zip(retrieval.pairs["train"], pairs["train"])]
        order = np.random.default_rng(engagements_seed).permutation(len(both[0]))
        pairs["train"] = (both[0][order], both[1][order])
        engaged = len(retrieval.pairs["train"][0])
    if not len(pairs["train"][0]):  # training would refuse it; say so before writing
        raise UserError(f"--labels: no row of {ranking}'s split is labelled 1, so the training "
                        f"split would be empty; give `predict --top-k-label K`'s file of that "
                        f"split, or add --engagements")
    pairs.update({s: retrieval.pairs[s] for s in retrieval.pairs if s != "train"})
    old = retrieval.meta
    meta = InteractionMeta(old.users, old.items, dict(old.user_side), dict(old.item_side), {},
                           old.split_rule, POSITIVE, list(old.source), dict(old.extra))
    engaged_users, engaged_items = retrieval.pairs["train"]
    history = (np.asarray(engaged_users, np.int64), np.asarray(engaged_items, np.int64))
    data = InteractionData(meta, pairs, np.asarray(retrieval.user_side),
                           np.asarray(retrieval.item_side), "", None, history)
    evaluation = np.concatenate([np.asarray(retrieval.pairs[s][0], np.int64) * old.items
                                 + retrieval.pairs[s][1] for s in ("val", "test")
                                 if s in retrieval.pairs] or [np.zeros(0, np.int64)])
    counts = {"rows": int(len(labels)), "labelled": int(len(chosen)),
              "kept": int(known.sum()), "left_out": int((~known).sum()),
              "evaluation_pairs": int(np.isin(user[known] * old.items + item[known],
                                              evaluation).sum()),
              "engagements": int(engaged)}
    return data, counts


def _names(folder: str, name: str) -> List[str]:
    path = Path(folder) / name
    return path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
