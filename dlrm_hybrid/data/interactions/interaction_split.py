"""An interaction log (interaction_log.py reads it) -> dense ids, side features and
train/val/test splits, for a dataset folder (interaction_data.py) or a ranking dataset
(ranking_log.py); preprocess_interactions.py is the command.

- Positives: the rows `--positive` accepts (default rating >= 4, label == 1, or every row).
- Ids: `--min-count N` leaves out users and items with fewer than N positives (one pass over
  the counts, not repeated until every count holds); the others are numbered by decreasing count
  of positives (ties: raw id order), their raw ids written in that order to users.txt/items.txt.
- Side features (`user:NAME`, `item:NAME`): one value per user (item), from its most recent row
  (timestamp, then file order) of the past, positive or not: one table serves every split, so
  none may see a held-out period. The past is, with a time cut, the rows before T1; leave-last-
  out, each user's rows before its validation row (a user with nothing held out: all its rows).
  A user (item) without a row there gets a value of its own, unknown. Values numbered by how many
  users (items) have them, most first.
- Splits: leave-last-out per user, by timestamp (ties: file order; no timestamp column: file
  order): the last positive is test, the one before validation, the rest train; a user with
  fewer than 3 positives keeps them all in train. Or a global time cut at T1, T2: before T1
  train, [T1, T2) validation, from T2 test. Train rows are stored in a seeded random order (a
  batch mixes users), val and test by user, then time.
- Duplicates: a row equal to an earlier one in every column (user, item, timestamp, rating or
  label, side values) is that engagement written twice: the first copy stays, the others are
  left out (`duplicate`), so every dataset of a log (retrieval, early, ranking) holds the same
  rows and splits them alike. A pair's rows that differ (another time, another rating) are
  engagements each (a re-watch), as the evaluation counts them.
- Every row read is accounted for, once: kept + bad rows + duplicate + not positive + below
  min-count + held recent (--holdout-recent) = rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import numpy as np

from dlrm_hybrid.data.interactions.histories import timeline_positions
from dlrm_hybrid.data.interactions.interaction_log import Log, Positive, parse_columns, read_log
from dlrm_hybrid.data.interactions.interaction_meta import SPLITS, InteractionMeta

if TYPE_CHECKING:  # it imports torch: not at CLI start
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData
from dlrm_hybrid.data.split_binary_writer import check_output_folders
from dlrm_hybrid.errors import DataError, UserError

SPLIT_RULES = ("leave-last-out", "time")
TRAIN, VAL, TEST = range(3)
SHORT = 3  # positives a user needs for leave-last-out to give it a val and a test item


@dataclass
class Numbering:
    """Dense ids of one column's values: `codes` per row (-1: left out), `raw` per id."""

    codes: np.ndarray
    raw: np.ndarray


