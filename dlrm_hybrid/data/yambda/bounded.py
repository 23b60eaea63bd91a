"""`preprocess yambda` on a log larger than --memory-limit allows in memory (or with
--partitions N): the events spilled to disk in partitions by user, each partition's rows made
alone, the rows merged back into time order. The same bytes as the in-memory path (tested).

- Pass 1 reads the parquet files batch by batch: each event, with its place in file order
  (`seq`), is appended to its partition's file (raw uid % N); the distinct users and items, the
  last time and the counts by type are kept (the ids are dense in raw-id order; Yambda-5b has
  about 1M users and 9.4M items, which fit).
- Pass 2 loads one partition at a time: a user's events are all in it, so its histories are
  the in-memory path's; its listens' rows (time, seq, label, dense, ids, history) are sorted by
  (time, seq) into one run per split, its timelines kept for the users' shared arrays.
- Pass 3 merges each split's runs by (time, seq), block by block, into the dataset.
Work files live in the Criteo command's work folder (data/criteo/work.py: `.NAME.preprocess`
beside the output, locked, its job the input files as they are and the options), removed at the
end. Pass 1 and each partition of pass 2 record themselves when their files are whole, and a
partition's events are deleted only after its record: a stopped run (Ctrl-C, killed, a full disk)
run again with the same command continues after the last recorded step, with the partitions it
began with, and pass 3 (the merge, a fraction of the time) is done again. A refusal (bad data)
leaves nothing; `--restart` discards earlier work.
"""

from __future__ import annotations

import zipfile
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np

from dlrm_hybrid.data.criteo.work import WorkFolder, identity
from dlrm_hybrid.data.feature_spec import SPLITS
from dlrm_hybrid.data.interactions.ranking_history import TIMELINES, engagement_histories
from dlrm_hybrid.data.yambda.events import (EVENT_TYPES, LISTEN, STORED, Events, event_batches,
                                            input_files, no_events)
from dlrm_hybrid.data.yambda.rules import (CHUNK_IDS, Chunk, Prepared, action_bits, check_splits,
                                           chunk_rows, gap_units, listen_plus, listen_rows,
                                           no_listen, split_cuts, stored_slots, time_splits)

EVENT = np.dtype([*[(name, dtype) for name, dtype in STORED.items()], ("seq", np.uint64)])
UNIQUE_EVERY = 64  # batches between merges of the distinct ids seen


def row_dtype(slots: int) -> np.dtype:
    """A listen row in a run: its time and file place (the merge's key), label, dense, ids, its
    user's earlier events (the history's place in the timelines)."""
    return np.dtype([("time", np.uint32), ("seq", np.uint64), ("label", np.uint8),
                     ("dense", np.float32, (2,)), ("cats", np.uint32, (2 + 2 * slots,)),
                     ("earlier", np.uint32)])


OPTIONS = ("history", "history_store", "listen_plus", "val_days", "test_days", "time_unit",
           "gap_minutes")  # what the rows depend on


def prepare(args, partitions: int, budget: int) -> Tuple[Events, Prepared, int]:
    """(the files' rows and bad rows, the dataset before it is written, the partitions) of the
    log in --input, holding one partition of its events in memory at a time; the work of an
    earlier run of the same job continued (with its partitions)."""
    job = identity([str(p) for p, _ in input_files(args.input)],
                   {key: getattr(args, key) for key in OPTIONS})
    work = WorkFolder(Path(args.output), job, args.restart)
    try:
        events, seen, partitions = spilled(args.input, partitions, work)
        if not seen["by_type"]["listen"]:
            raise no_listen(args.input, sum(events.read.values()))
        made = rows_by_partition(args, partitions, work, seen, budget)
    except BaseException as error:
        work.keep_or_discard(error)
        raise
    return events, made, partitions


