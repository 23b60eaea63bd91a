"""Memboost (Related Pins at Pinterest, Liu et al. 2017): per (query, result) pair, past
engagement corrected for the position it was shown at, added to the served score.

    MB(q, r) = log((C(q, r) + alpha) / (E(q, r) + alpha))
    C(q, r)  = the pair's engagements, summed over its impressions
    E(q, r)  = sum over its impressions of ctr(position): its expected engagements
    served score = Score(q, r) + gamma * MB(q, r)

The paper's form (clicks over expected clicks, summed over positions and platforms, with the
same smoothing alpha above and below); we have one platform and one engagement kind (a log's
`clicked` may hold a weighted count of several). alpha (`prior`) makes a pair with few
impressions score near 0: a rare pair cannot dominate.

ctr(p) is measured, not assumed: the engagements per impression at position p over the
random-order requests only (the paper's "unbiased data collection": a small share of traffic
shown in random order). There every position shows the same mix of candidates, so ctr(p) is the
position's effect times the average candidate's rate, and MB > 0 means better than the average
candidate would have done where this one was shown. Without the correction (`corrected=False`,
the benchmark's comparison) E = impressions x the log's overall rate, whatever the position.

Incremental: the statistics keep, per pair, its engagements and its impressions per position,
and the random-order traffic's engagements and impressions per position; a new log adds to
them, and E is recomputed from the latest curve, so no earlier log is read again. Positions
past POSITIONS share the last bucket (and its rate). Bounded: per query only the
`max_pairs` pairs with the most impressions are kept (ties: more engagements, then the item id);
a dropped pair's counts are forgotten and start again from zero if it is shown again."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import temporary_beside
from dlrm_hybrid.serve.impressions import QUERY_KINDS, Impressions

FORMAT = "dlrm_hybrid memboost 1"
POSITIONS = 50
SEP = "\x1f"  # between a key's parts; ids never hold it (the log refuses control characters)


@dataclass
class MemboostSettings:
    prior: float = 1.0  # alpha, in engagements
    max_pairs: int = 1000  # pairs kept per query

    def check(self, where: str = "memboost") -> None:
        if not (np.isfinite(self.prior) and self.prior > 0):
            raise UserError(f"{where}: --prior must be a number above 0 (the smoothing alpha, "
                            f"in engagements), got {self.prior}")
        if self.max_pairs < 1:
            raise UserError(f"{where}: --max-pairs must be at least 1 (pairs kept per query), "
                            f"got {self.max_pairs}")


class MemboostStats:
    """The statistics of every log added so far (see the module's docstring)."""

    def __init__(self, settings: Optional[MemboostSettings] = None) -> None:
        self.settings = settings or MemboostSettings()
        self.settings.check()
        self.keys = np.zeros(0, "U1")  # kind SEP query SEP item, sorted
        self.clicks = np.zeros(0)
        self.shown = np.zeros((0, POSITIONS), np.float32)  # impressions per position bucket
        self.random_clicks = np.zeros(POSITIONS)
        self.random_shown = np.zeros(POSITIONS)
        self.all_clicks = 0.0
        self.all_shown = 0.0
        self.logs: list = []  # digests of the logs added
        self.log_bytes: list = []  # and their sizes (-1: unknown, statistics made before)
        self._index: Optional[Dict[str, int]] = None

    # ---- adding a log
    def update(self, log: Impressions, digest: str = "", size: int = -1) -> None:
        """`log` added (its `digest` and file `size`, where given, remembered: the same log
        twice is refused, and so is one that begins with it: `begins_with_added`)."""
        if digest and digest in self.logs:
            raise UserError("memboost update: this impression log was already added to the "
                            "statistics (same digest); give a new log")
        bucket = np.minimum(log.position, POSITIONS) - 1
        rand = log.random
        self.random_clicks += np.bincount(bucket[rand], log.clicked[rand], POSITIONS)
        self.random_shown += np.bincount(bucket[rand], minlength=POSITIONS)
        self.all_clicks += float(log.clicked.sum())
        self.all_shown += float(len(log))
        keys = np.char.add(np.char.add(np.char.add(np.char.add(
            np.array(QUERY_KINDS)[log.kind], SEP), log.query), SEP), log.item)
        merged, inverse = np.unique(np.concatenate([self.keys, keys]), return_inverse=True)
        old, new = inverse[:len(self.keys)], inverse[len(self.keys):]
        clicks = np.zeros(len(merged))
        clicks[old] = self.clicks
        clicks += np.bincount(new, log.clicked, len(merged))
        shown = np.zeros((len(merged), POSITIONS), np.float32)
        shown[old] = self.shown
        np.add.at(shown, (new, bucket), 1.0)
        keep = self._kept(merged, clicks, shown.sum(1))
        self.keys, self.clicks, self.shown = merged[keep], clicks[keep], shown[keep]
        if digest:
            self.logs.append(digest)
            self.log_bytes.append(size)
        self._index = None

    def _kept(self, keys: np.ndarray, clicks: np.ndarray, shown: np.ndarray) -> np.ndarray:
        """Rows of the `max_pairs` pairs of each query with the most impressions (ties: more
        engagements, then the item id), in key order."""
        query = np.array([k.rpartition(SEP)[0] for k in keys.tolist()], dtype=str)
        order = np.lexsort((keys, -clicks, -shown, query))
        sorted_query = query[order]
        starts = np.flatnonzero(np.r_[True, sorted_query[1:] != sorted_query[:-1]])
        rank = np.arange(len(order)) - np.repeat(starts, np.diff(np.r_[starts, len(order)]))
        return np.sort(order[rank < self.settings.max_pairs])

    # ---- what the statistics say
    def curve(self, corrected: bool = True) -> np.ndarray:
        """ctr(p) per position bucket: engagements per impression of the random-order
        requests; a position they never showed takes the nearest earlier one's. Without the
        correction: the log's overall rate at every position."""
        if not corrected:
            if not self.all_shown:
                raise UserError("memboost: the statistics hold no impressions; add a log with "
                                "`memboost update`")
            return np.full(POSITIONS, self.all_clicks / self.all_shown)
        if not self.random_shown[0]:
            raise UserError("memboost: no random-order impressions at position 1, so the "
                            "position effect is unknown; serve a share of requests in random "
                            "order (recommend --random-share, e.g. 0.05) and add their log")
        return measured_curve(self.random_clicks, self.random_shown)

    def relative_curve(self, positions: int = 10) -> np.ndarray:
        """ctr(p) / ctr(1) at the first `positions`: the position effect alone."""
        c = self.curve()[:positions]
        if not c[0] > 0:
            raise UserError("memboost: no engagement at position 1 in random-order traffic; the "
                            "position curve cannot be scaled; add more random-order traffic")
        return c / c[0]

    def expected(self, corrected: bool = True) -> np.ndarray:
        return self.shown.astype(np.float64) @ self.curve(corrected)

    def boost(self, corrected: bool = True) -> np.ndarray:
        """MB of every kept pair, in key order."""
        alpha = self.settings.prior
        return np.log((self.clicks + alpha) / (self.expected(corrected) + alpha))

    def scores(self, kind: str, query: str, items: Sequence[str],
               corrected: bool = True) -> np.ndarray:
        """MB of (query, item) for each of `items`; 0 for a pair the statistics do not hold."""
        if self._index is None:
            self._index = {k: n for n, k in enumerate(self.keys.tolist())}
            self._boost = {c: None for c in (True, False)}
        if self._boost[corrected] is None:
            self._boost[corrected] = self.boost(corrected) if len(self.keys) else np.zeros(0)
        prefix = f"{kind}{SEP}{query}{SEP}"
        rows = np.array([self._index.get(prefix + str(i), -1) for i in items], np.int64)
        out = np.zeros(len(rows))
        found = rows >= 0
        out[found] = self._boost[corrected][rows[found]]
        return out

    def pairs(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kind, query, item) of the kept pairs, in key order."""
        parts = np.array([k.split(SEP) for k in self.keys.tolist()], dtype=str).reshape(-1, 3)
        return parts[:, 0], parts[:, 1], parts[:, 2]


def measured_curve(random_clicks: np.ndarray, random_shown: np.ndarray) -> np.ndarray:
    """Engagements per random-order impression per position bucket; a bucket never shown takes
    the nearest earlier one's."""
    at = np.maximum.accumulate(np.where(random_shown > 0, np.arange(POSITIONS), 0))
    return (random_clicks / np.maximum(random_shown, 1))[at]


def digest_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def begins_with_added(stats: MemboostStats, path: str) -> int:
    """The size of a log already added that the file `path` begins with (that log appended
    to since, as `--log-impressions` appends: its earlier rows would count twice), or 0."""
    kept: Dict[int, set] = {}
    for digest, size in zip(stats.logs, stats.log_bytes):
        if size > 0:  # a log added with --clicks: the log's own digest before the "+"
            kept.setdefault(size, set()).add(digest.partition("+")[0])
    h, done = hashlib.sha256(), 0
    with open(path, "rb") as stream:
        for size in sorted(kept):
            block = stream.read(size - done)
            if len(block) < size - done:
                break
            h.update(block)
            done = size
            if h.hexdigest() in kept[size]:
                return size
    return 0


def save_stats(stats: MemboostStats, path: str) -> None:
    """The statistics as one .npz file, whole or not at all."""
    target = Path(path)
    partial = temporary_beside(target)
    meta = {"format": FORMAT, "prior": stats.settings.prior,
            "max_pairs": stats.settings.max_pairs, "positions": POSITIONS, "logs": stats.logs,
            "log_bytes": stats.log_bytes,
            "all_clicks": stats.all_clicks, "all_shown": stats.all_shown}
    try:
        with open(partial, "wb") as stream:
            np.savez(stream, meta=np.array(json.dumps(meta)), keys=stats.keys,
                     clicks=stats.clicks, shown=stats.shown, random_clicks=stats.random_clicks,
                     random_shown=stats.random_shown)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def load_stats(path: str, flag: str = "--stats") -> MemboostStats:
    """Statistics `memboost update` wrote; anything else is one line naming the file."""
    def bad(what: str) -> UserError:
        return UserError(f"{flag}: {path}: {what}; give a file `memboost update` wrote")

    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except OSError as e:
        raise UserError(f"{flag}: cannot read {path} ({e.strerror or e})") from None
    except (ValueError, EOFError) as e:
        raise bad(f"not Memboost statistics ({str(e).splitlines()[0] if str(e) else e})"
                  ) from None
    try:
        meta = json.loads(str(arrays["meta"]))
    except (KeyError, ValueError):
        raise bad("no format record") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise bad(f"not Memboost statistics (format {FORMAT!r})")
    if meta.get("positions") != POSITIONS:
        raise bad(f"kept {meta.get('positions')} positions, this version {POSITIONS}")
    stats = MemboostStats(MemboostSettings(float(meta["prior"]), int(meta["max_pairs"])))
    try:
        stats.keys, stats.clicks = arrays["keys"].astype(str), arrays["clicks"]
        stats.shown = arrays["shown"]
        stats.random_clicks, stats.random_shown = arrays["random_clicks"], arrays["random_shown"]
    except KeyError as e:
        raise bad(f"no {e.args[0]} array") from None
    if stats.shown.shape != (len(stats.keys), POSITIONS) or len(stats.clicks) != len(stats.keys):
        raise bad("its arrays disagree in length")
    stats.all_clicks, stats.all_shown = float(meta["all_clicks"]), float(meta["all_shown"])
    stats.logs = list(meta.get("logs") or [])
    stats.log_bytes = list(meta.get("log_bytes") or [-1] * len(stats.logs))
    return stats
