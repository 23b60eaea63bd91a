"""`preprocess yambda`: Yambda's flat parquet log (events.py) -> a ranking dataset the ranker
reads (split-binary, the layout `preprocess interactions --labels ... --history L` writes), one
row per listen; `--generate N` writes a small Yambda-shaped log instead (synthetic.py).

- Label `listen_plus`: a listen with played_ratio_pct >= --listen-plus (default 50, the Yambda
  paper's "listen+"; the MLPerf DLRMv4 reference's threshold is still to confirm).
- Order: events by (timestamp, file order); ids dense, by raw id (users.txt, items.txt: line n
  holds id n's raw id).
- Splits, global in time (Yambda's global temporal split): with E the last event's time + 1,
  listens in the last --test-days before E are test, the --val-days before those validation,
  the rest train; every split in time order, each row's timestamp kept in
  `<split>/timestamp.bin` (uint32) for a windowed loader.
- History (`--history L`): each row's user's last L events of any type strictly before it (time,
  then file order; ranking_history.py), with actions 1 + bits: listen_plus 1, like 2, dislike 4,
  unlike 8, undislike 16 (a plain listen: 1).
- Features: user_id, item_id, the history; dense is_organic and log1p(track_length_seconds).
- Memory: a log whose estimated peak (200 bytes an event, from the files' row counts) fits
  --memory-limit (default: the memory available) is held whole; a larger one, or any with
  --partitions N, goes through bounded.py (partitions by user spilled to disk, the same bytes).
  The peak RSS is printed. The dataset appears whole or not at all.
"""

from __future__ import annotations

import json
import time
from collections import namedtuple
from pathlib import Path
from typing import Dict

import numpy as np

from dlrm_hybrid.data.criteo.budget import available_memory, own_peak_rss, parse_size
from dlrm_hybrid.data.feature_spec import SPLITS
from dlrm_hybrid.data.interactions.ranking_history import (action_rows, check_slots,
                                                           engagement_histories,
                                                           history_features, history_note)
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import REPORT, SplitBinaryWriter, check_new_output
from dlrm_hybrid.data.timeline_history import OFFSETS, store_note
from dlrm_hybrid.data.yambda import bounded
from dlrm_hybrid.data.yambda.events import EVENT_TYPES, LISTEN, Events, read_events, total_rows
from dlrm_hybrid.data.yambda.rules import (ACTIONS, DENSE, LABEL, Prepared, action_bits,
                                           check_splits, chunk_rows, listen_plus, listen_rows,
                                           no_listen, gap_units, split_cuts, stored_slots,
                                           time_splits)
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import refuse_overwriting_inputs

TIMES = "timestamp.bin"
Action = namedtuple("Action", "name")
# the peak RSS: measured 170-175 bytes an event (10M and 50M events, --history 50, AMD EPYC)
EVENT_BYTES, BASE_BYTES = 200, 256 << 20
MIN_SHARE = 64 << 20  # the least memory a partition may have