def spilled(folder: str, partitions: int, work: WorkFolder) -> Tuple[Events, dict, int]:
    """Pass 1's result: recorded by an earlier run of the job (with its partitions), or made."""
    done = work.record("spill")
    if done is None:
        for path in (work.root / "runs").glob("*"):  # a pass 1 stopped half-way
            path.unlink()
        events, seen = spill(folder, partitions, work.root / "runs")
        np.save(work.path("runs", "raw_users.npy"), seen.pop("raw_users"))
        np.save(work.path("runs", "raw_items.npy"), seen.pop("raw_items"))
        work.commit("spill", {"partitions": partitions, "seen": seen, "files": events.files,
                              "read": events.read, "bad": events.bad})
        done = work.record("spill")
    else:
        print(f"continuing the partial work in {work.root}: the events spilled in "
              f"{done['partitions']} partitions, {len(list((work.root / 'done').glob('part_*')))} "
              f"of them made", flush=True)
    events = no_events()
    events.files, events.read, events.bad = done["files"], done["read"], done["bad"]
    seen = {**done["seen"], "raw_users": np.load(work.path("runs", "raw_users.npy")),
            "raw_items": np.load(work.path("runs", "raw_items.npy"))}
    return events, seen, int(done["partitions"])


def spill(folder: str, partitions: int, work: Path) -> Tuple[Events, dict]:
    """Pass 1: every event to its partition's file; the distinct ids, the times' range, the
    counts by type."""
    events, seq = no_events(), 0
    files = [open(work / f"events_{p}.bin", "wb") for p in range(partitions)]
    users: List[np.ndarray] = []
    items: List[np.ndarray] = []
    seen = {"end": 0, "first": np.iinfo(np.uint32).max, "kept": 0, "over_100": 0,
            "by_type": {t: 0 for t in EVENT_TYPES}}
    try:
        for n, batch in enumerate(event_batches(folder, events)):
            records = np.empty(len(batch["uid"]), EVENT)
            for name, values in batch.items():
                records[name] = values
            records["seq"] = seq + np.arange(len(records), dtype=np.uint64)
            seq += len(records)
            part = records["uid"] % partitions
            order = np.argsort(part, kind="stable")
            bounds = np.searchsorted(part[order], np.arange(partitions + 1))
            for p in range(partitions):
                files[p].write(records[order[bounds[p]:bounds[p + 1]]].tobytes())
            users.append(np.unique(batch["uid"]))
            items.append(np.unique(batch["item"]))
            if n % UNIQUE_EVERY == UNIQUE_EVERY - 1:
                users, items = [np.unique(np.concatenate(users))], [np.unique(np.concatenate(items))]
            _count(seen, batch)
    finally:
        for f in files:
            f.close()
    seen["raw_users"] = np.unique(np.concatenate(users)) if users else np.zeros(0, np.uint32)
    seen["raw_items"] = np.unique(np.concatenate(items)) if items else np.zeros(0, np.uint32)
    return events, seen


def _count(seen: dict, batch: Dict[str, np.ndarray]) -> None:
    if len(batch["time"]):
        seen["end"] = max(seen["end"], int(batch["time"].max()) + 1)
        seen["first"] = min(seen["first"], int(batch["time"].min()))
    seen["kept"] += len(batch["uid"])
    seen["over_100"] += int(((batch["kind"] == LISTEN) & (batch["played"] > 100)).sum())
    for k, t in enumerate(EVENT_TYPES):
        seen["by_type"][t] += int((batch["kind"] == k).sum())