def factorize(values: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(index of each value in `uniques`, uniques sorted). Integer ids written plainly are
    counted as integers (np.bincount is much faster than sorting strings)."""
    try:
        numbers = values.astype(np.int64)
        plain = len(values) and (numbers.astype(values.dtype) == values).all()
    except (ValueError, OverflowError):
        plain = False
    if plain and 0 <= numbers.min() and numbers.max() < 4 * len(values) + 1024:
        present = np.bincount(numbers) > 0
        index = np.cumsum(present) - 1
        return index[numbers], np.flatnonzero(present).astype(values.dtype)
    uniques, codes = np.unique(numbers if plain else values, return_inverse=True)
    return codes.ravel(), uniques.astype(values.dtype) if plain else uniques


def by_frequency(codes: np.ndarray, count_rows: np.ndarray, size: int, keep: np.ndarray
                 ) -> np.ndarray:
    """Old code -> new id (-1: dropped): the kept codes by decreasing count over `count_rows`
    (ties: old code order)."""
    counts = np.bincount(codes[count_rows], minlength=size)
    order = np.argsort(-counts, kind="stable")
    order = order[keep[order]]
    mapping = np.full(size, -1, np.int64)
    mapping[order] = np.arange(len(order))
    return mapping


def numbered(values: np.ndarray) -> Numbering:
    """`values` numbered in sorted order."""
    return Numbering(*factorize(values))


def duplicate_rows(log: Log, users: Optional[Numbering] = None,
                   items: Optional[Numbering] = None) -> np.ndarray:
    """Whether each row equals an earlier row (file order) in every column: the later copies
    of one engagement written twice. Only rows of a (user, item) pair with several rows are
    compared column by column: on 1M rows (2% such), 0.07 s on a 2-core EPYC, where np.unique
    of every row as a record took 6.5 s."""
    users = users if users is not None else numbered(log.columns["user"])
    items = items if items is not None else numbered(log.columns["item"])
    pair = users.codes.astype(np.int64) * len(items.raw) + items.codes
    order = np.argsort(pair)
    again = pair[order][1:] == pair[order][:-1]
    rows = np.unique(np.concatenate([order[1:][again], order[:-1][again]]))  # file order
    duplicate = np.zeros(len(pair), bool)
    if not len(rows):
        return duplicate
    columns = [pair[rows]] + [v[rows] for k, v in log.columns.items() if k not in ("user", "item")]
    ranked = np.lexsort((rows, *columns[::-1]))  # by every column, then file order
    same = np.ones(len(rows) - 1, bool)
    for column in columns:
        same &= column[ranked][1:] == column[ranked][:-1]
    duplicate[rows[ranked][1:][same]] = True
    return duplicate


def renumber(numbering: Numbering, kept: np.ndarray) -> Numbering:
    """Ids by decreasing count over the `kept` rows; values without one are left out (-1)."""
    mapping = by_frequency(numbering.codes, kept, len(numbering.raw),
                           np.bincount(numbering.codes[kept], minlength=len(numbering.raw)) > 0)
    ids = mapping[numbering.codes]
    raw = np.empty(int(mapping.max()) + 1, numbering.raw.dtype)
    raw[mapping[mapping >= 0]] = numbering.raw[mapping >= 0]
    return Numbering(ids, raw)


def side_features(ids: np.ndarray, count: int, chronology: np.ndarray,
                  values: Dict[str, np.ndarray]) -> Tuple[np.ndarray, Dict[str, int]]:
    """[count, F] value ids of each entity's most recent row of `chronology` (rows oldest
    first), and each feature's cardinality; an entity without a row there gets a value of its
    own (unknown), after the log's values."""
    order = chronology[ids[chronology] >= 0]
    latest = np.full(count, -1, np.int64)
    latest[ids[order]] = order  # numpy assigns in order: the last (most recent) row wins
    known = latest >= 0
    table = np.zeros((count, len(values)), np.int32)
    cards = {}
    for j, (name, column) in enumerate(values.items()):
        codes, uniques = factorize(column[latest[known]])
        size = len(uniques) + int(not known.all())
        every = np.full(count, len(uniques), np.int64)
        every[known] = codes
        mapping = by_frequency(every, np.arange(count), size, np.ones(size, bool))
        table[:, j] = mapping[every]
        cards[name] = size
    return table, cards


def before_held_out(users: np.ndarray, chronology: np.ndarray, split: np.ndarray) -> np.ndarray:
    """The rows of `chronology` (oldest first) that come before their user's first held-out
    (validation or test) row; all rows of a user with none, or of no kept user (id -1)."""
    position = np.empty(len(users), np.int64)
    position[chronology] = np.arange(len(chronology))
    held = np.flatnonzero(split != TRAIN)
    # one slot more than users: id -1 reads the last, which no held-out row lowers
    first = np.full(int(users.max(initial=-1)) + 2, len(chronology), np.int64)
    np.minimum.at(first, users[held], position[held])
    return chronology[np.arange(len(chronology)) < first[users[chronology]]]


def leave_last_out(users: np.ndarray, chronology: np.ndarray) -> Tuple[np.ndarray, int]:
    """(split of each row, users with fewer than 3 positives): per user, of the rows in
    `chronology` (oldest first), the last one test, the one before validation."""
    order = chronology[np.argsort(users[chronology], kind="stable")]
    counts = np.bincount(users[order])
    last = np.cumsum(counts)[users[order]] - 1  # each sorted row's user's last position
    from_end = last - np.arange(len(order))
    split = np.full(len(users), TRAIN, np.int8)
    long_enough = counts[users[order]] >= SHORT
    split[order[long_enough & (from_end == 0)]] = TEST
    split[order[long_enough & (from_end == 1)]] = VAL
    return split, int(((counts > 0) & (counts < SHORT)).sum())


