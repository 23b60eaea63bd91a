"""`retrieve`: top-K items for a user from a folder `export --retrieval` wrote.

From the user tower (default): the user's features through the scripted tower, its vector
searched in the item index. From a history (`--history I1,I2,...`, the survey's history-based
retrieval): each history item's vector searched in the same index, the neighbour lists merged
into one, an item scoring the MAX of its scores against the history items (an item near any one
of them ranks as high as it is near it; a sum would favour items near their centre). The
user's training items, and the history items, are left out unless `--keep-seen`.

A history user tower (model.user_tower.encoder history_*) reads a history instead of the
user's features: `--user U` gives it U's training items in time order, `--history I1,I2,...`
(oldest first) the items given with the request, for a known user or one the model never saw
(`--user` left out).

Scores are inner products <query vector, item vector> (cosines when the towers normalise; the
training logit is that over model.temperature). This module needs torch, numpy, faiss and yaml
only, not the trainer: a serving host runs `python -m dlrm_hybrid.serve.retrieve` (or the CLI's
`retrieve`) with the exported folder alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

from dlrm_hybrid.compat import jit_load
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import (refuse_overwriting_inputs, require_file_target,
                                      temporary_beside)

FORMAT = "dlrm_hybrid retrieval 1"
DESCRIPTION = "retrieval.yaml"
USER_TOWER, ITEM_VECTORS, USER_SIDE = "user_tower.pt", "item_vectors.npy", "user_side.npy"
SEEN_INDPTR, SEEN_ITEMS = "seen_indptr.npy", "seen_items.npy"  # CSR: each user's training items
HISTORY_INDPTR, HISTORY_ITEMS = "history_indptr.npy", "history_items.npy"  # ... in time order
HISTORY_TIMES = "history_times.npy"  # ... and their times, where the tower reads them (hstu)
USERS, ITEMS = "users.txt", "items.txt"  # raw ids in dense-id order, where the dataset has them
MERGE = "max"  # how history retrieval scores an item found near several history items
HISTORY_BLOCK = 1 << 22  # scores held at once by history retrieval on an exact index (16 MiB)

Ranked = Tuple[np.ndarray, np.ndarray]  # (dense item ids, scores), best first


class Retriever:
    """An exported folder, loaded: the scripted user tower, the item vectors and index, the
    users' side features and training items, the raw ids."""

    def __init__(self, folder: str) -> None:
        from dlrm_hybrid.retrieval.index import INDEX_FILE, read_index

        root = Path(folder)
        self.description = read_description(root)
        self.user_tower = _tower(root / USER_TOWER)
        self.item_vectors = _array(root / ITEM_VECTORS)
        self.user_side = _array(root / USER_SIDE)
        self.seen_indptr, self.seen_items = _array(root / SEEN_INDPTR), _array(root / SEEN_ITEMS)
        self.index = read_index(str(root / INDEX_FILE), self.description["index"])
        self.user_names = read_raw_ids(root / USERS)
        self.item_names = read_raw_ids(root / ITEMS)
        self.user_of = {name: i for i, name in enumerate(self.user_names or ())}
        self.item_of = {name: i for i, name in enumerate(self.item_names or ())}
        history = self.description.get("user_history")
        self.history_length = int(history["length"]) if history else 0
        self.timelines = None  # exported before every tower stored them: only a history tower's
        if (root / HISTORY_INDPTR).is_file():
            self.timelines = _array(root / HISTORY_INDPTR), _array(root / HISTORY_ITEMS)
        self.timeline_times = (_array(root / HISTORY_TIMES) if history and history.get("times")
                               else None)
        self._check_sizes(root)

    def _check_sizes(self, root: Path) -> None:
        """The arrays hold the users and items retrieval.yaml states: a file of another export
        (or cut short) stops here in one line, not in a request."""
        from dlrm_hybrid.retrieval.index import INDEX_FILE

        users, items = self.description.get("users"), self.description.get("items")
        sizes = [(USER_SIDE, len(self.user_side), users, "users"),
                 (SEEN_INDPTR, len(self.seen_indptr) - 1, users, "users"),
                 (ITEM_VECTORS, len(self.item_vectors), items, "items"),
                 (INDEX_FILE, self.index.ntotal, items, "items")]
        for name, names, want, what in ((USERS, self.user_names, users, "users"),
                                        (ITEMS, self.item_names, items, "items")):
            if names is not None:
                sizes.append((name, len(names), want, what))
        for name, rows, want, what in sizes:
            if want is not None and rows != want:
                raise UserError(f"{root / name}: {rows} rows, {DESCRIPTION} says {want} {what}; "
                                f"export the model again")
        if self.seen_indptr[-1] != len(self.seen_items):
            raise UserError(f"{root / SEEN_ITEMS}: {len(self.seen_items)} items, "
                            f"{SEEN_INDPTR} ends at {self.seen_indptr[-1]}; export the model again")

    def user(self, name: str, dense: bool = False) -> int:
        """The dense id of user `name` (a raw id of the log, or with `dense` a dense id)."""
        return self._lookup(name, dense, self.user_names, self.user_of, len(self.user_side),
                            "user")

    def item(self, name: str, dense: bool = False) -> int:
        return self._lookup(name, dense, self.item_names, self.item_of,
                            len(self.item_vectors), "item")

    def item_name(self, item: int, dense: bool = False) -> str:
        return str(item) if dense or self.item_names is None else self.item_names[item]

    def user_vectors(self, users: np.ndarray) -> np.ndarray:
        """[U, E] user-tower vectors of dense user ids (a history tower: of their training
        items in time order)."""
        if self.history_length:
            histories = [self.timeline(u) for u in users]
            empty = [u for u, h in zip(users, histories) if not len(h)]
            if empty and self.description["user_history"]["encoder"] == "hstu":
                name = self.user_names[empty[0]] if self.user_names else str(empty[0])
                raise UserError(f"retrieve: user {name!r} has no training items, the history "
                                f"the sequence model (hstu) reads; give --history I1,I2,... "
                                f"(the user's items, oldest first)")
            times = None
            if self.timeline_times is not None:
                indptr = self.timelines[0]
                times = [self.timeline_times[indptr[u]:indptr[u + 1]] for u in users]
            return self.history_vectors(histories, times)
        ids = np.column_stack([users, self.user_side[users]]).astype(np.int64)
        return self._tower(ids)

    def history_vectors(self, histories: Sequence[np.ndarray],
                        times: Optional[Sequence[np.ndarray]] = None) -> np.ndarray:
        """[U, E] a history tower's vectors of histories (dense item ids, oldest first; the
        last `length` read), with the items' times where given (the sequence model's time bias;
        without them it reads every gap as 0 s)."""
        rows = np.full((len(histories), self.history_length), -1, np.int64)
        for row, history in zip(rows, histories):
            recent = np.asarray(history, np.int64)[-self.history_length:]
            row[:len(recent)] = recent
        if times is None:
            return self._tower(rows)
        stamps = np.zeros(rows.shape, np.float64)
        for row, when in zip(stamps, times):
            recent = np.asarray(when, np.float64)[-self.history_length:]
            row[:len(recent)] = recent
        return self._tower(rows, stamps)

    def _tower(self, ids: np.ndarray, times: Optional[np.ndarray] = None) -> np.ndarray:
        import torch

        with torch.inference_mode():
            if times is None:
                return self.user_tower(torch.from_numpy(ids)).numpy()
            return self.user_tower(torch.from_numpy(ids), torch.from_numpy(times)).numpy()

    def seen(self, user: int) -> np.ndarray:
        return self.seen_items[self.seen_indptr[user]:self.seen_indptr[user + 1]]

    def for_users(self, users: np.ndarray, k: int, exact: bool = False,
                  keep_seen: bool = False,
                  exclude: Optional[Sequence[np.ndarray]] = None) -> List[Ranked]:
        """Each user's top `k` items by the user tower; `exclude` (one array per user) in place
        of their training items."""
        excluded = exclude if exclude is not None else [
            np.zeros(0, np.int64) if keep_seen else self.seen(u) for u in users]
        return self._top(self.user_vectors(users), k, exact, excluded)

    def by_history_tower(self, history: np.ndarray, k: int, user: Optional[int] = None,
                         exact: bool = False, keep_seen: bool = False) -> Ranked:
        """A history tower's top `k` for `history` (oldest first); the history items (and
        `user`'s training items) left out unless `keep_seen`."""
        excluded = np.zeros(0, np.int64)
        if not keep_seen:
            excluded = np.union1d(history, self.seen(user) if user is not None else excluded)
        [ranked] = self.for_histories([history], k, exact, [excluded])
        return ranked

    def for_histories(self, histories: Sequence[np.ndarray], k: int, exact: bool,
                      exclude: Sequence[np.ndarray]) -> List[Ranked]:
        """A history tower's top `k` for each history (oldest first), `exclude` left out."""
        return self._top(self.history_vectors(histories), k, exact, exclude)

    def timeline(self, user: int) -> np.ndarray:
        """`user`'s stored training items, oldest first (an export that has the timelines)."""
        indptr, items = self.timelines
        return items[indptr[user]:indptr[user + 1]]

    def from_history(self, history: np.ndarray, k: int, user: Optional[int] = None,
                     exact: bool = False, keep_seen: bool = False,
                     exclude: Optional[np.ndarray] = None) -> Ranked:
        """The top `k` items near the `history` items, merged by MERGE; the history items (and
        `user`'s training items) left out unless `keep_seen`, or `exclude` in their place."""
        excluded = np.zeros(0, np.int64) if exclude is None else exclude
        if not keep_seen and exclude is None:
            excluded = np.union1d(history, self.seen(user) if user is not None else excluded)
        if exact or self.description["index"]["kind"] == "flat":
            return self._nearest_to_any(history, k, excluded)
        lists = self._top(self.item_vectors[history], k, exact, [excluded] * len(history))
        items = np.concatenate([found for found, _ in lists])
        scores = np.concatenate([score for _, score in lists])
        order = np.argsort(-scores, kind="stable")  # an item's first place holds its max score
        items, scores = items[order], scores[order]
        _, first = np.unique(items, return_index=True)
        best = np.sort(first)[:k]
        return items[best], scores[best]

    def _nearest_to_any(self, history: np.ndarray, k: int, excluded: np.ndarray) -> Ranked:
        """The top `k` items outside `excluded` by their MAX score against the history items,
        every item scored exactly: one product per block of history items, not one index
        search per item (ml-100k's longest history, 376 items: 70 ms -> a few ms of one
        thread). The same list as merging each item's exact top k (an item's max is within its
        best history item's top k), ties aside."""
        vectors = self.item_vectors
        best = np.full(len(vectors), -np.inf, np.float32)
        block = max(1, HISTORY_BLOCK // max(1, len(vectors)))
        for start in range(0, len(history), block):
            np.maximum(best, (vectors[history[start:start + block]] @ vectors.T).max(0),
                       out=best)
        best[excluded] = -np.inf
        k = min(k, int(np.isfinite(best).sum()))
        top = np.argpartition(-best, k - 1)[:k] if k else np.zeros(0, np.int64)
        top = top[np.argsort(-best[top], kind="stable")]
        return top.astype(np.int64), best[top]

    def _top(self, queries: np.ndarray, k: int, exact: bool,
             excluded: Sequence[np.ndarray]) -> List[Ranked]:
        """Each query's top `k` items outside its `excluded` ones: the index's (or, `exact`,
        numpy's brute-force) top k + |excluded|, filtered."""
        from dlrm_hybrid.retrieval.index import exact_top_k, search

        wanted = k + max((len(e) for e in excluded), default=0)
        scores, items = (exact_top_k(self.item_vectors, queries, wanted) if exact
                         else search(self.index, queries, wanted))
        out = []
        for row_items, row_scores, skip in zip(items, scores, excluded):
            keep = (row_items >= 0) & ~np.isin(row_items, skip)
            out.append((row_items[keep][:k].astype(np.int64), row_scores[keep][:k]))
        return out

    def _lookup(self, name: str, dense: bool, names, of: dict, count: int, what: str) -> int:
        return lookup_id(name, None if dense else names, of, count, what, "retrieve",
                         "the model's")

def lookup_id(name: str, names: Optional[List[str]], of: Dict[str, int], count: int, what: str,
              command: str, owner: str) -> int:
    """The dense id of `name`: a raw id among `names` (`of`: their index), or with `names` None
    a dense id in 0..count-1; a one-line error naming `owner`'s ids otherwise."""
    if names is None:
        if name.isdigit() and int(name) < count:
            return int(name)
        raise UserError(f"{command}: unknown {what} {name!r}; {owner} {what}s are dense ids "
                        f"0..{count - 1}")
    if name not in of:
        raise UserError(f"{command}: unknown {what} {name!r}: not in {owner} {what}s.txt (the raw "
                        f"ids of its log); use --dense-ids for dense ids")
    return of[name]


def read_description(root: Path) -> dict:
    """retrieval.yaml of an exported folder, or a one-line error saying what `root` is."""
    if (root / "meta.json").is_file():
        raise UserError(f"--model: {root} is a checkpoint; export it first (export --checkpoint "
                        f"{root} --out DIR --retrieval) and give that folder")
    if not (root / DESCRIPTION).is_file():
        raise UserError(f"--model: {root} has no {DESCRIPTION}; give a folder `export "
                        f"--retrieval` wrote")
    try:
        description = yaml.safe_load((root / DESCRIPTION).read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # binary bytes: not UTF-8 either
        raise UserError(f"{root / DESCRIPTION}: not valid YAML ({str(e).splitlines()[0]}); "
                        f"export the model again") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise UserError(f"{root / DESCRIPTION}: not written by `export --retrieval` (format "
                        f"{FORMAT!r} expected); export the model again")
    return description


def _array(path: Path) -> np.ndarray:
    """An .npy file of an exported folder, or a one-line error naming it."""
    try:
        return np.load(path, allow_pickle=False)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror or e}); export the model again"
                        ) from None
    except (ValueError, EOFError) as e:  # cut short, or not an .npy file
        raise UserError(f"{path}: damaged ({str(e).splitlines()[0] if str(e) else 'truncated'}); "
                        f"export the model again") from None


