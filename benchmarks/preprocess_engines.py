"""The counting pass of Criteo preprocessing on other engines, side by side with ours.

    .venv/bin/pip install pyarrow polars duckdb        # for this benchmark only
    .venv/bin/python benchmarks/preprocess_engines.py [--rows 2000000] [--input FILE ...]
        [--threads 1 2] [--duckdb-memory-limit 256MB] [--tmpdir DIR]

"Why not pyarrow, Polars or DuckDB?" For Criteo TSV (`label \\t I1..I13 \\t C1..C26`; a
generated file of `--rows` rows as in preprocess_speed.py unless `--input` names files) each
engine reads and parses every column (the integers as int64: their sums are a checksum the peers
must agree on) and counts every categorical value exactly, per column:
- pyarrow: `pyarrow.csv.open_csv` (streaming, 16 MiB blocks), hex columns as strings,
  `value_counts` per batch, merged with `Table.group_by` once the pending counts outgrow the table;
- Polars: `scan_csv` on the streaming engine, the 26 columns unpivoted and grouped by (column,
  value) in one query, each row's integer sum riding along; threads: POLARS_MAX_THREADS;
- DuckDB: `read_csv`, the columns unpivoted and grouped as for Polars in one query, `SET threads`,
  and `SET memory_limit` low enough that its aggregation spills to a temp directory in the tmpdir
  (the spill column; `GROUP BY GROUPING SETS ((C1), .., (C26))` needed 1 GB and did not spill);
- ours: `count_ours`, the tool's counting pass (its peak RSS: the whole run's, both passes).
Each engine runs in a fresh subprocess (its own threads and peak RSS); the parent samples the
RSS of the child's process tree every 20 ms (and the size of its spill folder; ours: the spill its
report gives) beside the child's own getrusage figure. Per column the number of distinct values
and the total of the counts must equal ours exactly (and the integer sums the peers'); a mismatch
is printed loudly and makes the script exit 1. Every engine reads the input from the page cache
(preprocess_scale.py drops it before each run).

pyarrow, polars and duckdb are not requirements of the project: install them into the venv for
this benchmark only (the first line above); the script names a missing one and exits.
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
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

INTS = [f"I{i}" for i in range(1, 14)]
CATS = [f"C{i}" for i in range(1, 27)]
NAMES = ["label"] + INTS + CATS
ENGINES = ("pyarrow", "polars", "duckdb", "ours")
PEERS = ("pyarrow", "polars", "duckdb")
SAMPLE_SECONDS = 0.02


# ---- the engines (each runs in its own subprocess) ----------------------------------------

def count_ours(paths: Sequence[str], workers: int) -> dict:
    """The tool's counting pass: the tool run with every value kept (frequency threshold 0), the
    seconds of its count pass from its report; a feature's distinct values are its cardinality
    - 1 and its total the nonzero ids written. Peak RSS is the whole run's (both passes)."""
    from dlrm_hybrid.data.criteo.preprocess import preprocess_criteo
    from dlrm_hybrid.data.feature_spec import SPLITS, categorical_dtype
    with tempfile.TemporaryDirectory() as tmp:
        report = preprocess_criteo(list(paths), f"{tmp}/out", workers=workers)
        cardinalities = report["cardinalities"]
        total = [sum(int(np.count_nonzero(np.fromfile(f"{tmp}/out/{split}/cat_{j}.bin",
                                                      categorical_dtype(c))))
                     for split in SPLITS) for j, c in enumerate(cardinalities)]
    return {"rows": report["rows_written"]["total"], "distinct": [c - 1 for c in cardinalities],
            "total": total, "int_sum": None, "seconds": report["passes"]["count"]["seconds"],
            "spill_bytes": report.get("spill_bytes", 0)}


