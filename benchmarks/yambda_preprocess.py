"""`preprocess yambda` on a synthetic Yambda-shaped log, beside pyarrow+polars doing its core work.

    .venv/bin/pip install polars                       # for this benchmark only
    .venv/bin/python benchmarks/yambda_preprocess.py [--events 50000000] [--history 16]
        [--log DIR] [--workdir DIR] [--memory-limit 2G] [--threads 1 2] [--skip-spilled]

Issue 63's goal: preprocessing a 50M-event Yambda-shaped log in bounded memory, its peak and
rows/s per core printed against pyarrow+polars doing the same join and sort in one process.
- The log: `preprocess yambda --generate N` (users N/100, items N/50, 1,000 genres, 6 days per
  million events: the shape of docs/yambda.md's measured logs) in the work folder, or `--log DIR`
  (the per-event files listens/likes/dislikes/unlikes/undislikes.parquet) reused.
- Both read the five per-event files (a folder of links to them when the log also has
  multi_event.parquet, which ours would read alone).
- Ours: `preprocess yambda --input LOG --output OUT --history L`, once held in memory and once
  with `--memory-limit 2G` (spilled in partitions by user), each its own subprocess.
- The peer, one Python process (pyarrow reads the parquet through polars' reader; POLARS_MAX_THREADS
  = each `--threads`): the per-event files concatenated with their kind and place in file order
  (the join), the action of every event (listen_plus = played_ratio_pct >= 50, like/dislike/
  unlike/undislike bits as ours), one sort by (uid, timestamp, file order), each event's user's
  previous L items and actions as L shifted columns masked where the uid changes, the listens kept,
  their split (the same global time cuts), sorted by (timestamp, file order) and written to
  parquet (lz4). Its row count and rows per split must equal ours (exit 1 otherwise).
- What the peer does not do that ours does (read the comparison with it): no dense id
  vocabularies (users.txt/items.txt, ids by raw id), no split-binary files (label.bin,
  cat_*.bin, timestamp.bin, feature_spec.yaml), no timelines.npz for serving, no bad-row
  accounting or schema checks (nulls, out-of-range values, types), no played-over-100 count, no
  multi_event.parquet layout, histories right-aligned with nulls (ours left-aligned, oldest
  first, 0-padded) and nothing bounded: it holds the whole log.
Each run's process tree peak RSS is sampled from outside every 20 ms (preprocess_engines.py's
TreeSampler) with its wall seconds; rows/s per core = events / wall seconds / cores used (ours:
one process, 1; the peer: its POLARS_MAX_THREADS); the CPU seconds (user + sys) over the wall
seconds show the cores each really kept busy. The last line:
`yambda_preprocess: events=N ours_rows_per_s=... ours_peak_mib=... spilled_rows_per_s=...
spilled_peak_mib=... polars_rows_per_s=... polars_peak_mib=...` (polars: its 1-thread run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The sampler of preprocess_engines.py (tree RSS from /proc every 20 ms); importable because
# that script guards its main() and imports only numpy at the top.
from preprocess_engines import TreeSampler  # noqa: E402

EVENT_FILES = ("listens", "likes", "dislikes", "unlikes", "undislikes")  # ours' file order
SPLITS = ("train", "validation", "test")
UNITS_PER_DAY = 86400  # Yambda's timestamps are seconds
GAP = 30 * 60  # Yambda's GAP_SIZE: the 30 minutes before validation and before test, in no split


# ---- the peer (in its own subprocess) ------------------------------------------------------

def peer_polars(log: str, out: str, history: int, listen_plus: int, val_days: float,
                test_days: float) -> dict:
    import polars as pl  # POLARS_MAX_THREADS was set by the parent
    import pyarrow.parquet as pq

    frames, offset = [], 0
    for kind, name in enumerate(EVENT_FILES):
        path = Path(log) / f"{name}.parquet"
        if not path.exists():
            continue
        rows = pq.ParquetFile(path).metadata.num_rows
        listen = kind == 0
        frames.append(pl.scan_parquet(path).select(
            pl.col("uid").cast(pl.UInt32), pl.col("item_id").cast(pl.UInt32),
            pl.col("timestamp").cast(pl.UInt32), pl.col("is_organic").cast(pl.UInt8),
            (pl.col("played_ratio_pct").cast(pl.UInt16) if listen else pl.lit(0, pl.UInt16))
            .alias("played"),
            (pl.col("track_length_seconds").cast(pl.UInt32) if listen else pl.lit(0, pl.UInt32))
            .alias("length"),
            pl.lit(kind, pl.UInt8).alias("kind"),
            (pl.int_range(pl.len(), dtype=pl.UInt64) + offset).alias("order")))
        offset += rows
    events = pl.concat(frames)
    plus = (pl.col("kind") == 0) & (pl.col("played") >= listen_plus)
    # action: 1 + bits (listen_plus 1, like 2, dislike 4, unlike 8, undislike 16), as ours
    action = (pl.when(pl.col("kind") == 0).then(1 + plus.cast(pl.UInt8))
              .otherwise(pl.col("kind").replace_strict({1: 3, 2: 5, 3: 9, 4: 17}, default=0,
                                                       return_dtype=pl.UInt8)).cast(pl.UInt8))
    events = events.with_columns(action.alias("action"), plus.cast(pl.UInt8).alias("listen_plus"))
    by_user = events.sort("uid", "timestamp", "order")
    same = [pl.col("uid").shift(k) == pl.col("uid") for k in range(1, history + 1)]
    shifted = [pl.when(same[k - 1]).then(pl.col(c).shift(k)).alias(f"user_{n}{history - k}")
               for k in range(1, history + 1) for c, n in (("item_id", "history"),
                                                           ("action", "action"))]
    end = pl.col("timestamp").max() + 1
    test = end - test_days * UNITS_PER_DAY
    val = test - GAP - val_days * UNITS_PER_DAY
    time = pl.col("timestamp")
    split = (pl.when(time >= test).then(2).when((time >= val) & (time < test - GAP)).then(1)
             .when(time < val - GAP).then(0).otherwise(None).cast(pl.UInt8).alias("split"))
    result = (by_user.with_columns(*shifted, split)
              .filter((pl.col("kind") == 0) & pl.col("split").is_not_null())
              .drop("kind", "action", "played")
              .sort("timestamp", "order")
              .collect())
    result.write_parquet(out, compression="lz4")
    counts = dict(result.group_by("split").len().iter_rows())
    return {"rows": result.height, "split_rows": {s: int(counts.get(i, 0))
                                                  for i, s in enumerate(SPLITS)},
            "events": offset, "columns": result.width}


def child_main(args) -> None:
    importlib.import_module("polars")  # imported before the clock starts
    start = time.perf_counter()
    result = peer_polars(args.log, args.child_out, args.history, 50, 1.0, 1.0)
    result["inner_seconds"] = time.perf_counter() - start
    print("RESULT " + json.dumps(result), flush=True)


# ---- measured from outside -----------------------------------------------------------------

def measured(command: List[str], env: Optional[dict] = None) -> dict:
    """Run `command`; its wall seconds, CPU seconds (user + sys of the reaped tree), sampled
    tree peak RSS and stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=ROOT, env=env)
    sampler = TreeSampler(process.pid)
    out, _ = process.communicate()
    seconds = time.perf_counter() - start
    sampler.stop()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if process.returncode:
        print(out[-3000:])
        raise SystemExit(f"{' '.join(command[:6])} ... failed (exit {process.returncode})")
    return {"seconds": seconds, "cpu": cpu, "peak": sampler.peak_rss, "out": out}