def _tower(path: Path):
    """The scripted user tower, or a one-line error naming its file."""
    try:
        return jit_load(str(path), map_location="cpu")
    except (RuntimeError, OSError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise UserError(f"{path}: not a readable TorchScript file ({reason}); export the model "
                        f"again") from None


def read_raw_ids(path: Path) -> Optional[List[str]]:
    """users.txt / items.txt of a folder (None where it has none)."""
    if not path.is_file():
        return None
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text ({e}); write the folder again") from None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help="a folder `export --retrieval` wrote")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--user", help="a user's id as in the training log (a history tower's "
                     "model may leave it out and take --history)")
    who.add_argument("--users", metavar="FILE", help="a file of user ids, one per line: each "
                     "user's items go to --out as one JSON line")
    parser.add_argument("--history", metavar="I1,I2,...", help="retrieve the items nearest to "
                        "these items (merged: an item scores its max over them) instead of by "
                        "the user tower; a history tower's model: the tower reads these items "
                        "(oldest first) as the user's history")
    parser.add_argument("--k", type=int, default=100, help="items to return (default 100)")
    parser.add_argument("--exact", action="store_true",
                        help="exact search over every item vector instead of the index")
    parser.add_argument("--keep-seen", action="store_true",
                        help="keep the user's training items (and the history's) in the answer")
    parser.add_argument("--dense-ids", action="store_true",
                        help="user and item ids are the dataset's dense ids, in and out")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="with --users: the file to write (JSON lines)")
    return parser