def add_arguments(parser) -> None:
    parser.add_argument("--input", metavar="DIR", help="Yambda's flat files (multi_event.parquet, "
                        "or listens.parquet and likes/dislikes/unlikes/undislikes)")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder (with "
                        "--generate: new log folder)")
    parser.add_argument("--history", type=int, default=0, metavar="L",
                        help="each row's user's last L events before it, with their actions "
                             "(model.sequence: hstu reads them; default 0: none)")
    parser.add_argument("--history-store", choices=("slots", "timelines"), default="slots",
                        help="slots: L item and L action columns (about 5 bytes a slot a row); "
                             "timelines: each row's place in timelines.npz, the slots gathered "
                             "from it at load time (4 bytes a row; for long histories such as "
                             "DLRMv4's 4,095)")
    parser.add_argument("--listen-plus", type=int, default=50, metavar="PCT",
                        help="listen_plus = a listen with played_ratio_pct >= PCT (default 50)")
    parser.add_argument("--val-days", type=float, default=1.0, metavar="D",
                        help="validation: the D days before test (default 1)")
    parser.add_argument("--test-days", type=float, default=1.0, metavar="D",
                        help="test: the log's last D days (default 1)")
    parser.add_argument("--time-unit", type=float, default=1.0, metavar="S",
                        help="seconds per timestamp unit (default 1: Yambda's timestamps are "
                             "seconds, in multiples of 5)")
    parser.add_argument("--gap-minutes", type=float, default=30.0, metavar="M",
                        help="listens this long before validation and before test are in no "
                             "split (default 30, Yambda's Global Temporal Split; 0: none)")
    parser.add_argument("--memory-limit", metavar="SIZE", help="a log whose estimated peak is "
                        "above SIZE (e.g. 8G; default: the memory available) is spilled to disk "
                        "in partitions by user, each made alone")
    parser.add_argument("--partitions", type=int, default=0, metavar="N",
                        help="spill in N partitions whatever the log's size (default: as "
                             "--memory-limit needs)")
    parser.add_argument("--restart", action="store_true",
                        help="discard the partial work a stopped spilling run left, instead of "
                             "continuing it")
    generator = parser.add_argument_group("--generate: a synthetic Yambda-shaped log")
    generator.add_argument("--generate", type=int, metavar="EVENTS",
                           help="write a planted log of EVENTS events to --output, not a dataset")
    generator.add_argument("--users", type=int, default=1000)
    generator.add_argument("--items", type=int, default=2000)
    generator.add_argument("--clusters", type=int, default=20, help="the items' genres")
    generator.add_argument("--days", type=float, default=30.0, help="the log's time span")
    generator.add_argument("--seed", type=int, default=0)
    generator.add_argument("--plus-rates", type=float, nargs=3, default=[0.25, 0.45, 0.2],
                           metavar=("BASE", "TASTE", "MOOD"),
                           help="a listen is a listen+ with probability BASE, + TASTE in the "
                                "user's taste, + MOOD in a good mood (default 0.25 0.45 0.2)")


def _check(args) -> None:
    for flag, value in (("--val-days", args.val_days), ("--test-days", args.test_days),
                        ("--time-unit", args.time_unit)):
        if not value > 0:
            raise UserError(f"{flag}: a number above 0; got {value}")
    check_slots(args.history)
    if args.gap_minutes < 0:
        raise UserError(f"--gap-minutes: 0 (no gap) or more; got {args.gap_minutes:g}")
    if not 0 <= args.listen_plus <= 100:
        raise UserError(f"--listen-plus: a played_ratio_pct in 0..100; got {args.listen_plus}")


