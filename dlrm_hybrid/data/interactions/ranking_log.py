"""`preprocess interactions --labels ...`: an interaction log -> a ranking dataset (split-binary,
several labels) for the DLRM, beside the retrieval dataset the same command makes without them.

- Engagements: every row of the log is one (someone watched, rated, clicked; a row written
  twice, once); reading, ids, side features, duplicates, --min-count and the splits are
  interaction_split.py's (`prepare`, every row a positive), so a user's last engagement is
  test, the one before validation (or a time cut), and the retrieval datasets of the same log
  hold the same rows.
- Labels (`--labels watched,liked:rating>=4,disliked:rating<=2`): NAME alone is 1 on every
  engagement; NAME:COLUMN<op>NUMBER (COLUMN rating or label; >=, <=, >, <, ==, !=) is 1 where
  the row's value passes. Each engagement row is one sample.
- Sampled negatives (`--ranking-negatives N`): per engagement row, N items uniform over the
  items, seeded (--seed), every label 0: in train, never a train engagement of the user (an
  evaluation item as often as any other: `never_negative`); in validation and test, never an
  engagement of the user anywhere in the log. They join their engagement's split (and
  request). A user who engaged with every item gets none (counted).
- Features: categorical user_id, item_id and the side features (user_<name>, item_<name>);
  dense log1p of the user's and of the item's count of train engagements (the train split only:
  nothing from validation or test leaks in); with --candidates, the candidate and similarity
  features after them (ranking_negatives.py).
- Order: train rows shuffled (seeded); in validation and test a user's rows are consecutive (one
  request: `request_feature: user_id` in feature_spec.yaml's metadata), each engagement followed
  by its negatives.
- Held out (`--holdout DIR`, DIR the retrieval dataset of the same log): DIR's validation and
  test (user, item) pairs, matched by raw id, are left out of every split (and never a
  validation or test negative), so a funnel evaluated on DIR's test items never trained its
  ranker on them. Ids stay the whole log's (every item keeps its id); leave-last-out splits
  the rows left.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.data.feature_spec import check_label_names
from dlrm_hybrid.data.interactions.interaction_log import BAD_KINDS, OPS, Log, Positive
from dlrm_hybrid.data.interactions.ranking_history import (Histories, action_rows, check_slots,
                                                           engagement_histories, history_columns,
                                                           history_features, history_note)
from dlrm_hybrid.data.interactions.interaction_split import Prepared, prepare, read_checked_log
from dlrm_hybrid.data.interactions.ranking_holdout import (SPLIT_FOLDERS, fresh_evaluation,
                                                           hold_out, holdout_keys)
from dlrm_hybrid.data.interactions.ranking_negatives import (LEFT_OUT, PER_SOURCE, RANK_TOP,
                                                             CandidatePool, candidate_blocks,
                                                             candidate_pool, sample_negatives)
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.errors import DataError, UserError

REQUEST_FEATURE = "user_id"
CHUNK = 1 << 20  # rows written at a time
DENSE = ("log1p_user_train_engagements", "log1p_item_train_engagements")
LABEL_RULE = re.compile(r"\s*([^:\s]+)\s*(?::\s*(rating|label)\s*(>=|<=|==|!=|>|<)\s*"
                        r"(-?[0-9]+(?:\.[0-9]*)?)\s*)?")


@dataclass(frozen=True)
class LabelRule:
    """One label: 1 on every engagement (no column), or where `column op value` holds."""

    name: str
    column: str = ""
    op: str = ""
    value: float = 0.0

    def __str__(self) -> str:
        return f"{self.column} {self.op} {self.value:g}" if self.column else "every engagement"

    def values(self, log: Log, rows: np.ndarray) -> np.ndarray:
        """The label (0/1) of the log's `rows`."""
        if not self.column:
            return np.ones(len(rows), np.float32)
        return OPS[self.op](log.columns[self.column][rows], self.value).astype(np.float32)