def run(args: argparse.Namespace) -> None:
    if args.k < 1:
        raise UserError("retrieve: --k must be at least 1")
    if args.users:
        return _run_batch(args)
    if args.out:
        raise UserError("retrieve: --out is for --users (a batch); one user's items are printed")
    retriever = Retriever(args.model)
    if args.user is None and not (args.history is not None and retriever.history_length):
        raise UserError("retrieve: give --user or --users (or, for a history tower's model, "
                        "--history alone)")
    user = None if args.user is None else retriever.user(args.user, args.dense_ids)
    if args.history is not None:
        history = np.array([retriever.item(i.strip(), args.dense_ids)
                            for i in args.history.split(",") if i.strip()], np.int64)
        if not len(history):
            raise UserError("retrieve: --history names no items; give item ids I1,I2,...")
        if retriever.history_length:
            items, scores = retriever.by_history_tower(history, args.k, user, args.exact,
                                                       args.keep_seen)
        else:
            items, scores = retriever.from_history(history, args.k, user, args.exact,
                                                   args.keep_seen)
    else:
        [(items, scores)] = retriever.for_users(np.array([user]), args.k, args.exact,
                                                args.keep_seen)
    answer = _answer(retriever, args.user, items, scores, args)
    if args.json:
        print(json.dumps(answer))
        return
    for name, score in zip(answer["items"], answer["scores"]):
        print(f"{name}\t{score:.6f}")