def run_ours(log: str, work: Path, history: int, memory_limit: Optional[str]) -> dict:
    out = work / ("ours_spilled" if memory_limit else "ours_memory")
    command = [sys.executable, "-m", "dlrm_hybrid", "preprocess", "yambda", "--input", log,
               "--output", str(out), "--history", str(history)]
    if memory_limit:
        command += ["--memory-limit", memory_limit]
    r = measured(command)
    report = json.loads((out / "preprocess_report.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    r.update(name="ours, spilled (--memory-limit " + memory_limit + ")" if memory_limit
             else "ours, in memory", cores=1, events=report["events_read"],
             rows=sum(report["rows"].values()), split_rows=report["rows"],
             memory=report["memory"], own_peak=report["peak_rss_bytes"])
    return r


def run_peer(log: str, work: Path, history: int, threads: int) -> dict:
    out = work / f"polars_{threads}.parquet"
    env = dict(os.environ, POLARS_MAX_THREADS=str(threads), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = measured([sys.executable, __file__, "--child", "--log", log, "--child-out", str(out),
                  "--history", str(history)], env)
    lines = [line for line in r["out"].splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):])
    r.update(result, name=f"pyarrow+polars, POLARS_MAX_THREADS={threads}", cores=threads,
             memory=f"in memory; parquet {out.stat().st_size / 2**20:,.0f} MiB")
    out.unlink()
    return r


