"""The impression log: what the funnel served to a query (a user, or the items of an
item-to-item query), at which position, whether the request was one of the random-order share,
and what was engaged with later. Memboost (memboost.py) learns from it, so a user's own logs
only need converting to this format (docs/memboost.md).

One tab-separated file with this header line, one row per item shown:

    request  time  query_kind  query  item  position  random  clicked

`request` any id (rows of one request share time, query and random); `time` seconds (any
increasing clock); `query_kind` user or item; `position` 1 for the first shown; `random` 1 where
the request was served in random order, else 0; `clicked` the engagements (0 or more; `recommend`
writes 0, filled in later, or joined from a clicks file by `memboost update --clicks`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import temporary_beside

COLUMNS = ("request", "time", "query_kind", "query", "item", "position", "random", "clicked")
QUERY_KINDS = ("user", "item")
HEADER = "\t".join(COLUMNS)


@dataclass
class Impressions:
    """A log in columns, one entry per row: strings as numpy unicode arrays, `kind` the index
    in QUERY_KINDS."""

    request: np.ndarray
    time: np.ndarray
    kind: np.ndarray
    query: np.ndarray
    item: np.ndarray
    position: np.ndarray
    random: np.ndarray
    clicked: np.ndarray

    def __len__(self) -> int:
        return len(self.request)

    def take(self, rows: np.ndarray) -> "Impressions":
        return Impressions(*(getattr(self, f.name)[rows] for f in fields(self)))


def empty() -> Impressions:
    return served("", 0.0, "user", "", [], False)


def served(request: str, time: float, kind: str, query: str, items: Sequence[str],
           random: bool, clicked: Optional[Sequence[float]] = None) -> Impressions:
    """One request's rows: `items` in the order shown (positions 1, 2, ...)."""
    n = len(items)
    return Impressions(
        np.full(n, request, dtype=f"U{max(len(request), 1)}"), np.full(n, float(time)),
        np.full(n, QUERY_KINDS.index(kind), np.int8), np.full(n, query, f"U{max(len(query), 1)}"),
        np.array(list(items), dtype=str).reshape(n), np.arange(1, n + 1, dtype=np.int32),
        np.full(n, bool(random)),
        np.zeros(n) if clicked is None else np.asarray(clicked, np.float64))


def concat(parts: Sequence[Impressions]) -> Impressions:
    if not parts:
        return empty()
    return Impressions(*(np.concatenate([getattr(p, f.name) for p in parts])
                         for f in fields(Impressions)))