def _run_batch(args: argparse.Namespace) -> None:
    if args.history is not None:
        raise UserError("retrieve: --history is for one --user")
    if not args.out:
        raise UserError("retrieve: --users needs --out, the file to write")
    refuse_overwriting_inputs([("--out", args.out)], [("--users", args.users),
                                                      ("--model", args.model)], "retrieve")
    require_file_target("--out", args.out)
    try:
        names = [line.strip() for line in Path(args.users).read_text(encoding="utf-8-sig").splitlines()
                 if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--users: cannot read {args.users} "
                        f"({getattr(e, 'strerror', None) or e})") from None
    retriever = Retriever(args.model)
    users = np.array([retriever.user(n, args.dense_ids) for n in names], np.int64)
    target = Path(args.out)
    partial = temporary_beside(target)
    try:
        with open(partial, "w") as stream:
            for first in range(0, len(users), 1024):
                chunk = users[first:first + 1024]
                for name, (items, scores) in zip(
                        names[first:first + 1024],
                        retriever.for_users(chunk, args.k, args.exact, args.keep_seen)):
                    stream.write(json.dumps(_answer(retriever, name, items, scores, args)) + "\n")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    print(f"retrieve: wrote {args.out} users={len(users)} k={args.k}")


def _answer(retriever: Retriever, user: str, items: np.ndarray, scores: np.ndarray,
            args: argparse.Namespace) -> dict:
    by = "user tower"
    if args.history is not None:
        by = ("history tower" if retriever.history_length else f"history ({MERGE} over its items)")
    return {"user": user,
            "by": by,
            "search": "exact" if args.exact else retriever.description["index"]["kind"],
            "items": [retriever.item_name(int(i), args.dense_ids) for i in items],
            "scores": [round(float(s), 6) for s in scores]}


def main(argv: Optional[List[str]] = None) -> None:
    """`python -m dlrm_hybrid.serve.retrieve ...`: the same command, without the trainer."""
    args = add_arguments(argparse.ArgumentParser(prog="retrieve", description=__doc__)
                         ).parse_args(argv)
    try:
        run(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