def parse_labels(text: str, layout: Sequence[str]) -> List[LabelRule]:
    """--labels: comma-separated NAME or NAME:rating>=4 (rating or label, the log's column)."""
    rules = []
    for part in text.split(","):
        match = LABEL_RULE.fullmatch(part)
        if not match:
            raise UserError(f"--labels: {part.strip()!r} is not a label; write NAME (1 on every "
                            f"engagement) or NAME:rating>=4 (operators: {' '.join(OPS)}), "
                            f"comma-separated")
        name, column, op, value = match.groups()
        if column and column not in layout:
            raise UserError(f"--labels: {name} reads the log's {column} column, which it has not "
                            f"(its columns: {','.join(layout)}); name it in --columns")
        rules.append(LabelRule(name, column or "", op or "", float(value or 0)))
    check_label_names([r.name for r in rules], "--labels")
    return rules


@dataclass
class Split:
    """One split's samples: user and item ids, labels [N, T], candidate features [N, F] (None
    without --candidates); its engagements, and how many of them got no negatives (their user
    engaged with every item)."""

    users: np.ndarray
    items: np.ndarray
    labels: np.ndarray
    engagements: int
    without_negatives: int
    candidate: Optional[np.ndarray] = None
    left_out: Dict[str, int] = field(default_factory=dict)
    engagement: Optional[np.ndarray] = None  # each sample's engagement (the split's pairs' index)


def never_negative(prepared: Prepared, held: np.ndarray) -> Dict[str, np.ndarray]:
    """Per split, the sorted keys user * items + item its negatives are never drawn from.
    Validation and test: every engagement and `held`, so that no evaluation negative is an
    engagement. Train: the train engagements only, what training may know. Leaving the
    evaluation pairs (`held`, the validation and test engagements) out of train's draws too
    would mark them, a user's evaluation item being the one candidate never drawn: on the
    default planted log, moving each user's train negatives last lifted the merged order's
    HR@10 from 0.242 to 0.308 with no model (0.233 since). So an evaluation item is drawn as
    often as any other."""
    data = prepared.data
    keys = {split: u.astype(np.int64) * data.items + i for split, (u, i) in data.pairs.items()}
    evaluation = np.unique(np.concatenate([*keys.values(), held]))
    return {split: np.unique(keys[split]) if split == "train" else evaluation for split in keys}