def partitions_for(rows: int, limit: int, given: str = "") -> int:
    """How many partitions of the log's users fit `limit` one at a time (1: the whole log in
    memory), from its rows (before any is read); too small a limit refused."""
    share = limit - BASE_BYTES
    if share < MIN_SHARE:
        raise UserError(f"--memory-limit: {given or f'{limit / 2**20:.0f} MiB available'} leaves "
                        f"under {MIN_SHARE >> 20} MiB beside the program's {BASE_BYTES >> 20} "
                        f"MiB; give at least {(BASE_BYTES + MIN_SHARE) >> 20}M")
    return -(-rows * EVENT_BYTES // share)


def run(args) -> None:
    """`preprocess yambda`: read, label, order, split, histories, write; one summary."""
    start = time.perf_counter()
    if args.generate is not None:
        from dlrm_hybrid.data.yambda.synthetic import write_log

        if args.input:
            raise UserError("--generate: writes a new log to --output and reads none; leave "
                            "out --input")
        rows = write_log(args.output, args.generate, args.users, args.items, args.clusters,
                         args.days, args.seed, args.plus_rates)
        print(f"wrote {args.output}: a synthetic Yambda-shaped log, "
              + ", ".join(f"{name}.parquet {n:,}" for name, n in rows.items()))
        return
    if not args.input:
        raise UserError("preprocess yambda: give --input DIR (Yambda's flat files), or "
                        "--generate EVENTS for a synthetic log")
    refuse_overwriting_inputs([("--output", args.output)], [("--input", args.input)],
                              "preprocess yambda")
    check_new_output(args.output)
    _check(args)
    if args.partitions < 0:
        raise UserError(f"--partitions: 0 (as --memory-limit needs) or more; got "
                        f"{args.partitions}")
    limit = parse_size(args.memory_limit) if args.memory_limit else available_memory()
    parts = args.partitions or partitions_for(total_rows(args.input), limit, args.memory_limit)
    out = Path(args.output)
    if parts > 1 or (out.parent / f".{out.name}.preprocess").exists():  # or a stopped one's work
        events, made, parts = bounded.prepare(args, parts, limit - BASE_BYTES)
    else:
        events = read_events(args.input)
        made = build(events, args)
    done = write(events, made, args, parts)  # stopped here, the spilled work stays to continue
    made.close()
    seconds = time.perf_counter() - start
    print(summary(events, done, args.output, seconds))


def build(events: Events, args) -> Prepared:
    """Ids, labels, actions, each event's place in time, the listens' splits and histories."""
    if not (events.kind == LISTEN).any():
        raise no_listen(args.input, sum(events.read.values()))
    raw_users, users = np.unique(events.uid, return_inverse=True)
    raw_items, items = np.unique(events.item, return_inverse=True)
    order = np.argsort(events.time, kind="stable")  # time, then file order
    positions = np.empty(len(events), np.int64)
    positions[order] = np.arange(len(events))
    plus = listen_plus(events.kind, events.played, args.listen_plus)
    end = int(events.time.max()) + 1
    cuts = split_cuts(args, end)
    split = time_splits(events.time, cuts, gap_units(args))
    listens = order[events.kind[order] == LISTEN]  # in time order
    rows = {name: listens[split[listens] == s] for s, name in enumerate(SPLITS)}
    check_splits(args, {n: len(r) for n, r in rows.items()}, end, int(events.time.min()))
    histories = (engagement_histories(positions, users.astype(np.int64), items.astype(np.int64),
                                      action_bits(events.kind, plus), len(raw_users),
                                      events.time)
                 if args.history else None)

    def chunks():
        for name, r in rows.items():
            for lo in range(0, len(r), chunk_rows(args)):
                chunk = r[lo:lo + chunk_rows(args)]
                earlier = (histories.place[chunk] - histories.starts[users[chunk]]
                           if histories is not None else np.zeros(len(chunk), np.int64))
                yield (name, *listen_rows(events, chunk, users, items, plus, histories,
                                          stored_slots(args)), events.time[chunk], earlier)

    return Prepared(raw_users, raw_items, {n: int(len(r)) for n, r in rows.items()},
                    {n: float(plus[r].mean()) for n, r in rows.items()},
                    {t: int((events.kind == k).sum()) for k, t in enumerate(EVENT_TYPES)},
                    len(events), int(((events.kind == LISTEN) & (events.played > 100)).sum()),
                    int((split[listens] < 0).sum()), cuts, chunks,
                    lambda folder: histories.save(folder))


def write(events: Events, made: Prepared, args, partitions: int) -> dict:
    """The split-binary dataset, its notes, the rows' times, the ids' raw values, the report
    (returned)."""
    slots, timelines = stored_slots(args), args.history_store == "timelines" and args.history
    names = ["user_id", "item_id", *history_features(args.history)]
    spec = DataSpec(len(DENSE), [len(made.raw_users), len(made.raw_items),
                                 *[len(made.raw_items)] * slots,
                                 *[action_rows(len(ACTIONS))] * slots], [1] * (2 + 2 * slots))
    with SplitBinaryWriter(args.output, spec, labels=[LABEL]) as writer:
        files = [(TIMES, np.uint32)] + ([(OFFSETS, np.uint32)] if timelines else [])
        out = {(name, file): open(writer.tmp / name / file, "wb") for name in SPLITS
               for file, _ in files}
        try:
            for name, label, dense, cats, *per_row in made.chunks():
                writer.write(name, label, dense, [c[:, None] for c in cats])
                for (file, dtype), values in zip(files, per_row):
                    out[name, file].write(values.astype(dtype).tobytes())
        finally:
            for f in out.values():
                f.close()
        for key, value in notes(events, made, args, names).items():
            writer.note(key, value)
        if timelines:
            writer.note("history_store", store_note(len(made.raw_items), action_rows(len(ACTIONS))))
        if args.history:
            made.save_timelines(Path(writer.tmp))
        for file, raw in (("users.txt", made.raw_users), ("items.txt", made.raw_items)):
            writer.add_file(file, "".join(f"{v}\n" for v in raw.tolist()))
        done = report(events, made, partitions)
        writer.add_file(REPORT, json.dumps(done, indent=1) + "\n")
    return done


def notes(events: Events, made: Prepared, args, names) -> Dict[str, object]:
    """feature_spec.yaml's metadata: where the data came from and what each part is."""
    return {
        "source": {"yambda": events.files},
        "dataset": "yambda: one row per listen",
        "labels": {LABEL: f"a listen with played_ratio_pct >= {args.listen_plus}"},
        "categorical_features": names,
        "numerical_features": list(DENSE),
        "history": history_note(args.history, [Action(a) for a in ACTIONS])
        if args.history else None,
        "split_rule": (f"global in time: listens from {made.cuts[1]:g} (the last "
                       f"{args.test_days:g} days) test, from {made.cuts[0]:g} validation "
                       f"({args.val_days:g} days), the rest train, the {args.gap_minutes:g} "
                       f"minutes before validation and before test in none; timestamps in "
                       f"{args.time_unit:g}-second units; every split in time order"),
        "row_times": {name: f"{name}/{TIMES}" for name in SPLITS},
        "time_unit_s": args.time_unit,  # seconds per row-time unit, for data.stream_window_s
        "request_feature": "user_id",
    }


def report(events: Events, made: Prepared, partitions: int) -> dict:
    """preprocess_report.json: rows read per file, bad rows by kind, each split's rows."""
    return {"files": events.read, "events_read": sum(events.read.values()),
            "events_kept": made.kept, "events_by_type": made.by_type,
            "bad_rows": dict(events.bad),
            "listens_played_over_100": made.played_over_100,  # kept, as listen_plus
            "rows": made.rows, "listens_in_gaps": made.in_gaps, "listen_plus_rate": made.rates,
            "users": len(made.raw_users), "items": len(made.raw_items),
            "memory": (f"{partitions} partitions by user, spilled" if partitions > 1 else
                       "in memory"), "peak_rss_bytes": own_peak_rss()}


def summary(events: Events, r: dict, output: str, seconds: float) -> str:
    """What was read, skipped and written (`r`: the report); a `done:` line."""
    bad = sum(events.bad.values())
    lines = [f"wrote {output} in {seconds:.1f} s (a Yambda ranking dataset: split-binary, one "
             f"row per listen)",
             f"  read       {r['events_read']:,} events = {r['events_kept']:,} kept + {bad:,} bad "
             f"rows skipped" + "".join(f", {k} {v:,}" for k, v in events.bad.items() if v),
             "  kept       " + ", ".join(f"{t} {n:,}" for t, n in r["events_by_type"].items())
             + f"; {r['users']:,} users, {r['items']:,} items"]
    for name in SPLITS:
        lines.append(f"  {name:<10} {r['rows'][name]:,} rows, listen_plus rate "
                     f"{r['listen_plus_rate'][name]:.4f}")
    lines.append(f"  gaps       {r['listens_in_gaps']:,} listens between the splits, in none")
    lines.append(f"  memory     {r['memory']}: peak RSS "
                 f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB; "
                 f"{r['events_read'] / max(seconds, 1e-9):,.0f} events/s")
    lines.append(f"done: events={r['events_read']} kept={r['events_kept']} skipped={bad} "
                 + " ".join(f"{k}={v}" for k, v in r["rows"].items())
                 + f" peak_rss_bytes={r['peak_rss_bytes']} seconds={seconds:.2f}")
    return "\n".join(lines)