def count_pyarrow(paths: Sequence[str], threads: int, tmpdir: str, memory_limit: str) -> dict:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as csv
    pa.set_cpu_count(threads)
    pa.set_io_thread_count(threads)
    types = {n: pa.string() if n in CATS else pa.int64() for n in NAMES}
    tables = [pa.table({"values": pa.array([], pa.string()), "counts": pa.array([], pa.int64())})
              for _ in CATS]
    pending: List[list] = [[] for _ in CATS]
    rows, int_sum = 0, 0

    def merge(j: int) -> None:
        both = pa.concat_tables([tables[j], *pending[j]])
        summed = both.group_by("values").aggregate([("counts", "sum")])
        tables[j] = summed.rename_columns(["values", "counts"])
        pending[j] = []

    for path in paths:
        reader = csv.open_csv(
            path, read_options=csv.ReadOptions(column_names=NAMES, block_size=16 << 20,
                                               use_threads=threads > 1),
            parse_options=csv.ParseOptions(delimiter="\t"),
            convert_options=csv.ConvertOptions(column_types=types, strings_can_be_null=True))
        for batch in reader:
            rows += batch.num_rows
            int_sum += sum(pc.sum(batch.column(name)).as_py() or 0 for name in INTS)
            for j, name in enumerate(CATS):
                counted = pc.value_counts(batch.column(name).drop_null())
                pending[j].append(pa.table({"values": counted.field("values"),
                                            "counts": counted.field("counts")}))
                if sum(t.num_rows for t in pending[j]) >= max(tables[j].num_rows, 1 << 16):
                    merge(j)
    for j in range(len(CATS)):
        merge(j)
    return {"rows": rows, "distinct": [t.num_rows for t in tables],
            "total": [pc.sum(t["counts"]).as_py() or 0 for t in tables], "int_sum": int_sum}


def count_polars(paths: Sequence[str], threads: int, tmpdir: str, memory_limit: str) -> dict:
    import polars as pl  # POLARS_MAX_THREADS was set by the parent before this import
    schema = {n: pl.String if n in CATS else pl.Int64 for n in NAMES}
    scan = pl.scan_csv(list(paths), separator="\t", has_header=False, schema=schema)
    # One scan: each row's integer sum rides along its unpivoted (column, value) rows, nulls
    # included so that the row count and the sum cover every row.
    query = (scan.select(pl.sum_horizontal(INTS).alias("ints"), *CATS)
             .unpivot(on=CATS, index="ints", variable_name="column", value_name="value")
             .group_by("column", "value").agg(pl.len().alias("n"), pl.col("ints").sum())
             .group_by("column").agg(pl.col("value").count().alias("distinct"),
                                     pl.col("n").filter(pl.col("value").is_not_null()).sum()
                                     .alias("total"),
                                     pl.col("n").sum().alias("rows"), pl.col("ints").sum()))
    found = {r["column"]: r for r in query.collect(engine="streaming").to_dicts()}
    return {"rows": found[CATS[0]]["rows"], "distinct": [found[c]["distinct"] for c in CATS],
            "total": [found[c]["total"] for c in CATS], "int_sum": found[CATS[0]]["ints"]}


def count_duckdb(paths: Sequence[str], threads: int, tmpdir: str, memory_limit: str) -> dict:
    import duckdb
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    con.execute(f"SET memory_limit = '{memory_limit}'")
    con.execute(f"SET temp_directory = '{tmpdir}'")
    con.execute("SET preserve_insertion_order = false")
    columns = "{" + ", ".join(f"'{n}': '{'VARCHAR' if n in CATS else 'BIGINT'}'"
                              for n in NAMES) + "}"
    files = "[" + ", ".join(f"'{p}'" for p in paths) + "]"
    source = f"read_csv({files}, delim = '\\t', header = false, columns = {columns})"
    ints = " + ".join(f"coalesce({n}, 0)" for n in INTS)
    # As for Polars: the row's integer sum rides along, NULL values included.
    query = f"""
        WITH pairs AS (
            SELECT feature, value, count(*) AS n, sum(ints) AS ints
            FROM (SELECT {ints} AS ints, {', '.join(CATS)} FROM {source})
            UNPIVOT INCLUDE NULLS (value FOR feature IN ({', '.join(CATS)}))
            GROUP BY feature, value)
        SELECT feature, count(value), sum(n) FILTER (WHERE value IS NOT NULL), sum(n), sum(ints)
        FROM pairs GROUP BY feature"""
    found = {row[0]: row for row in con.execute(query).fetchall()}
    return {"rows": int(found[CATS[0]][3]), "distinct": [int(found[c][1]) for c in CATS],
            "total": [int(found[c][2] or 0) for c in CATS], "int_sum": int(found[CATS[0]][4])}