def time_cut(times: np.ndarray, cut: Tuple[float, float]) -> np.ndarray:
    return np.searchsorted(np.asarray(cut), times, side="right").astype(np.int8)


def parse_cut(text: Optional[str], split: str) -> Optional[Tuple[float, float]]:
    if split != "time":
        if text:
            raise UserError("--cut: only with --split time")
        return None
    try:
        first, second = (float(t) for t in (text or "").split(","))
    except ValueError:
        raise UserError(f"--cut: {text!r}; --split time needs --cut T1,T2 (timestamps: before "
                        f"T1 train, from T1 validation, from T2 test)") from None
    if first > second:
        raise UserError(f"--cut: {first:g} is after {second:g}; give T1 <= T2")
    return first, second


@dataclass
class Prepared:
    data: "InteractionData"
    raw_users: np.ndarray
    raw_items: np.ndarray
    rows: Dict[str, np.ndarray]  # per split, the log rows of its pairs, in their order


def most_recent(users: np.ndarray, chronology: np.ndarray, k: int) -> np.ndarray:
    """The rows of `chronology` (oldest first) among their user's `k` last there."""
    order = chronology[np.argsort(users[chronology], kind="stable")]
    counts = np.bincount(users[order])
    from_end = np.cumsum(counts)[users[order]] - 1 - np.arange(len(order))
    return order[from_end < k]


def prepare(log: Log, positive: Positive, min_count: int = 1, split: str = "leave-last-out",
            cut: Optional[Tuple[float, float]] = None, seed: int = 0,
            holdout_recent: int = 0) -> Prepared:
    """The dataset a log makes: ids, side features, splits; the counts in `meta.extra`.
    `holdout_recent` K: each user's K most recent positives (after --min-count) left out first,
    for an early dataset whose models make a ranking dataset's --candidates."""
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData

    if split == "time" and "timestamp" not in log.columns:
        raise UserError("--split time: the log has no timestamp column; name it in --columns, "
                        "or split leave-last-out")
    rows = np.arange(len(log))
    users, items = numbered(log.columns["user"]), numbered(log.columns["item"])
    duplicate = duplicate_rows(log, users, items)
    marked = positive.mask(log)
    is_positive = marked & ~duplicate
    user_counts = np.bincount(users.codes[is_positive], minlength=len(users.raw))
    item_counts = np.bincount(items.codes[is_positive], minlength=len(items.raw))
    kept = (is_positive & (user_counts >= min_count)[users.codes]
            & (item_counts >= min_count)[items.codes])
    counted = _counts(kept, users, items)  # after --min-count, before --holdout-recent
    below_min_count = int((is_positive & ~kept).sum())
    times = log.columns.get("timestamp")
    every_row = rows if times is None else np.lexsort((rows, times))  # oldest first
    recent = most_recent(users.codes, every_row[kept[every_row]], holdout_recent)
    kept[recent] = False
    users, items = renumber(users, kept), renumber(items, kept)
    chronology = every_row[kept[every_row]]
    u, i = users.codes, items.codes
    short = 0
    if split == "time":
        which = time_cut(times, cut)
        rule = f"time cut: train before {cut[0]:g} <= validation < {cut[1]:g} <= test"
        past = every_row[times[every_row] < cut[0]]
    else:
        which, short = leave_last_out(u, chronology)
        rule = (f"leave-last-out by {'timestamp (ties: file order)' if times is not None else 'file order'}"
                f"; users with < {SHORT} positives: all in train")
        past = before_held_out(u, every_row, which)
    user_side, user_cards = side_features(u, len(users.raw), past,
                                          {n: log.columns[f"user:{n}"] for n in log.side("user")})
    item_side, item_cards = side_features(i, len(items.raw), past,
                                          {n: log.columns[f"item:{n}"] for n in log.side("item")})
    pairs, split_rows = split_pairs(
        chronology, which, u, i, seed,
        lambda name: f"the {name} split is empty ({rule}, {int(kept.sum())} positives kept); "
                     f"{_empty_hint(split)}")
    extra = {"rows": log.rows, **log.bad, "duplicate": int(duplicate.sum()),
             "not_positive": int((~marked & ~duplicate).sum()),
             "below_min_count": below_min_count, "min_count": min_count,
             "dropped_users": int((user_counts > 0).sum()) - counted[0],
             "dropped_items": int((item_counts > 0).sum()) - counted[1],
             "users_all_in_train": short, "seed": seed,
             "holdout_recent": holdout_recent, "held_recent": len(recent),
             "recent_only_users": counted[0] - len(users.raw),
             "recent_only_items": counted[1] - len(items.raw), "columns": ",".join(log.layout)}
    meta = InteractionMeta(len(users.raw), len(items.raw), user_cards, item_cards,
                           split_rule=rule, positive=str(positive), source=list(log.sources),
                           extra=extra)
    stamps = (None if times is None else
              {name: np.asarray(times[r], np.float64) for name, r in split_rows.items()})
    return Prepared(InteractionData(meta, pairs, user_side, item_side,
                                    train_position=train_timeline(chronology, split_rows["train"],
                                                                  pairs["train"][0]),
                                    times=stamps),
                    users.raw, items.raw, split_rows)


