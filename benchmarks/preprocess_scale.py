"""Criteo 1TB preprocessing rehearsed at a fraction of its size: memory limit, speed, peers.

    .venv/bin/python benchmarks/preprocess_scale.py [--scale 0.001] [--rows N] [--days 24]
        [--workers 2] [--limit-fraction 8] [--no-peers] [--tmpdir DIR]

The data: `--days` day files named day_0 .. day_{D-2} and day_23 (the tool's day split: day 23's
halves are validation and test), `--rows` rows in all (default 4.37e9 x `--scale`, 4.37M), each
categorical feature drawn so that its numbers of values scale Criteo 1TB's by `--scale`:
- a head of K values, K = the FL15 cardinality x scale (at least min(FL15, 100), so that the
  small features keep their few values), drawn log-uniformly (Zipf with exponent 1), the same
  every day, each expected at least ~40 times: exactly K values are seen >= 15 times;
- a tail of rare values drawn uniformly from a namespace of the day (about 1.5 draws per value,
  none near 15), so new values keep appearing day after day as in the real logs, sized so that
  the distinct values seen are the raw cardinality x scale (RAW below: 8.8e8 distinct (feature,
  value) pairs in all, 227.6M in cat_0);
- 5% missing; the integers as in preprocess_speed.py. Seeded, vectorised (numpy).
The check of that: the tool runs with --frequency-threshold 15 (its cardinalities - 1 are the
values seen >= 15 times) and the count of distinct values per feature is printed beside both
targets.

The runs (`python -m dlrm_hybrid preprocess criteo` subprocesses, input pages dropped from the
page cache with fsync + POSIX_FADV_DONTNEED before each, so reads come from the disk): in memory
(the tool's default limit, half the memory available, far above this data's needs) with
`--workers` and with 1 worker, then with `--memory-limit` = the in-memory run's peak RSS /
`--limit-fraction` (divided by 1.25 while the tool refuses the limit as too small for its
workers: its one-line error printed). The process tree's RSS is sampled from /proc every 20 ms
beside the peak the tool reports. The two datasets (`--workers` each) are compared file by file,
byte for byte, except preprocess_report.json (timings); the 1-worker dataset too. Also: the
disk's sequential read speed of the inputs (16 MiB reads after fsync + POSIX_FADV_DONTNEED) and
the peer engines' counting pass on the same files (preprocess_engines.py; DuckDB's memory_limit
doubled from 256MB while it runs out of memory). Then an extrapolation to Criteo 1TB, the
arithmetic printed, and last:
`preprocess_scale: rows=N distinct=N limit_mib=N peak_rss_mib=N spill_mib=N identical=yes|no rows_per_s=N inmemory_rows_per_s=N`
(peak_rss_mib: the limited run's, the larger of the tool's figure and the sampled one).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from preprocess_engines import (PEERS, TreeSampler, compare, print_table, quiet_env,
                                require_engines, run_engine)
from preprocess_speed import decimal_field, hex_field

FL15 = np.array([7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828,
                 11, 2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97,
                 35])
RAW = np.array([227605432, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 130229467, 3067956,
                405282, 10, 2209, 11938, 155, 4, 976, 14, 292775614, 40790948, 187188510, 590152,
                12973, 108, 36])  # distinct values per feature in all 24 days of Criteo 1TB
ROWS_1TB, BYTES_1TB = 4.37e9, 1.1e12
SMALL = 100  # features with fewer FL15 values keep min(FL15, SMALL) of them at any scale
MISSING = 0.05
TAIL_DRAWS = 1.5  # expected draws per tail value: 78% of them are seen, none near 15 times
TAIL_KEY = 1 << 31  # tail keys: TAIL_KEY + day << 26 + index; head keys: rank
BLOCK_ROWS = 200_000
READ_BYTES = 16 << 20
DUCKDB_LIMITS = ("256MB", "512MB", "1GB", "2GB", "4GB")
REPORT = "preprocess_report.json"


# ---- the data -----------------------------------------------------------------------------

class Vocabulary:
    """Per feature: K head values (seen >= 15 times), the tail values of each day and the share
    of draws that go to the tail, for `rows` rows over `days` days."""

    def __init__(self, scale: float, rows: int, days: int) -> None:
        self.head = np.maximum(np.round(FL15 * scale), np.minimum(FL15, SMALL)).astype(np.int64)
        self.distinct = np.maximum(np.round(RAW * scale).astype(np.int64), self.head)
        tail_seen = self.distinct - self.head
        tail = np.ceil(tail_seen / (1 - np.exp(-TAIL_DRAWS))).astype(np.int64)
        self.tail_per_day = np.maximum(1, tail // days)
        self.tail_share = TAIL_DRAWS * tail / (rows * (1 - MISSING))
        if (self.tail_share > 0.5).any() or (self.tail_per_day >= 1 << 26).any():
            raise SystemExit("--rows too few for --scale's vocabularies: raise --rows")

    def draw(self, rng: np.random.Generator, rows: int, day: int) -> np.ndarray:
        """[rows, 26] 32-bit values: key -> key * odd + feature constant, a bijection per feature,
        so distinct keys are distinct values."""
        u = rng.random((rows, 26))
        head = np.exp(rng.random((rows, 26)) * np.log(self.head + 1)).astype(np.int64) - 1
        tail = TAIL_KEY + (day << 26) + (rng.random((rows, 26)) * self.tail_per_day).astype(
            np.int64)
        keys = np.where(u < self.tail_share, tail, np.minimum(head, self.head - 1))
        return (keys * 2654435761 + np.arange(26) * 40503) % 2**32


def day_block(rng: np.random.Generator, vocabulary: Vocabulary, rows: int, day: int) -> bytes:
    """`rows` Criteo TSV lines of one day (preprocess_speed.text_block's layout)."""
    ints = np.exp(rng.random((rows, 13)) * np.log(50_000)).astype(np.int64) - 3
    cats = vocabulary.draw(rng, rows, day)
    tab, newline = np.full((rows, 1), 9, np.uint8), np.full((rows, 1), 10, np.uint8)
    columns = [(ord("0") + (rng.random((rows, 1)) < 0.25)).astype(np.uint8)]
    int_missing, cat_missing = rng.random((rows, 13)) < 0.2, rng.random((rows, 26)) < MISSING
    columns += [decimal_field(ints[:, j], int_missing[:, j]) for j in range(13)]
    columns += [hex_field(cats[:, j], cat_missing[:, j]) for j in range(26)]
    parts = [x for column in columns for x in (tab, column)][1:] + [newline]
    matrix = np.concatenate(parts, axis=1)
    return matrix[matrix != 0].tobytes()


def day_names(days: int) -> List[int]:
    return list(range(days - 1)) + [23]


def generate(folder: Path, vocabulary: Vocabulary, rows: int, days: int, seed: int) -> List[str]:
    rng, paths = np.random.default_rng(seed), []
    for d, day in enumerate(day_names(days)):
        paths.append(str(folder / f"day_{day}"))
        day_rows = rows // days + (d < rows % days)
        with open(paths[-1], "wb") as f:
            for lo in range(0, day_rows, BLOCK_ROWS):
                f.write(day_block(rng, vocabulary, min(BLOCK_ROWS, day_rows - lo), day))
    return paths


# ---- measuring ----------------------------------------------------------------------------

def drop_cache(paths: Sequence[str]) -> None:
    """Written pages to disk, then out of the page cache: the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_speed(paths: Sequence[str]) -> float:
    """Bytes/s of a sequential read of `paths`, 16 MiB at a time, from the disk."""
    drop_cache(paths)
    buffer, total = bytearray(READ_BYTES), 0
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total / (time.perf_counter() - start)


def run_tool(paths: Sequence[str], output: Path, workers: int,
             memory_limit_mib: Optional[int]) -> Optional[dict]:
    """The tool as a user runs it; its report plus the sampled tree peak and the wall time, or
    None where it refused the memory limit (exit 2, its one-line error printed)."""
    drop_cache(paths)
    command = [sys.executable, "-m", "dlrm_hybrid", "preprocess", "criteo", "--input", *paths,
               "--output", str(output), "--workers", str(workers), "--frequency-threshold", "15"]
    if memory_limit_mib is not None:
        command += ["--memory-limit", f"{memory_limit_mib}M"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=quiet_env(1))
    sampler = TreeSampler(process.pid)
    out, _ = process.communicate()
    sampler.stop()
    wall = time.perf_counter() - start
    if process.returncode == 2 and memory_limit_mib is not None:
        print(f"refused --memory-limit {memory_limit_mib}M: {out.strip().splitlines()[-1]}")
        return None
    if process.returncode:
        print(out[-3000:])
        raise SystemExit(f"{' '.join(command[2:6])} ... failed (exit {process.returncode})")
    report = json.loads((output / REPORT).read_text())
    report.update(sampled_rss_bytes=sampler.peak_rss, wall_seconds=wall)
    return report


def identical(a: Path, b: Path) -> List[str]:
    """Files that differ (or exist on one side only) between two datasets, the report aside."""
    names = {str(p.relative_to(root)) for root in (a, b) for p in root.rglob("*") if p.is_file()}
    return sorted(n for n in names - {REPORT}
                  if not ((a / n).is_file() and (b / n).is_file()
                          and filecmp.cmp(a / n, b / n, shallow=False)))


def pass_line(name: str, report: dict) -> str:
    """Rows/s and MB/s per pass where the report has them, and the whole run's."""
    rows, size = report["rows_written"]["total"], report.get("input_bytes")
    parts = [f"{name}: {rows / report['seconds']:,.0f} rows/s overall ({report['seconds']:.1f} s"
             + (f", {size / 1e6 / report['seconds']:.0f} MB/s of input)" if size else ")")]
    for key, p in report.get("passes", {}).items():
        if isinstance(p, dict) and p.get("seconds"):
            mb = f", {size / 1e6 / p['seconds']:.0f} MB/s" if size else ""
            parts.append(f"{key} {rows / p['seconds']:,.0f} rows/s{mb} ({p['seconds']:.1f} s)")
    rss = max(report["peak_rss_bytes"], report["sampled_rss_bytes"])
    parts.append(f"peak RSS {report['peak_rss_bytes'] / 2**20:,.0f} MiB reported, "
                 f"{report['sampled_rss_bytes'] / 2**20:,.0f} MiB sampled (tree)")
    parts.append(f"spill {report.get('spill_bytes', 0) / 2**20:,.0f} MiB")
    if report.get("partitions") is not None:
        parts.append(f"aggregation ranges {report['partitions']}")
    return "; ".join(parts) + f" [peak used {rss / 2**20:,.0f} MiB]"


def pass_rates(report: dict) -> dict:
    """Rows/s of each pass (count, write), or of the whole run where passes are not reported."""
    rows = report["rows_written"]["total"]
    passes = {k: rows / p["seconds"] for k, p in report.get("passes", {}).items()
              if isinstance(p, dict) and p.get("seconds")}
    return passes or {"both passes": rows / report["seconds"]}


def extrapolate(one: dict, many: dict, workers: int, disk: float, distinct: int) -> None:
    """Criteo 1TB's time on this host and on a 16-core one, from the rows/s per worker per pass
    (the 1- and `workers`-worker runs) and the disk (each pass reads the whole input), plus the
    rest of the run (numbering, start) grown with the distinct pairs, on no more cores."""
    print(f"\nCriteo 1TB ({ROWS_1TB:.3g} rows, {BYTES_1TB / 1e12:.1f} TB), each pass bounded "
          f"by its CPU rate and by reading {BYTES_1TB / 1e12:.1f} TB at {disk / 1e6:,.0f} MB/s "
          f"= {BYTES_1TB / disk:,.0f} s:")
    rates_one, rates_many = pass_rates(one), pass_rates(many)
    passes = sum(p["seconds"] for p in many.get("passes", {}).values() if isinstance(p, dict))
    rest = max(0.0, many["seconds"] - passes) * RAW.sum() / distinct if passes else 0.0
    if passes:
        print(f"  the rest (numbering, start; an upper bound, start-up does not grow): "
              f"({many['seconds']:.1f} - {passes:.1f}) s x {RAW.sum():,} / {distinct:,} pairs "
              f"= {rest:,.0f} s")
    for cores in sorted({workers, 16}):
        total = rest
        for name, r1 in rates_one.items():
            rn = rates_many.get(name, r1 * workers)
            efficiency = min(1.0, rn / (workers * r1))  # kept where the 1-worker run was slower
            rate = rn if cores == workers else cores * r1 * efficiency
            cpu = ROWS_1TB / rate
            seconds = max(cpu, BYTES_1TB / disk)
            total += seconds
            how = (f"measured {rn:,.0f} rows/s" if cores == workers else
                   f"{cores} x {r1:,.0f} rows/s per worker x {efficiency:.2f} efficiency "
                   f"(that of {workers} workers) = {rate:,.0f} rows/s")
            print(f"  {cores} cores, {name}: {how}; {ROWS_1TB:.3g} / {rate:,.0f} = {cpu:,.0f} s "
                  f"CPU, max with the disk's {BYTES_1TB / disk:,.0f} s = {seconds:,.0f} s")
        print(f"  {cores} cores: {total:,.0f} s = {total / 3600:.1f} h")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.001,
                        help="fraction of Criteo 1TB's rows and vocabularies (default 0.001)")
    parser.add_argument("--rows", type=int, default=None, help="rows (default 4.37e9 x scale)")
    parser.add_argument("--days", type=int, default=24, help="day files (at least 2)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--limit-fraction", type=float, default=8.0,
                        help="memory limit = in-memory peak / this (default 8)")
    parser.add_argument("--no-peers", action="store_true", help="skip the peer engines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmpdir", default=None, help="where the inputs and outputs go")
    args = parser.parse_args()
    if not args.no_peers:
        require_engines()
    rows = args.rows or int(ROWS_1TB * args.scale)
    vocabulary = Vocabulary(args.scale, rows, max(args.days, 2))
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "in").mkdir()
        start = time.perf_counter()
        paths = generate(tmp / "in", vocabulary, rows, max(args.days, 2), args.seed)
        size = sum(os.path.getsize(p) for p in paths)
        print(f"generated {rows:,} rows in {len(paths)} day files, {size / 1e9:.2f} GB, in "
              f"{time.perf_counter() - start:.1f} s (scale {args.scale:g}: "
              f"{vocabulary.head.sum():,} values seen >= 15 times and {vocabulary.distinct.sum():,}"
              f" distinct (feature, value) pairs targeted)", flush=True)
        disk = disk_read_speed(paths)
        print(f"disk: sequential read of the inputs, 16 MiB reads, after fsync + "
              f"POSIX_FADV_DONTNEED: {disk / 1e6:,.0f} MB/s", flush=True)

        memory = run_tool(paths, tmp / "memory", args.workers, None)
        print(pass_line(f"in memory, {args.workers} workers", memory), flush=True)
        one = run_tool(paths, tmp / "one", 1, None)
        print(pass_line("in memory, 1 worker", one), flush=True)
        needed = min(memory["peak_rss_bytes"], memory["sampled_rss_bytes"])
        limited, fraction = None, args.limit_fraction
        while fraction >= 1:  # raised while the tool refuses the limit as too small
            limit_mib = int(needed / 2**20 / fraction)
            limited = run_tool(paths, tmp / "limited", args.workers, limit_mib)
            if limited is not None:
                break
            fraction /= 1.25
        if limited is None:
            raise SystemExit("the tool refused every memory limit up to the in-memory peak")
        print(pass_line(f"--memory-limit {limit_mib}M (in-memory peak {needed / 2**20:,.0f} MiB "
                        f"/ {fraction:.2f}), {args.workers} workers", limited), flush=True)
        rss = max(limited["peak_rss_bytes"], limited["sampled_rss_bytes"])
        print(f"limited run's peak {rss / 2**20:,.0f} MiB: "
              f"{'within' if rss <= limit_mib * 2**20 else 'OVER'} its {limit_mib} MiB limit")
        differ = identical(tmp / "memory", tmp / "limited")
        print(f"in memory vs limited: identical={'no' if differ else 'yes'}"
              + (f" (differ: {', '.join(differ[:10])})" if differ else ""))
        differ_one = identical(tmp / "memory", tmp / "one")
        print(f"{args.workers} workers vs 1: identical={'no' if differ_one else 'yes'}"
              + (f" (differ: {', '.join(differ_one[:10])})" if differ_one else ""), flush=True)

        drop_cache(paths)
        ours = run_engine("ours", paths, args.workers, tmp_name)
        results = [ours]
        for engine in [] if args.no_peers else PEERS:
            for duckdb_limit in DUCKDB_LIMITS:  # doubled while DuckDB runs out of memory
                drop_cache(paths)
                try:
                    results.append(run_engine(engine, paths, args.workers, tmp_name,
                                              duckdb_limit))
                    break
                except RuntimeError as e:
                    print(f"{e} (DuckDB memory_limit {duckdb_limit})", flush=True)
    compare(results)
    print(f"\ncounting pass only, the same {len(paths)} files, {args.workers} threads each:")
    print_table(results)

    seen = np.array(ours["distinct"])
    fl15 = np.array(memory["cardinalities"]) - 1
    print("\nper feature: values seen >= 15 times (target) and distinct values (target):")
    print("  " + ", ".join(f"cat_{j} {fl15[j]:,} ({vocabulary.head[j]:,}) {seen[j]:,} "
                           f"({vocabulary.distinct[j]:,})" for j in range(26)))
    distinct = int(memory.get("distinct_values") or seen.sum())
    per_pair = needed / distinct
    print(f"in-memory peak per distinct pair: {needed / 2**20:,.0f} MiB / {distinct:,} = "
          f"{per_pair:,.0f} B (processes' base included); x {RAW.sum():,} pairs (Criteo 1TB) = "
          f"{per_pair * RAW.sum() / 2**30:,.0f} GiB if the in-memory path grew linearly; the "
          f"limited run's spill / scale = {limited.get('spill_bytes', 0) / args.scale / 1e9:,.0f}"
          f" GB of disk at full size")
    extrapolate(one, memory, args.workers, disk, distinct)
    print(f"preprocess_scale: rows={limited['rows_written']['total']} distinct={distinct} "
          f"limit_mib={limit_mib} peak_rss_mib={rss / 2**20:.0f} "
          f"spill_mib={limited.get('spill_bytes', 0) / 2**20:.0f} "
          f"identical={'no' if differ else 'yes'} rows_per_s={limited['rows_per_s']:.0f} "
          f"inmemory_rows_per_s={memory['rows_per_s']:.0f}")


if __name__ == "__main__":
    main()