def generate(events: int, folder: Path) -> None:
    users, items = max(events // 100, 1000), max(events // 50, 2000)
    days = max(6 * events / 1e6, 30)
    command = [sys.executable, "-m", "dlrm_hybrid", "preprocess", "yambda", "--generate",
               str(events), "--users", str(users), "--items", str(items), "--clusters",
               str(min(1000, items // 2)), "--days", f"{days:g}", "--output", str(folder)]
    start = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    print(f"generated {events:,} events ({users:,} users, {items:,} items, {days:g} days) in "
          f"{time.perf_counter() - start:.1f} s: {folder}", flush=True)


def per_event_view(log: str, work: Path) -> str:
    """The log's per-event files as a folder both sides read: the generator also writes
    multi_event.parquet, which ours would read alone (its string event_type column) and the
    peer does not read; a folder of links to the five files gives both the same input."""
    if not (Path(log) / "multi_event.parquet").exists():
        return log
    view = work / "per_event"
    view.mkdir()
    for name in EVENT_FILES:
        if (Path(log) / f"{name}.parquet").exists():
            (view / f"{name}.parquet").symlink_to(Path(log).resolve() / f"{name}.parquet")
    return str(view)


def rate(r: dict, events: int) -> float:
    return events / r["seconds"] / r["cores"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000_000,
                        help="events of the generated log (default 50,000,000)")
    parser.add_argument("--log", default=None, help="reuse this log folder (no generation)")
    parser.add_argument("--workdir", default=None, help="where the log and outputs go "
                        "(default: a temp folder, removed at the end)")
    parser.add_argument("--history", type=int, default=16)
    parser.add_argument("--memory-limit", default="2G", help="the spilled run's (default 2G)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                        help="POLARS_MAX_THREADS of the peer's runs (default 1 2)")
    parser.add_argument("--skip-spilled", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args)
        return
    for name in ("polars", "pyarrow"):
        if importlib.util.find_spec(name) is None:
            print(f"{name} is not installed: .venv/bin/pip install {name} (for this benchmark "
                  f"only; not a requirement)", file=sys.stderr)
            sys.exit(1)
    tmp = tempfile.mkdtemp(prefix="yambda-bench-", dir=args.workdir)
    try:
        work = Path(tmp)
        log = args.log
        if not log:
            log = str(work / "log")
            generate(args.events, Path(log))
        log = per_event_view(log, work)
        runs = [run_ours(log, work, args.history, None)]
        if not args.skip_spilled:
            runs.append(run_ours(log, work, args.history, args.memory_limit))
        for threads in args.threads:
            runs.append(run_peer(log, work, args.history, threads))
        for r in runs:
            print(f"{r['name']}: {r['seconds']:.1f} s, peak {r['peak'] / 2**20:,.0f} MiB, "
                  f"{r['rows']:,} rows", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    events = runs[0]["events"]
    ok = True
    for r in runs[1:]:
        if r["rows"] != runs[0]["rows"] or r["split_rows"] != runs[0]["split_rows"]:
            ok = False
            print(f"!!! MISMATCH: {r['name']}: rows {r['rows']} {r['split_rows']} != ours "
                  f"{runs[0]['rows']} {runs[0]['split_rows']}")
    print(f"\n{events:,} events, {runs[0]['rows']:,} listens (rows), --history {args.history}\n")
    print("| run | how | wall s | CPU s (cores busy) | peak RSS MiB (tree, sampled) | events/s | "
          "events/s per core | rows (listens) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        print(f"| {r['name']} | {r['memory']} | {r['seconds']:.1f} | {r['cpu']:.1f} "
              f"({r['cpu'] / r['seconds']:.2f}) | {r['peak'] / 2**20:,.0f} | "
              f"{events / r['seconds']:,.0f} | {rate(r, events):,.0f} | {r['rows']:,} |")
    print("\nThe peer does not build vocabularies, split-binary files, timelines or bad-row "
          "accounting, and holds the whole log (see the docstring).")
    spilled = next((r for r in runs if r["name"].startswith("ours, spilled")), None)
    peer = next((r for r in runs if r["cores"] and r["name"].startswith("pyarrow")), None)

    def fig(r: Optional[dict], what: str) -> str:
        if r is None:
            return "na"
        return f"{rate(r, events):.0f}" if what == "rate" else f"{r['peak'] / 2**20:.0f}"

    print(f"yambda_preprocess: events={events} ours_rows_per_s={fig(runs[0], 'rate')} "
          f"ours_peak_mib={fig(runs[0], 'peak')} spilled_rows_per_s={fig(spilled, 'rate')} "
          f"spilled_peak_mib={fig(spilled, 'peak')} polars_rows_per_s={fig(peer, 'rate')} "
          f"polars_peak_mib={fig(peer, 'peak')}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