def rows_by_partition(args, partitions: int, job: WorkFolder, seen: dict, budget: int
                      ) -> Prepared:
    """Pass 2: each partition's listens as sorted runs, one per split, and its timelines
    (the partitions an earlier run recorded kept); the splits checked; the merge (pass 3) as
    the rows to write."""
    raw_users, raw_items, end = seen["raw_users"], seen["raw_items"], seen["end"]
    work = job.root / "runs"
    cuts = split_cuts(args, end)
    rows = {name: 0 for name in SPLITS}
    plus_rows = {name: 0 for name in SPLITS}
    counts = np.zeros(len(raw_users), np.int64)
    in_gaps = 0
    for p in range(partitions):
        made = job.record(f"part_{p}")
        if made is None:
            made = partition_rows(args, work, p, raw_users, raw_items, end, cuts)
            job.commit(f"part_{p}", made)
            (work / f"events_{p}.bin").unlink()  # only now: a stop before the record redoes it
        counts += np.load(work / f"counts_{p}.npy")
        for name in SPLITS:
            rows[name] += made["rows"][name]
            plus_rows[name] += made["plus"][name]
        in_gaps += made["in_gaps"]
    check_splits(args, rows, end, seen["first"])
    dtype = row_dtype(stored_slots(args))
    # a merge step holds its blocks about 4 times over (read, joined, sorted, converted)
    block = max(256, budget // (8 * partitions * dtype.itemsize))

    def chunks() -> Iterator[Chunk]:
        for name in SPLITS:
            yield from merged(work, name, partitions, dtype, block)

    def save_timelines(folder: Path) -> None:
        _timelines(work, partitions, counts, folder, max(1, budget // 128))  # 5 x 8 B an event

    return Prepared(raw_users, raw_items, rows,
                    {n: plus_rows[n] / rows[n] for n in SPLITS}, seen["by_type"], seen["kept"],
                    seen["over_100"], in_gaps, cuts, chunks, save_timelines, job.discard)


def partition_rows(args, work: Path, p: int, raw_users: np.ndarray, raw_items: np.ndarray,
                   end: int, cuts: list) -> dict:
    """One partition's runs (run_<split>_<p>.bin), its users' event counts and timelines; its
    rows and label sums."""
    records = np.fromfile(work / f"events_{p}.bin", EVENT)
    events = Events(*[records[name] for name in STORED])
    seq = records["seq"]
    users = np.searchsorted(raw_users, events.uid).astype(np.int64)
    items = np.searchsorted(raw_items, events.item).astype(np.int64)
    order = np.lexsort((seq, events.time))  # time, then file order
    positions = np.empty(len(events), np.int64)
    positions[order] = np.arange(len(events))
    plus = listen_plus(events.kind, events.played, args.listen_plus)
    histories = (engagement_histories(positions, users, items, action_bits(events.kind, plus),
                                      len(raw_users), events.time) if args.history else None)
    split = time_splits(events.time, cuts, gap_units(args))
    listens = order[events.kind[order] == LISTEN]
    dtype, out = row_dtype(stored_slots(args)), {"rows": {}, "plus": {}}
    for s, name in enumerate(SPLITS):
        mine = listens[split[listens] == s]
        with open(work / f"run_{name}_{p}.bin", "wb") as run:
            for lo in range(0, len(mine), chunk_rows(args)):
                r = mine[lo:lo + chunk_rows(args)]
                label, dense, cats = listen_rows(events, r, users, items, plus, histories,
                                                 stored_slots(args))
                block = np.empty(len(r), dtype)
                block["time"], block["seq"], block["label"] = events.time[r], seq[r], label
                block["dense"], block["cats"] = dense, np.stack(cats, axis=1)
                block["earlier"] = (histories.place[r] - histories.starts[users[r]]
                                    if histories is not None else 0)
                run.write(block.tobytes())
        out["rows"][name], out["plus"][name] = len(mine), int(plus[mine].sum())
    out["in_gaps"] = int((split[listens] < 0).sum())
    np.save(work / f"counts_{p}.npy", np.bincount(users, minlength=len(raw_users)))
    if histories is not None:  # the partition's timelines, in (user, time) order
        for key in ("items", "actions", "times"):
            getattr(histories, key).tofile(work / f"timeline_{p}_{key}.bin")
    return out


def merged(work: Path, name: str, partitions: int, dtype: np.dtype, block: int
           ) -> Iterator[Chunk]:
    """Pass 3: a split's runs merged by (time, seq), `block` rows of each run at a time."""
    paths = [path for path in (work / f"run_{name}_{p}.bin" for p in range(partitions))
             if path.stat().st_size]
    sizes = [path.stat().st_size // dtype.itemsize for path in paths]
    runs = [open(path, "rb") for path in paths]  # read, not mapped: the pages are let go
    at = [0] * len(runs)
    try:
        yield from _merge(runs, sizes, at, dtype, block, name)
    finally:
        for run in runs:
            run.close()


def _merge(runs, sizes: List[int], at: List[int], dtype: np.dtype, block: int, name: str
           ) -> Iterator[Chunk]:
    while True:
        live = [k for k in range(len(runs)) if at[k] < sizes[k]]
        if not live:
            return
        blocks = {}
        for k in live:
            runs[k].seek(at[k] * dtype.itemsize)
            blocks[k] = np.fromfile(runs[k], dtype, min(block, sizes[k] - at[k]))
        # rows up to the least last key of the blocks that have more behind them are final
        bounds = [(int(b["time"][-1]), int(b["seq"][-1])) for k, b in blocks.items()
                  if at[k] + len(b) < sizes[k]]
        taken = []
        for k, b in blocks.items():
            if bounds:
                t, s = min(bounds)
                n = int(((b["time"] < t) | ((b["time"] == t) & (b["seq"] <= s))).sum())
            else:
                n = len(b)
            taken.append(b[:n])
            at[k] += n
        rows = np.concatenate(taken)
        rows = rows[np.lexsort((rows["seq"], rows["time"]))]
        step = max(256, CHUNK_IDS // max(50, dtype["cats"].shape[0]))  # as chunk_rows
        for lo in range(0, len(rows), step):
            r = rows[lo:lo + step]
            cats = r["cats"].astype(np.int64)
            yield name, r["label"].astype(bool), r["dense"], list(cats.T), r["time"], r["earlier"]


def _timelines(work: Path, partitions: int, counts: np.ndarray, folder: Path,
               block: int) -> None:
    """The users' timelines (ranking_history.py's file, the in-memory arrays) from the
    partitions' pieces, users range by range (about `block` events each), written as they
    come: each piece is in (user, time) order and a user is in one piece."""
    starts = np.concatenate([[0], np.cumsum(counts)])
    pieces = [np.concatenate([[0], np.cumsum(np.load(work / f"counts_{p}.npy"))])
              for p in range(partitions)]
    cuts = np.unique(np.concatenate([np.searchsorted(starts, np.arange(0, starts[-1], block)),
                                     [len(counts)]]))
    with zipfile.ZipFile(folder / TIMELINES, "w", allowZip64=True) as out:
        for key, dtype in (("items", np.int64), ("actions", np.int64), ("times", np.float64)):
            with out.open(f"{key}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, {"descr": np.dtype(dtype).str,
                                                         "fortran_order": False,
                                                         "shape": (int(starts[-1]),)})
                with ExitStack() as files:
                    source = [files.enter_context(open(work / f"timeline_{p}_{key}.bin", "rb"))
                              for p in range(partitions)]
                    for lo, hi in zip(cuts[:-1], cuts[1:]):
                        f.write(_users_range(source, pieces, lo, hi, dtype).tobytes())
        with out.open("starts.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, starts)


def _users_range(source, pieces: List[np.ndarray], lo: int, hi: int, dtype) -> np.ndarray:
    """Users lo..hi-1's events of one timeline array, in user then time order."""
    parts, owners = [], []
    for f, offsets in zip(source, pieces):
        first, last = int(offsets[lo]), int(offsets[hi])
        f.seek(first * np.dtype(dtype).itemsize)
        parts.append(np.fromfile(f, dtype, last - first))
        owners.append(np.repeat(np.arange(lo, hi), np.diff(offsets[lo:hi + 1])))
    order = np.argsort(np.concatenate(owners), kind="stable")  # a user's events stay in order
    return np.concatenate(parts)[order]