def ranking_splits(prepared: Prepared, log: Log, rules: Sequence[LabelRule], negatives: int,
                   seed: int, held: np.ndarray = np.zeros(0, np.int64)) -> Dict[str, Split]:
    """Each split's engagements, each followed by its sampled negatives (never a
    `never_negative` key); train shuffled."""
    data, rng = prepared.data, np.random.default_rng(seed)
    excluded, out = never_negative(prepared, held), {}
    for split, (users, items) in data.pairs.items():
        engaged = excluded[split]
        full = np.bincount(engaged // data.items, minlength=data.users) >= data.items
        labels = np.stack([r.values(log, prepared.rows[split]) for r in rules], axis=1)
        sampled = ~full[users]
        blocks_u = np.repeat(users[:, None], 1 + negatives, axis=1)
        blocks_i = np.concatenate([items[:, None], np.zeros((len(users), negatives), items.dtype)],
                                  axis=1)
        blocks_i[sampled, 1:] = sample_negatives(users[sampled], engaged, data.items, negatives,
                                                 rng)
        blocks_labels = np.zeros((len(users), 1 + negatives, len(rules)), np.float32)
        blocks_labels[:, 0] = labels
        keep = np.ones(blocks_u.shape, bool)
        keep[~sampled, 1:] = False  # no item left to sample for such a user
        order = np.arange(int(keep.sum()))
        if split == "train":
            order = rng.permutation(order)
        engagement = np.repeat(np.arange(len(users))[:, None], 1 + negatives, axis=1)
        out[split] = Split(blocks_u[keep][order], blocks_i[keep][order],
                           blocks_labels[keep][order], len(users),
                           int((~sampled).sum()) if negatives else 0,
                           engagement=engagement[keep][order])
    return out


def candidate_splits(prepared: Prepared, log: Log, rules: Sequence[LabelRule], negatives: int,
                     ratio: float, seed: int, held: np.ndarray, pool: CandidatePool,
                     positions: np.ndarray) -> Dict[str, Split]:
    """--candidates: each split's engagements after their user's cut that the candidates hold,
    each followed by its negatives (ranking_negatives.py), 1 + N rows a request; the train
    split's requests shuffled as wholes. `positions`: each log row's place in the chronology."""
    from dlrm_hybrid.serve.candidate_sources import RANKER_CANDIDATE

    data, rng = prepared.data, np.random.default_rng(seed)
    width, excluded, out = len(RANKER_CANDIDATE), never_negative(prepared, held), {}
    for split, (users, items) in data.pairs.items():
        rows = prepared.rows[split]
        labels = np.stack([r.values(log, rows) for r in rules], axis=1)
        keep, blocks, features, left_out = candidate_blocks(
            users.astype(np.int64), items.astype(np.int64), positions[rows], pool,
            excluded[split], data.items, negatives, ratio, width, rng)
        if not keep.any():
            raise DataError(f"--candidates: no {SPLIT_FOLDERS[split]} engagement is left (after "
                            f"its user's cut and among the candidates: {left_out}); make the "
                            f"early models with a larger --holdout-recent")
        n, size = len(blocks), 1 + negatives
        block_labels = np.zeros((n, size, len(rules)), np.float32)
        block_labels[:, 0] = labels[keep]
        order = rng.permutation(n) if split == "train" else np.arange(n)
        out[split] = Split(np.repeat(users[keep][order].astype(np.int64), size),
                           blocks[order].ravel(), block_labels[order].reshape(n * size, -1), n, 0,
                           features[order].reshape(n * size, width), left_out,
                           np.repeat(np.flatnonzero(keep)[order], size))
    return out


def write_ranking(prepared: Prepared, splits: Dict[str, Split], rules: Sequence[LabelRule],
                  negatives: int, seed: int, output: str, candidates: str = "",
                  ratio: float = 0.0, histories: Optional[Histories] = None,
                  history: int = 0) -> None:
    """The split-binary dataset, its labels, features and how it was made in feature_spec.yaml;
    with `history` slots, each row's history from `histories` (ranking_history.py)."""
    from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
    from dlrm_hybrid.serve.candidate_sources import (RANKER_CANDIDATE, RECENT,
                                                     SIMILARITY_FEATURES)

    data, meta = prepared.data, prepared.data.meta
    dense_names = list(DENSE) + (list(RANKER_CANDIDATE) if candidates else [])
    user_count = np.bincount(data.pairs["train"][0], minlength=data.users)
    item_count = np.bincount(data.pairs["train"][1], minlength=data.items)
    names = ["user_id", "item_id", *[f"user_{n}" for n in meta.user_side],
             *[f"item_{n}" for n in meta.item_side], *history_features(history)]
    spec = DataSpec(len(dense_names), [data.users, data.items, *meta.user_side.values(),
                                       *meta.item_side.values(), *[data.items] * history,
                                       *[action_rows(len(rules))] * history], [1] * len(names))
    with SplitBinaryWriter(output, spec, labels=[r.name for r in rules]) as writer:
        for split, s in splits.items():
            past = (history_columns(histories, prepared.rows[split], data.pairs[split][0],
                                    s.engagement, history) if history else [])
            for lo in range(0, len(s.users), CHUNK):
                u, i = s.users[lo:lo + CHUNK], s.items[lo:lo + CHUNK]
                dense = np.log1p(np.stack([user_count[u], item_count[i]], axis=1))
                if s.candidate is not None:
                    dense = np.concatenate([dense, s.candidate[lo:lo + CHUNK]], axis=1)
                cats = [u, i, *data.user_side[u].T, *data.item_side[i].T,
                        *[c[lo:lo + CHUNK] for c in past]]
                writer.write(SPLIT_FOLDERS[split], s.labels[lo:lo + CHUNK], dense,
                             [c[:, None] for c in cats])
        for key, value in {
                "source": list(meta.source),
                "labels": {r.name: str(r) for r in rules},
                "engagement": "every row of the log",
                "ranking_negatives": negatives,
                "negatives": (f"{negatives} per engagement: {round(negatives * ratio)} drawn "
                              f"from the user's candidates (--candidates {candidates}, the first "
                              f"{RANK_TOP} merged), the rest uniform; in train never a train "
                              f"engagement of the user (an evaluation item as often as any "
                              f"other), in validation and test never an engagement of the user "
                              f"in the log; seed {seed}; every label 0; only "
                              f"engagements after the user's cut that the candidates hold"
                              if candidates else
                              f"{negatives} per engagement, uniform: in train never a train "
                              f"engagement of the user (an evaluation item as often as any "
                              f"other), in validation and test never an engagement of the user "
                              f"in the log; seed {seed}; every label 0"),
                "candidates": {"models": candidates, "ratio": ratio, "rank_top": RANK_TOP,
                               "per_source": PER_SOURCE,
                               "features": list(RANKER_CANDIDATE),
                               "similarity": f"{', '.join(SIMILARITY_FEATURES)}: the "
                                             f"candidate's largest and mean cosine to the "
                                             f"user's {RECENT} latest training items before "
                                             f"the cut, the early tower's item vectors",
                               "left_out": {k: sum(v.left_out.get(k, 0) for v in splits.values())
                                            for k in LEFT_OUT}} if candidates else None,
                "train_request_rows": 1 + negatives if candidates else None,
                "holdout": {"dataset": meta.extra["holdout"], "rows": meta.extra["held_out"],
                            "rule": "its validation and test pairs (raw ids): in no split, "
                                    "never a validation or test negative"}
                if meta.extra["holdout"] else None,
                "history": history_note(history, rules) if history else None,
                "split_rule": meta.split_rule,
                "request_feature": REQUEST_FEATURE,
                "categorical_features": names,
                "numerical_features": dense_names,
                "rows": {"read": meta.extra["rows"],
                         "kept": sum(v.engagements for v in splits.values()),
                         **{k: meta.extra[k] for k in (*BAD_KINDS, "duplicate",
                                                       "below_min_count", "held_out")}},
                "engagements": {SPLIT_FOLDERS[s]: v.engagements for s, v in splits.items()},
                "engagements_without_negatives": sum(v.without_negatives for v in splits.values()),
                "min_count": meta.extra["min_count"]}.items():
            writer.note(key, value)
        if history:
            histories.save(writer.tmp)
        for name, raw in (("users.txt", prepared.raw_users), ("items.txt", prepared.raw_items)):
            writer.add_file(name, "".join(f"{v.decode('utf-8')}\n" for v in raw))


def run(args) -> None:
    """`preprocess interactions --labels`: read, prepare, sample, write; one summary."""
    start = time.perf_counter()
    if args.holdout_recent:
        raise UserError("--holdout-recent: for the early retrieval dataset whose models give "
                        "--candidates; leave it out with --labels")
    if args.positive:
        raise UserError("--positive: with --labels every row of the log is an engagement; say "
                        "what each label is in --labels (e.g. liked:rating>=4)")
    check_slots(args.history)
    if args.ranking_negatives < 0:
        raise UserError(f"--ranking-negatives: must be 0 or more, got {args.ranking_negatives}")
    if not 0 <= args.candidate_ratio <= 1:
        raise UserError(f"--candidate-ratio: the share of negatives drawn from the candidates, "
                        f"in [0, 1]; got {args.candidate_ratio}")
    if args.candidates and args.ranking_negatives < 1:
        raise UserError("--candidates: give --ranking-negatives N >= 1, the negatives of each "
                        "engagement (--candidate-ratio of them from the candidates)")
    log, cut = read_checked_log(args)
    rules = parse_labels(args.labels, log.layout)
    prepared = prepare(log, Positive(), args.min_count, args.split, cut, args.seed)
    held = np.zeros(0, np.int64)
    prepared.data.meta.extra.update(held_out=0, holdout="")
    if args.holdout:
        held = holdout_keys(args.holdout, prepared)
        prepared = hold_out(prepared, log, held, args.holdout, args.seed)
    if args.candidates:
        positions, users, items = chronology_of(prepared, log)
        evaluation = fresh_evaluation(prepared, held, args.holdout)
        pool = candidate_pool(args.candidates, prepared.raw_users, prepared.raw_items, users,
                              items, np.argsort(positions), evaluation)
        splits = candidate_splits(prepared, log, rules, args.ranking_negatives,
                                  args.candidate_ratio, args.seed, held, pool, positions)
    else:
        splits = ranking_splits(prepared, log, rules, args.ranking_negatives, args.seed, held)
    histories = (engagement_histories(*chronology_of(prepared, log),
                                      np.stack([r.values(log, np.arange(len(log))) for r in rules],
                                               axis=1), prepared.data.users,
                                      log.columns.get("timestamp"))
                 if args.history else None)
    write_ranking(prepared, splits, rules, args.ranking_negatives, args.seed, args.output,
                  args.candidates or "", args.candidate_ratio, histories, args.history)
    print(summary(prepared, splits, rules, args.ranking_negatives, args.output,
                  time.perf_counter() - start))


def chronology_of(prepared: Prepared, log: Log) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each log row's place in time order: timestamp, then file order; each row's user and
    item in `prepared`'s ids, -1 for a row in no split)."""
    users, items = np.full(len(log), -1, np.int64), np.full(len(log), -1, np.int64)
    for split, (u, i) in prepared.data.pairs.items():
        users[prepared.rows[split]], items[prepared.rows[split]] = u, i
    rows, times = np.arange(len(log)), log.columns.get("timestamp")
    order = rows if times is None else np.lexsort((rows, times))
    positions = np.empty(len(log), np.int64)
    positions[order] = rows
    return positions, users, items


def summary(prepared: Prepared, splits: Dict[str, Split], rules: Sequence[LabelRule],
            negatives: int, output: str, seconds: float) -> str:
    """What was read, kept and left out, each split's rows and label rates; a `done:` line."""
    e, meta = prepared.data.meta.extra, prepared.data.meta
    unsampled = sum(s.without_negatives for s in splits.values())
    bad = sum(e[k] for k in BAD_KINDS)
    kept = sum(s.engagements for s in splits.values())
    left = {k: sum(s.left_out.get(k, 0) for s in splits.values()) for k in LEFT_OUT}
    lines = [f"wrote {output} in {seconds:.1f} s (a ranking dataset: split-binary)",
             f"  read       {e['rows']:,} rows = {kept:,} engagements kept + {bad:,} bad rows "
             f"skipped + {e['duplicate']:,} duplicates (a row written twice: kept once) + "
             f"{e['below_min_count']:,} below --min-count {e['min_count']}"
             + (f" + {e['held_out']:,} held out (--holdout {e['holdout']}: its validation and "
                f"test pairs, in no split)" if e["holdout"] else "")
             + (f" + {sum(left.values()):,} not the candidates' (below)"
                if any(s.candidate is not None for s in splits.values()) else ""),
             f"  kept       {meta.users:,} users, {meta.items:,} items; split {meta.split_rule}",
             f"  negatives  {negatives} per engagement ({unsampled:,} engagements without: their "
             f"user engaged with every item)",
             "  labels     " + ", ".join(f"{r.name}: {r}" for r in rules)]
    if any(s.candidate is not None for s in splits.values()):
        lines.append("  candidates engagements left out: " + ", ".join(
            f"{k.replace('_', ' ')} {v:,}" for k, v in left.items()))
    for split, s in splits.items():
        rates = ", ".join(f"{r.name} {s.labels[:, t].mean():.3f}" for t, r in enumerate(rules))
        lines.append(f"  {SPLIT_FOLDERS[split]:<10} {len(s.users):,} rows ({s.engagements:,} "
                     f"engagements + {len(s.users) - s.engagements:,} negatives); rates {rates}")
    train = splits["train"]
    lines.append(f"done: rows={e['rows']} kept={kept} skipped={bad} "
                 f"duplicate={e['duplicate']} below_min_count={e['below_min_count']} "
                 f"held_out={e['held_out']} not_candidates={sum(left.values())} "
                 + " ".join(f"{SPLIT_FOLDERS[s]}={len(v.users)}" for s, v in splits.items()) + " "
                 + " ".join(f"rate_{r.name}={train.labels[:, t].mean():.4f}"
                            for t, r in enumerate(rules)) + f" seconds={seconds:.2f}")
    return "\n".join(lines)


def open_ranking_spec(path: str, option: str):
    """The feature spec of a ranking dataset `preprocess interactions --labels` wrote (user_id
    and item_id first, users.txt/items.txt beside it); anything else refused naming `option`."""
    from dlrm_hybrid.data.feature_spec import load_feature_spec

    root = Path(path)
    if not (root / "feature_spec.yaml").is_file():
        raise UserError(f"{option}: {path} has no feature_spec.yaml; give the folder "
                        f"`preprocess interactions --labels` wrote")
    fspec = load_feature_spec(path)
    names = list(fspec.notes.get("categorical_features") or [])
    if names[:2] != ["user_id", "item_id"] or not all(
            (root / f).is_file() for f in ("users.txt", "items.txt")):
        raise UserError(f"{option}: {path} is not a ranking dataset (`preprocess interactions "
                        f"--labels` writes user_id, item_id first and users.txt/items.txt)")
    return fspec