def read_impressions(path: str, flag: str = "--impressions") -> Impressions:
    """The file's rows, each field checked: a bad one is one line naming file, row and column."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark is fine
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path} ({getattr(e, 'strerror', None) or e})"
                        ) from None
    lines = text.splitlines()
    if not lines or lines[0].strip() != HEADER:
        raise UserError(f"{flag}: {path}: the first line is not the impression log's header "
                        f"({' '.join(COLUMNS)}, tab-separated); see docs/memboost.md")
    rows = [line.split("\t") for line in lines[1:] if line.strip()]
    for n, row in enumerate(rows):
        if len(row) != len(COLUMNS):
            raise UserError(f"{flag}: {path} row {n + 2}: {len(row)} fields, the header has "
                            f"{len(COLUMNS)} ({' '.join(COLUMNS)}); give one tab-separated "
                            f"field for each")
    cols = list(zip(*rows)) if rows else [()] * len(COLUMNS)
    get = dict(zip(COLUMNS, cols))

    def numbers(column: str, kind: type, ok, rule: str) -> np.ndarray:
        values = []
        for n, text in enumerate(get[column]):
            try:
                value = kind(text)
            except ValueError:
                value = None
            if value is None or not ok(value):
                raise UserError(f"{flag}: {path} row {n + 2} column {column}: {text!r} is not "
                                f"{rule}; fix the row or convert the log again")
            values.append(value)
        return np.array(values, np.float64 if kind is float else np.int64)

    for n, text in enumerate(get["query_kind"]):
        if text not in QUERY_KINDS:
            raise UserError(f"{flag}: {path} row {n + 2} column query_kind: {text!r} is not "
                            f"one of {', '.join(QUERY_KINDS)}")
    for column in ("request", "query", "item"):
        for n, text in enumerate(get[column]):
            if not text or "\x1f" in text:
                raise UserError(f"{flag}: {path} row {n + 2} column {column}: "
                                f"{'empty' if not text else 'holds a control character'}; give "
                                f"an id")
    log = Impressions(
        np.array(get["request"], dtype=str), numbers("time", float, np.isfinite, "a number"),
        np.array([QUERY_KINDS.index(k) for k in get["query_kind"]], np.int8),
        np.array(get["query"], dtype=str), np.array(get["item"], dtype=str),
        numbers("position", int, lambda v: v >= 1, "a whole number 1 or more"
                ).astype(np.int32),
        numbers("random", int, lambda v: v in (0, 1), "0 or 1").astype(bool),
        numbers("clicked", float, lambda v: np.isfinite(v) and v >= 0, "a number 0 or more"))
    check_requests(log, f"{flag}: {path}")
    return log


def check_requests(log: Impressions, where: str) -> None:
    """The rows of a request share its time, query and random flag, and show an item once at
    each position."""
    if not len(log):
        return
    _, first, inverse = np.unique(log.request, return_index=True, return_inverse=True)
    for name in ("time", "kind", "query", "random"):
        column = getattr(log, name)
        bad = np.flatnonzero(column != column[first][inverse])
        if len(bad):
            row = int(bad[0])
            raise UserError(f"{where} row {row + 2} column {name}: request "
                            f"{str(log.request[row])!r} has another {name} in an earlier row; a "
                            f"request's rows share it")
    pairs = np.stack([inverse, log.position.astype(np.int64)], 1)
    _, once = np.unique(pairs, axis=0, return_index=True)
    if len(once) < len(log):
        row = int(np.setdiff1d(np.arange(len(log)), once)[0])
        raise UserError(f"{where} row {row + 2} column position: request "
                        f"{str(log.request[row])!r} shows two items at position "
                        f"{log.position[row]}; give each position once")


def lines(log: Impressions) -> List[str]:
    """The rows as the file has them (an id with a tab or a line break is refused)."""
    for name in ("request", "query", "item"):
        column = getattr(log, name)
        bad = [str(v) for v in column if any(c in v for c in "\t\n\r\x1f")]
        if bad:
            raise UserError(f"impressions: the {name} id {bad[0]!r} holds a tab, line break or "
                            f"\\x1f, which the log's format cannot hold")
    return [f"{r}\t{t!r}\t{QUERY_KINDS[k]}\t{q}\t{i}\t{p}\t{int(x)}\t{c:g}\n" for r, t, k, q, i, p,
            x, c in zip(log.request.tolist(), log.time.tolist(), log.kind.tolist(),
                        log.query.tolist(), log.item.tolist(), log.position.tolist(),
                        log.random.tolist(), log.clicked.tolist())]


def write_impressions(path: str, log: Impressions) -> None:
    """The whole file, or nothing (written beside it, then renamed)."""
    target = Path(path)
    partial = temporary_beside(target)
    try:
        partial.write_text(HEADER + "\n" + "".join(lines(log)), encoding="utf-8")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def append_impressions(path: str, log: Impressions, flag: str) -> None:
    """`log`'s rows added to the end of `path` in one write (the header first where the file is
    new or empty); a file that is not an impression log is refused, not written."""
    target = Path(path)
    if target.is_dir():
        raise UserError(f"{flag}: {path} is a folder; give a file name in it")
    fresh = not target.exists() or target.stat().st_size == 0
    if not fresh:
        with open(target, encoding="utf-8-sig", errors="replace") as stream:  # a BOM is fine
            if stream.readline().rstrip("\n") != HEADER:
                raise UserError(f"{flag}: {path} is not an impression log (its first line is "
                                f"not the header); give a new file or a log `recommend` wrote")
    ended = fresh or _last_byte(target) == b"\n"  # a file edited by hand may lack it
    text = (HEADER + "\n" if fresh else "" if ended else "\n") + "".join(lines(log))
    with open(target, "a", encoding="utf-8") as stream:
        stream.write(text)


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as stream:
        stream.seek(-1, os.SEEK_END)
        return stream.read(1)


def apply_clicks(log: Impressions, path: str, flag: str = "--clicks") -> Impressions:
    """The log with a clicks file joined: each line `request<TAB>item` adds one engagement to
    that row; a line naming no row of the log is refused."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag}: cannot read {path} ({getattr(e, 'strerror', None) or e})"
                        ) from None
    row_of = {(r, i): n for n, (r, i) in enumerate(zip(log.request.tolist(), log.item.tolist()))}
    clicked = log.clicked.copy()
    for n, line in enumerate(text.splitlines()):
        if not line.strip():
            continue
        key = tuple(line.rstrip("\n").split("\t"))
        if len(key) != 2 or key not in row_of:
            raise UserError(f"{flag}: {path} line {n + 1}: {line.strip()!r} is not `request<TAB>"
                            f"item` of a row of the impression log; fix or drop the line")
        clicked[row_of[key]] += 1
    return Impressions(log.request, log.time, log.kind, log.query, log.item, log.position,
                       log.random, clicked)