def _counts(kept: np.ndarray, users: Numbering, items: Numbering) -> Tuple[int, int]:
    """(users, items) with a `kept` row."""
    def having(n: Numbering) -> int:
        return int((np.bincount(n.codes[kept], minlength=len(n.raw)) > 0).sum())

    return having(users), having(items)


def train_timeline(chronology: np.ndarray, rows: np.ndarray, users: np.ndarray) -> np.ndarray:
    """Each training row's place in its user's timeline (histories.py), the log's `rows` of
    the training pairs in their stored order, `chronology` every kept row oldest first."""
    when = np.empty(int(chronology.max(initial=-1)) + 1, np.int64)
    when[chronology] = np.arange(len(chronology))
    return timeline_positions(np.asarray(users, np.int64), np.argsort(when[rows], kind="stable"))


def split_pairs(chronology: np.ndarray, which: np.ndarray, users: np.ndarray, items: np.ndarray,
                seed: int, empty: Callable[[str], str]
                ) -> Tuple[Dict[str, Tuple[np.ndarray, np.ndarray]], Dict[str, np.ndarray]]:
    """(each split's (users, items), each split's log rows) of the rows in `chronology` (oldest
    first) by their split code `which`: train in a seeded random order (a batch mixes users),
    validation and test by user, then time; a DataError with `empty(split)` for an empty one."""
    pairs, rows = {}, {}
    for code, name in enumerate(SPLITS):
        chosen = chronology[which[chronology] == code]
        if not len(chosen):
            raise DataError(empty(name))
        chosen = (np.random.default_rng(seed).permutation(chosen) if code == TRAIN
                  else chosen[np.argsort(users[chosen], kind="stable")])
        pairs[name] = (users[chosen].astype(np.int32), items[chosen].astype(np.int32))
        rows[name] = chosen
    return pairs, rows

def _empty_hint(split: str) -> str:
    if split == "time":
        return "choose --cut inside the log's time range"
    return (f"leave-last-out needs users with {SHORT} or more positives: check --positive "
            f"and --min-count")


def read_checked_log(args):
    """The log `preprocess interactions` reads, and the split's time cuts, after the checks
    that need no reading (a free --output, --min-count)."""
    if Path(args.output).exists():
        raise DataError(f"{args.output}: already exists; choose another --output or remove it")
    check_output_folders(args.output)
    if args.min_count < 1:
        raise UserError(f"--min-count: must be at least 1, got {args.min_count}")
    columns = parse_columns(args.columns) if args.columns else None
    cut = parse_cut(args.cut, args.split)
    delimiter = "\t" if args.delimiter in ("tab", "\\t") else args.delimiter
    if delimiter and any(c in delimiter for c in '"\r\n'):  # csv and numpy take none of them
        raise UserError(f"--delimiter: {delimiter!r} holds a quote or a line break; give the "
                        f"character(s) between fields, e.g. ',' or '::' or tab")
    log = read_log(args.input, columns, delimiter, args.header, args.skip_bad_rows)
    if not len(log):
        skipped = sum(log.bad.values())
        raise DataError(f"{', '.join(log.sources)}: no rows to read ("
                        + (f"{skipped} bad rows skipped" if skipped else
                           "empty, or a header line only") + "); give a log of interactions")
    return log, cut
