"""A small log shaped like Yambda's flat files (events.py's layout and dtypes), with planted
structure so that a ranker's AUC can rise: a CPU run cannot hold Yambda-5b, this stands in.

- Items fall in `clusters` genres of equal size, Zipf-popular inside each; every track has a
  length (120..420 s). Each user likes two genres (their taste).
- A user's listens come in sessions (8 listens on average): a session plays one genre, the
  user's taste with probability 0.8, and has a mood (good with probability 0.5).
- listen+ (played_ratio_pct >= 50) with probability 0.25 + 0.45 (in taste) + 0.2 (good mood)
  (`plus`, `--plus-rates BASE TASTE MOOD`): the user's taste is read from their history, the mood
  from the session's last actions. The best possible AUC (these probabilities as scores, over a
  30,000-event log's listens): 0.759 at the defaults, at the rules' 0.75; 0.853 at 0.05 0.7 0.2;
  0.906 at 0 0.75 0.25 (benchmarks/mlperf_dlrmv4.py's).
- Likes follow listen+ listens, dislikes the others, a few minutes later; unlikes and
  undislikes undo some of them later still. Counts: 4% likes, 2% dislikes, 0.5% each undo, the
  rest listens (exactly `events` in all).
- Timestamps in seconds, multiples of 5 as Yambda's, over `days` days; files sorted by (uid,
  timestamp).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional, Sequence

import numpy as np

from dlrm_hybrid.data.yambda.events import (BASE, DTYPES, EVENT_FILES, EVENT_TYPES, LISTEN_ONLY,
                                            MULTI)
from dlrm_hybrid.errors import UserError

STEP_S = 5  # Yambda's timestamps are seconds, in multiples of 5
MAX_DAYS = (2**32 - 1) // 86400  # the uint32 seconds' span
SHARES = {"like": 0.04, "dislike": 0.02, "unlike": 0.005, "undislike": 0.005}
SESSION = 8  # mean listens a session
LISTEN_PLUS = 50  # played_ratio_pct at or above it: listen+ (events.py's reader does not care)
PLUS = (0.25, 0.45, 0.2)  # listen+ probability: base, + in the user's taste, + in a good mood


def generate(events: int, users: int, items: int, clusters: int, days: float, seed: int,
             plus: Sequence[float] = PLUS) -> Dict[str, Dict[str, np.ndarray]]:
    """The log's events by type (EVENT_TYPES) as columns, `events` in all."""
    # days: the timestamps are uint32 seconds (136 years at most)
    if events < 1 or users < 1 or clusters < 1 or items < clusters or not 0 < days <= MAX_DAYS:
        raise UserError(f"preprocess yambda --generate: events, users >= 1, items >= clusters "
                        f">= 1 and days > 0 (at most {MAX_DAYS:,}); got events={events} "
                        f"users={users} items={items} clusters={clusters} days={days}")
    if len(plus) != 3 or not all(p >= 0 for p in plus) or not sum(plus) <= 1:  # nan: refused
        raise UserError(f"--plus-rates: three probabilities BASE TASTE MOOD, each >= 0, adding "
                        f"up to at most 1; got {' '.join(map(str, plus))}")
    rng = np.random.default_rng(seed)
    counts = {k: int(round(share * events)) for k, share in SHARES.items()}
    listens = events - sum(counts.values())  # >= 93% of them: every follower finds its event
    out = {"listen": _listens(rng, listens, users, items, clusters, days, plus)}
    plus = out["listen"]["played_ratio_pct"] >= LISTEN_PLUS
    for name, source in (("like", "listen"), ("dislike", "listen"), ("unlike", "like"),
                         ("undislike", "dislike")):
        out[name] = _follow(rng, out[source], plus if source == "listen" else None,
                            counts[name], name, int(days * 86400 / STEP_S))
    for columns in out.values():  # drawn in steps of 5 s; Yambda's timestamps are seconds
        columns["timestamp"] = (columns["timestamp"].astype(np.int64) * STEP_S).astype(np.uint32)
    return out