COUNTERS = {"pyarrow": count_pyarrow, "polars": count_polars, "duckdb": count_duckdb}


def child_main(engine: str, paths: List[str], threads: int, tmpdir: str, memory_limit: str) -> None:
    """In the subprocess: count, then print one JSON line (result, seconds, getrusage peak).
    The engine's module is imported before the clock starts."""
    importlib.import_module(engine if engine in PEERS else "dlrm_hybrid.data.criteo.preprocess")
    start = time.perf_counter()
    if engine == "ours":
        result = count_ours(paths, threads)
    else:
        result = COUNTERS[engine](paths, threads, tmpdir, memory_limit)
    result.setdefault("seconds", time.perf_counter() - start)
    result["rusage_bytes"] = 1024 * (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                     + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    print("RESULT " + json.dumps(result), flush=True)


# ---- measuring from outside ---------------------------------------------------------------

def tree_pids(root: int) -> List[int]:
    """root and its descendants, from each /proc/PID/stat's parent field."""
    children: Dict[int, List[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def rss_bytes(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            pass
    return total


def folder_bytes(folder: Optional[str]) -> int:
    total = 0
    if folder:
        for root, _, files in os.walk(folder):
            for name in files:
                try:
                    total += os.stat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
    return total


class TreeSampler:
    """Peak RSS of a process tree (the sum over its processes) and peak size of a folder,
    sampled every SAMPLE_SECONDS in a thread until stop()."""

    def __init__(self, pid: int, folder: Optional[str] = None) -> None:
        self.pid, self.folder = pid, folder
        self.peak_rss = self.peak_folder = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, rss_bytes(tree_pids(self.pid)))
            self.peak_folder = max(self.peak_folder, folder_bytes(self.folder))
            self._stop.wait(SAMPLE_SECONDS)

    def stop(self) -> "TreeSampler":
        self._stop.set()
        self._thread.join()
        return self


def quiet_env(threads: int) -> dict:
    """The environment of a measured subprocess: `threads` for every engine's pool."""
    env = dict(os.environ, POLARS_MAX_THREADS=str(threads), OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    return env


def run_engine(engine: str, paths: Sequence[str], threads: int, tmpdir: str,
               memory_limit: str = "256MB") -> dict:
    """Run one engine in a fresh subprocess; its result plus `tree_rss_bytes` (sampled),
    `spill_bytes` (its temp folder's peak size) and `input_bytes`."""
    spill = tempfile.mkdtemp(prefix=f"{engine}-spill-", dir=tmpdir)
    command = [sys.executable, __file__, "--child", engine, "--threads", str(threads),
               "--tmpdir", spill, "--duckdb-memory-limit", memory_limit, "--input", *paths]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=quiet_env(threads))
    sampler = TreeSampler(process.pid, spill)
    out, _ = process.communicate()
    sampler.stop()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if process.returncode or not lines:
        raise RuntimeError(f"{engine} with {threads} threads failed (exit {process.returncode})")
    result = json.loads(lines[-1][len("RESULT "):])
    result.update(engine=engine, threads=threads, tree_rss_bytes=sampler.peak_rss,
                  spill_bytes=max(sampler.peak_folder, result.get("spill_bytes", 0)),
                  input_bytes=sum(os.path.getsize(p) for p in paths))
    shutil.rmtree(spill, ignore_errors=True)
    return result


def agrees(result: dict, reference: dict, int_sum: Optional[int]) -> List[str]:
    """Mismatches of `result` against the reference counts (and another peer's int sums)."""
    wrong = [f"rows {result['rows']} != {reference['rows']}"] if result["rows"] != reference[
        "rows"] else []
    for j, name in enumerate(CATS):
        for key in ("distinct", "total"):
            if result[key][j] != reference[key][j]:
                wrong.append(f"{name} {key} {result[key][j]} != {reference[key][j]}")
    if result["int_sum"] not in (None, int_sum):
        wrong.append(f"integer sum {result['int_sum']} != {int_sum} (another peer's)")
    return wrong


def compare(results: List[dict]) -> bool:
    """Check every result against ours (the first `ours` run); print mismatches loudly and set
    each result's `agrees`. True when all agree."""
    reference = next(r for r in results if r["engine"] == "ours")
    int_sum = next((r["int_sum"] for r in results if r["int_sum"] is not None), None)
    ok = True
    for r in results:
        wrong = agrees(r, reference, int_sum)
        r["agrees"] = not wrong
        if wrong:
            ok = False
            print(f"!!! MISMATCH: {r['engine']} ({r['threads']} threads) disagrees with ours: "
                  + "; ".join(wrong[:5]) + (f" (+{len(wrong) - 5} more)" if len(wrong) > 5 else ""),
                  flush=True)
    return ok


def print_table(results: List[dict]) -> None:
    print("| engine | threads | seconds | rows/s | MB/s | peak RSS MiB (tree, sampled) | "
          "peak RSS MiB (getrusage) | spill MiB | agrees |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['engine']} | {r['threads']} | {r['seconds']:.2f} | "
              f"{r['rows'] / r['seconds']:,.0f} | {r['input_bytes'] / 1e6 / r['seconds']:.0f} | "
              f"{r['tree_rss_bytes'] / 2**20:,.0f} | {r['rusage_bytes'] / 2**20:,.0f} | "
              f"{r['spill_bytes'] / 2**20:,.0f} | {'yes' if r.get('agrees') else 'NO'} |",
              flush=True)


def require_engines() -> None:
    for name in PEERS:
        if importlib.util.find_spec(name) is None:
            raise SystemExit(f"{name} is not installed: .venv/bin/pip install pyarrow polars "
                             f"duckdb (for this benchmark only; not a requirement)")


def generate(path: Path, rows: int, seed: int = 0) -> None:
    """`rows` lines shaped like Criteo's (preprocess_speed.py's generator)."""
    from preprocess_speed import BLOCK_ROWS, text_block
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        for lo in range(0, rows, BLOCK_ROWS):
            f.write(text_block(rng, min(BLOCK_ROWS, rows - lo)))


def benchmark(paths: Sequence[str], threads: Sequence[int], tmpdir: str,
              memory_limit: str, engines: Sequence[str] = ENGINES) -> List[dict]:
    results = []
    for engine in engines:
        for n in threads:
            results.append(run_engine(engine, paths, n, tmpdir, memory_limit))
            r = results[-1]
            print(f"{engine} {n} threads: {r['seconds']:.2f} s, "
                  f"{r['rows'] / r['seconds']:,.0f} rows/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", default=None, help="Criteo TSV files (plain)")
    parser.add_argument("--rows", type=int, default=2_000_000,
                        help="rows of the generated file when no --input (default 2,000,000)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--duckdb-memory-limit", default="256MB",
                        help="DuckDB's SET memory_limit (default 256MB: it spills)")
    parser.add_argument("--tmpdir", default=None, help="where the generated file and spills go")
    parser.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child, args.input, args.threads[0], args.tmpdir, args.duckdb_memory_limit)
        return
    require_engines()
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        paths = args.input
        if not paths:
            paths = [str(Path(tmp) / "train.tsv")]
            start = time.perf_counter()
            generate(Path(paths[0]), args.rows)
            print(f"generated {args.rows:,} rows, {os.path.getsize(paths[0]) / 1e9:.2f} GB in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        try:
            results = benchmark(paths, args.threads, tmp, args.duckdb_memory_limit, args.engines)
        except RuntimeError as e:
            raise SystemExit(str(e)) from None
    ok = compare(results) if "ours" in args.engines else True
    print_table(results)
    print(f"preprocess_engines: rows={results[0]['rows']} agree={'yes' if ok else 'no'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