def _listens(rng, n: int, users: int, items: int, clusters: int, days: float,
             rates: Sequence[float]) -> Dict[str, np.ndarray]:
    per = items // clusters
    taste = np.stack([rng.integers(0, clusters, users), rng.integers(0, clusters, users)], 1)
    user = np.sort(rng.integers(0, users, n))
    new_session = np.concatenate([[True], user[1:] != user[:-1]]) | (rng.random(n) < 1 / SESSION)
    session = np.cumsum(new_session) - 1
    sessions = int(session[-1]) + 1
    first = np.flatnonzero(new_session)
    session_user = user[first]
    in_taste = rng.random(sessions) < 0.8
    genre = np.where(in_taste, taste[session_user, rng.integers(0, 2, sessions)],
                     rng.integers(0, clusters, sessions))
    mood = rng.random(sessions) < 0.5
    rank = np.minimum(rng.zipf(1.3, n) - 1, per - 1)
    item = genre[session] * per + rank
    length = 120 + (np.arange(items) * 7919 % 300)  # a fixed length per track
    liked_genre = (taste[user] == (item // per)[:, None]).any(axis=1)
    plus = rng.random(n) < rates[0] + rates[1] * liked_genre + rates[2] * mood[session]
    played = np.where(plus, rng.integers(LISTEN_PLUS, 101, n), rng.integers(0, LISTEN_PLUS, n))
    span = int(days * 86400 / STEP_S)
    start = rng.integers(0, span, sessions)
    step = np.maximum(1, length[item] * played // 100 // STEP_S)
    offset = np.cumsum(step) - step
    offset -= offset[first][session]  # the time into the session
    time = np.minimum(start[session] + offset, span - 1)
    return {"uid": user.astype(np.uint32), "item_id": (1000 + 3 * item).astype(np.uint32),
            "timestamp": time.astype(np.uint32),
            "is_organic": (rng.random(n) < 0.3).astype(np.uint8),
            "played_ratio_pct": played.astype(np.uint16),
            "track_length_seconds": length[item].astype(np.uint32)}


def _follow(rng, source: Dict[str, np.ndarray], plus: Optional[np.ndarray], n: int, name: str,
            span: int) -> Dict[str, np.ndarray]:
    """`n` events of type `name` each after one of `source`'s (likes after listen+ listens,
    dislikes after the others, where there are enough; undos after any): up to 10 minutes
    later, undos up to 3 hours, within the log's `span`."""
    pool = np.arange(len(source["uid"]))
    if plus is not None:
        preferred = pool[plus == (name == "like")]
        pool = preferred if len(preferred) >= n else pool
    pick = np.sort(rng.choice(pool, n, replace=False)) if n else pool[:0]
    later = rng.integers(1, 120 if name in ("like", "dislike") else 2000, n)
    when = np.minimum(source["timestamp"][pick].astype(np.int64) + later, span - 1)
    return {"uid": source["uid"][pick], "item_id": source["item_id"][pick],
            "timestamp": when.astype(np.uint32),
            "is_organic": source["is_organic"][pick]}


def write_log(folder: str, events: int, users: int = 1000, items: int = 2000,
              clusters: int = 20, days: float = 30.0, seed: int = 0,
              plus: Sequence[float] = PLUS) -> Dict[str, int]:
    """The per-event files and multi_event.parquet in a new folder (written whole, then
    renamed); each file's rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dlrm_hybrid.data.split_binary_writer import check_new_output
    from dlrm_hybrid.partial_folder import finish_partial, start_partial

    target = Path(folder)
    check_new_output(folder)
    log = generate(events, users, items, clusters, days, seed, plus)
    partial = start_partial(target, "preprocess yambda --generate")
    tables, rows = {}, {}
    for kind, (type_name, file_name) in enumerate(zip(EVENT_TYPES, EVENT_FILES)):
        columns = log[type_name]
        order = np.lexsort((columns["timestamp"], columns["uid"]))
        names = [*BASE, *(LISTEN_ONLY if kind == 0 else ())]
        tables[type_name] = pa.table({c: pa.array(columns[c][order], type=DTYPES[c])
                                      for c in names})
        pq.write_table(tables[type_name], partial / f"{file_name}.parquet")
        rows[file_name] = tables[type_name].num_rows
    multi = pa.concat_tables([t.append_column("event_type", pa.array([name] * t.num_rows,
                                                                     pa.string()))
                              for name, t in tables.items()], promote_options="default")
    order = np.lexsort((multi.column("timestamp").to_numpy(), multi.column("uid").to_numpy()))
    multi = multi.take(pa.array(order)).select([*BASE, "event_type", *LISTEN_ONLY])
    pq.write_table(multi, partial / f"{MULTI}.parquet")
    rows[MULTI] = multi.num_rows
    if target.exists():
        target.rmdir()
    finish_partial(partial, target)
    return rows
