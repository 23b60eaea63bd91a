"""`python -m dlrm_hybrid preprocess criteo`: raw Criteo click logs (TSV, plain or .gz) into the
split-binary layout, streaming, in two exact passes and several processes.

Input lines: `label \\t I1..I13 \\t C1..C26` (40 fields).
- Numericals: missing -> 0.0; otherwise negatives clamped to 0, then log(x + 3); stored float16.
  More than 18 characters is `bad_numeric`.
- Categoricals: the 8-hex-digit value as an integer. Id 0 is shared by missing values, values
  seen fewer than `--frequency-threshold` times and values beyond the table size; ids 1.. go to
  the kept values by descending count, ties by ascending value, so the output does not depend on
  input order or worker count. `--max-table-size N` keeps the N-1 most frequent values.
  Cardinality = 1 + kept values.
- Pass 1 counts every value exactly (numpy sorted (value, count) arrays, no Python dicts);
  pass 2 maps values to ids with `np.searchsorted` and writes. Memory grows with the distinct
  values, never with the rows.
- Malformed lines are counted by kind (`KINDS`) and skipped, except `crlf`: it counts lines
  ending in \\r\\n (whatever else is wrong with them) and keeps the row. `--strict` stops at the
  first problem of any kind with `FILE:LINE: reason`.
- Rows short only by trailing fields (fewer than 40, the last not empty, valid once the missing
  ones are read as empty: what stripping trailing whitespace leaves of rows ending in empty
  fields) are wrong_field_count, and the report says how many and what `--pad-short-rows` does:
  read them with those fields empty and keep them.
- Splits (`--split`, default auto: days when every input is named `day_N[.gz]`, else hash):
  days (Criteo 1TB): day 23's first ceil(N/2) rows -> validation, the rest -> test (the MLPerf
  reference's and torchrec's rule, recorded as feature_spec.yaml's `metadata.day_23`; see
  day23.py), every other day -> train; hash: each row goes by a splitmix64 hash of (seed,
  global row number): < 0.90 train, < 0.95 validation, else test. Rows keep input order within
  a split. Training evaluates on validation and `eval` on test, so a dataset with an empty split
  is refused: day inputs without day 23 before any reading, too few rows after the write pass.
- Parallelism: plain files are cut into TASK_BYTES ranges at line starts, a .gz file is one task;
  pass-2 workers write per-task part files that the parent appends in task order, so the output
  is byte-identical for any `--workers`.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import re
import resource
import shutil
import time
import zlib
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo.parse import (BAD_CATEGORY, BAD_LABEL, BAD_NUMERIC, BLANK_LINE, CRLF,
                                          KINDS, NUM_CATEGORICAL, NUM_FIELDS, NUM_NUMERICAL,
                                          REASONS, WRONG_FIELD_COUNT, Chunk, parse_lines)
from dlrm_hybrid.data.day23 import NOT_DAYS, RULE_KEY, VALIDATION_FIRST, validation_rows
from dlrm_hybrid.data.feature_spec import SPLITS
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import REPORT, SplitBinaryWriter, check_new_output
from dlrm_hybrid.errors import DataError

TRAIN, VALIDATION, TEST = range(3)  # indices into SPLITS
SPLIT_MODES = ("auto", "days", "hash")
LAST_DAY = 23
DAY_FILE = re.compile(r"day_(\d+)(\.gz)?")
TASK_BYTES = 64 << 20  # one worker task; tests shrink it to exercise several tasks per file
CHUNK_BYTES = 8 << 20  # parsed at once; bounds a worker's memory
WRITE_ROWS = 1 << 20  # rows per writer.write when appending a part
MIN_MERGE = 1 << 16  # smallest batch of additions ValueCounts merges
PROGRESS_SECONDS = 10.0


# ---- reading ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """Whole lines of one input: bytes [start, end) of a plain file, or all of a .gz (end None),
    read `block` bytes at a time."""
    path: str
    start: int
    end: Optional[int]
    block: int


def plan_tasks(paths: Sequence[str]) -> List[Task]:
    """Cut plain files into about TASK_BYTES ranges starting at line starts; a .gz is one task."""
    tasks: List[Task] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                if path.endswith(".gz"):
                    tasks.append(Task(path, 0, None, CHUNK_BYTES))
                    continue
                size = os.fstat(f.fileno()).st_size
                starts = {_next_line_start(f, b) for b in range(TASK_BYTES, size, TASK_BYTES)}
                cuts = sorted({0, size} | starts)
                tasks += [Task(path, a, b, CHUNK_BYTES) for a, b in zip(cuts, cuts[1:])]
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror}); check the --input path") from None
    return tasks


def _next_line_start(f, position: int) -> int:
    f.seek(position - 1)
    while True:
        block = f.read(1 << 16)
        found = block.find(b"\n")
        if found >= 0:
            return f.tell() - len(block) + found + 1
        if not block:
            return f.tell()


def read_lines(task: Task) -> Iterator[bytes]:
    """The task's text in blocks of whole lines of about `task.block` bytes, each ending in a
    newline."""
    carry = b""
    try:
        with (gzip.open(task.path, "rb") if task.end is None else open(task.path, "rb")) as f:
            f.seek(task.start)
            left = None if task.end is None else task.end - task.start
            while block := f.read(task.block if left is None else min(task.block, left)):
                left = None if left is None else left - len(block)
                cut = block.rfind(b"\n") + 1
                if cut:
                    yield carry + block[:cut]
                    carry = block[cut:]
                else:
                    carry += block
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{task.path}: truncated or corrupt gzip file ({e}); download it "
                        f"again") from None
    except OSError as e:
        raise DataError(f"{task.path}: cannot read ({e.strerror or e}); check the file") from None
    if carry:
        yield carry + b"\n"


# ---- counting and ids ---------------------------------------------------------------------

def merge_counts(pairs: Sequence[Tuple[np.ndarray, np.ndarray]]) -> Tuple[np.ndarray, np.ndarray]:
    """Sum the counts of equal values over (values, counts) pairs; values come back sorted."""
    values = np.concatenate([v for v, _ in pairs])
    counts = np.concatenate([c for _, c in pairs])
    order = np.argsort(values)
    values, counts = values[order], counts[order]
    if not len(values):
        return values, counts
    first = np.flatnonzero(np.r_[True, values[1:] != values[:-1]])
    return values[first], np.add.reduceat(counts, first)


class ValueCounts:
    """Exact counts of one feature's values. Additions wait until they are as many as the table
    holds, so adding T batches costs O(total log total) rather than T merges of the whole table."""

    def __init__(self) -> None:
        self.table = (np.empty(0, np.int64), np.empty(0, np.int64))
        self._pending: List[Tuple[np.ndarray, np.ndarray]] = []
        self._pending_size = 0

    def add(self, values: np.ndarray, counts: np.ndarray) -> None:
        self._pending.append((values, counts))
        self._pending_size += len(values)
        if self._pending_size >= max(len(self.table[0]), MIN_MERGE):
            self.totals()

    def totals(self) -> Tuple[np.ndarray, np.ndarray]:
        if self._pending:
            self.table = merge_counts([self.table, *self._pending])
        self._pending, self._pending_size = [], 0
        return self.table


def build_table(values: np.ndarray, counts: np.ndarray, threshold: int,
                max_rows: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Ids 1.. for values counted at least `threshold` times, most frequent first (ties: smaller
    value first, as `values` is sorted), at most max_rows - 1 of them. Returns the kept values
    sorted, for searchsorted, and their ids."""
    keep = counts >= max(threshold, 1)
    ranked = values[keep][np.argsort(-counts[keep], kind="stable")]
    ranked = ranked[:None if max_rows is None else max_rows - 1]
    order = np.argsort(ranked)
    return ranked[order], (order + 1).astype(np.uint32)


def map_ids(raw: np.ndarray, keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Ids of raw values (-1 missing): the table's id, or 0 for values it does not hold. Looked up
    in sorted order, which is ~3x faster on large tables: neighbouring lookups share cache lines."""
    if not len(keys):
        return np.zeros(len(raw), np.uint32)
    order = np.argsort(raw)
    needles = raw[order]
    at = np.minimum(np.searchsorted(keys, needles), len(keys) - 1)
    found = np.empty(len(raw), np.uint32)
    found[order] = np.where(keys[at] == needles, ids[at], 0)
    return found


def one_hot_columns(ids: np.ndarray) -> List[np.ndarray]:
    """[N, 26] ids as the writer takes them: one [N, 1] array per feature."""
    return [ids[:, i:i + 1] for i in range(ids.shape[1])]


# ---- splits -------------------------------------------------------------------------------

class SplitRule(NamedTuple):
    """How a task's rows go to splits. kind "train": all rows; "halves": row numbers within the
    day below `value` -> validation, the rest test; "hash": global row numbers hashed with seed
    `value`, 90/5/5."""
    kind: str
    value: int = 0


def day_number(path: str) -> Optional[int]:
    match = DAY_FILE.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None


def day_rule(day: int, rows_of_day: int) -> SplitRule:
    if day == LAST_DAY:
        return SplitRule("halves", validation_rows(rows_of_day))
    return SplitRule("train")


def resolve_split(mode: str, inputs: Sequence[str]) -> str:
    """"days" or "hash" for `--split mode`: auto is days when every input is a `day_N` file."""
    if mode not in SPLIT_MODES:
        raise ConfigError(f"--split: {mode!r} is not one of {', '.join(SPLIT_MODES)}")
    not_days = [p for p in inputs if day_number(p) is None]
    if mode == "days" and not_days:
        raise ConfigError(f"--split days: {not_days[0]} is not named day_N; rename the Criteo "
                          f"1TB day files or use --split hash")
    return mode if mode != "auto" else "hash" if not_days else "days"


def check_days(days: Sequence[int], add_day_23: str) -> None:
    """Day 23 alone makes validation and test, the other days train: refuse a set of days that
    leaves a split empty before reading them, not when training first evaluates."""
    if LAST_DAY not in days:
        listed = ",".join(map(str, sorted(set(days))))
        raise ConfigError(f"--input: no day_23 among days {listed}, and its halves make the test "
                          f"and validation splits; {add_day_23} or use --split hash (a seeded "
                          f"90/5/5 split by row)")
    if not set(days) - {LAST_DAY}:
        raise ConfigError("--input: only day_23, whose halves make test and validation, so "
                          "train would be empty; add days 0..22 or use --split hash")


def check_splits_filled(counts: dict, mode: str) -> None:
    """Refuse, before the dataset is moved into place, one whose split got no rows: training
    evaluates on validation and `eval` on test (tiny inputs, a day 23 of one row)."""
    empty = [split for split in SPLITS if not counts[split]]
    if empty:
        how = ("day 23 makes test and validation" if mode == "days"
               else "the seeded split sends 90/5/5% of rows to train/validation/test")
        rows = " ".join(f"{split}={counts[split]}" for split in SPLITS)
        raise DataError(f"--input: the {' and '.join(empty)} split{'s' * (len(empty) > 1)} "
                        f"would be empty ({rows}; {how}); give more rows")


def split_codes(rule: SplitRule, rows: np.ndarray) -> np.ndarray:
    """TRAIN/VALIDATION/TEST for each row number in `rows`."""
    if rule.kind == "train":
        return np.full(len(rows), TRAIN, np.int8)
    if rule.kind == "halves":
        return np.where(rows < rule.value, VALIDATION, TEST).astype(np.int8)
    seed = _mix64(np.full(len(rows), rule.value % 2**64, np.uint64))
    unit = (_mix64(rows.astype(np.uint64) ^ seed) >> 11) / 2.0**53
    return np.select([unit < 0.90, unit < 0.95], [TRAIN, VALIDATION], TEST).astype(np.int8)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed, well-mixed uint64 hash (array arithmetic wraps)."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    return x ^ (x >> 31)


def _split_jobs(mode: str, tasks: List[Task], task_rows: List[int],
                seed: int) -> List[Tuple[SplitRule, int]]:
    """(rule, number of its first row) per task: within its day file for the days split, global
    for the hash split."""
    if mode == "days":
        day_rows: dict = defaultdict(int)
        for task, rows in zip(tasks, task_rows):
            day_rows[day_number(task.path)] += rows
        row0, jobs = defaultdict(int), []
        for task, rows in zip(tasks, task_rows):
            day = day_number(task.path)
            jobs.append((day_rule(day, day_rows[day]), row0[day]))
            row0[day] += rows
        return jobs
    starts = np.cumsum([0, *task_rows[:-1]]) if tasks else []
    return [(SplitRule("hash", seed), int(s)) for s in starts]


# ---- workers ------------------------------------------------------------------------------

@dataclass
class TaskCounts:
    tables: List[Tuple[np.ndarray, np.ndarray]]  # per feature (values, counts)
    bad: np.ndarray  # per kind
    rows: int
    lines: int
    problem: Optional[Tuple[int, str]]  # (line index in the task, kind) of its first problem
    short: np.ndarray  # [NUM_FIELDS] lines short only by trailing fields, by field count


def _count_task(job: Tuple[Task, bool, bool]) -> TaskCounts:
    """Pass 1 over one task; strict stops at its first problem."""
    task, strict, pad_short = job
    counters = [ValueCounts() for _ in range(NUM_CATEGORICAL)]
    bad, rows, lines, problem = np.zeros(len(KINDS), np.int64), 0, 0, None
    short = np.zeros(NUM_FIELDS, np.int64)
    for data in read_lines(task):
        chunk = parse_lines(data, pad_short)
        first = chunk.first_problem()
        if problem is None and first is not None:
            problem = (lines + first[0], first[1])
            if strict:
                break
        bad += chunk.bad_counts()
        short += np.bincount(chunk.short, minlength=NUM_FIELDS)
        rows, lines = rows + len(chunk.labels), lines + chunk.lines
        for column, counter in zip(chunk.cats.T, counters):
            counter.add(*np.unique(column[column >= 0], return_counts=True))
    return TaskCounts([c.totals() for c in counters], bad, rows, lines, problem, short)


_TABLES: List[Tuple[np.ndarray, np.ndarray]] = []  # in pass-2 workers: (values, ids) per feature


def _load_tables(work: Path) -> None:
    _TABLES[:] = [(np.load(work / f"values_{i}.npy", mmap_mode="r"),
                   np.load(work / f"ids_{i}.npy", mmap_mode="r")) for i in range(NUM_CATEGORICAL)]


def _part_paths(work: Path, part: int, split: str) -> List[Path]:
    return [work / f"part{part}.{split}.{k}" for k in ("label", "dense", "ids")]


def _write_task(job: Tuple[Task, int, SplitRule, int, Path, bool]) -> List[int]:
    """Pass 2 over one task: ids and splits, appended to its part files; rows written per split."""
    task, part, rule, row0, work, pad_short = job
    written = [0] * len(SPLITS)
    for data in read_lines(task):
        chunk = parse_lines(data, pad_short)
        ids = np.stack([map_ids(c, *t) for c, t in zip(chunk.cats.T, _TABLES)], axis=1)
        codes = split_codes(rule, np.arange(row0, row0 + len(ids)))
        row0 += len(ids)
        for code, split in enumerate(SPLITS):
            keep = codes == code
            for path, array in zip(_part_paths(work, part, split),
                                   (chunk.labels[keep], chunk.dense[keep], ids[keep])):
                with open(path, "ab") as f:
                    f.write(array.tobytes())
            written[code] += int(keep.sum())
    return written


@contextmanager
def _pool(workers: int, initializer=None, initargs=()):
    """Worker processes, always joined so that their peak memory shows in RUSAGE_CHILDREN.
    Spawned, not forked: they start without the parent's torch, memory and threads. On an error
    queued tasks are cancelled and running ones finish (Pool.terminate() can deadlock on a queue
    lock held by the worker it kills)."""
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"), initializer, initargs)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


class Progress:
    """Prints `what: N rows, R rows/s` at most every PROGRESS_SECONDS, and at done()."""

    def __init__(self, what: str) -> None:
        self.what, self.rows = what, 0
        self.start = self.last = time.perf_counter()

    def add(self, rows: int) -> None:
        self.rows += rows
        if time.perf_counter() - self.last >= PROGRESS_SECONDS:
            self.done()

    def done(self) -> None:
        self.last = time.perf_counter()
        rate = self.rows / max(self.last - self.start, 1e-9)
        print(f"{self.what}: {self.rows:,} rows, {rate:,.0f} rows/s", flush=True)


def speed_report(start: float, counts: dict) -> dict:
    """Rows written (total and per split), seconds since `start`, rows/s and peak memory."""
    seconds, total = time.perf_counter() - start, sum(counts.values())
    return {"rows_written": {"total": total, **counts}, "seconds": round(seconds, 3),
            "rows_per_s": round(total / max(seconds, 1e-9), 1), "peak_rss_bytes": peak_rss_bytes()}


def peak_rss_bytes() -> int:
    """This process's peak RSS plus the largest joined child's (ru_maxrss is KiB on Linux). An
    upper bound: Linux starts a spawned child's ru_maxrss at its parent's RSS at that time."""
    return 1024 * (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                   + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)


# ---- the two passes -----------------------------------------------------------------------

@dataclass
class Survey:
    tables: List[Tuple[np.ndarray, np.ndarray]]
    bad: dict
    task_rows: List[int]
    first_problem: Optional[str]
    short: np.ndarray  # [NUM_FIELDS] lines short only by trailing fields, by field count


def _count_pass(tasks: List[Task], workers: int, strict: bool, pad_short: bool) -> Survey:
    counters = [ValueCounts() for _ in range(NUM_CATEGORICAL)]
    bad, task_rows, first_problem = np.zeros(len(KINDS), np.int64), [], None
    short = np.zeros(NUM_FIELDS, np.int64)
    lines_before: dict = defaultdict(int)  # per file, to turn task lines into file lines
    progress = Progress("pass 1/2 (count)")
    with _pool(workers) as pool:
        for task, got in zip(tasks, pool.map(_count_task, [(t, strict, pad_short) for t in tasks])):
            if got.problem and first_problem is None:
                line, kind = got.problem
                line += lines_before[task.path] + 1
                first_problem = f"{task.path}:{line}: {REASONS[kind]} ({kind})"
                if strict:
                    raise DataError(f"{first_problem}; fix the line or run without --strict to "
                                    f"skip it")
            lines_before[task.path] += got.lines
            for counter, table in zip(counters, got.tables):
                counter.add(*table)
            bad += got.bad
            short += got.short
            task_rows.append(got.rows)
            progress.add(got.rows)
    progress.done()
    return Survey([c.totals() for c in counters], dict(zip(KINDS, bad.tolist())), task_rows,
                  first_problem, short)


def _write_pass(tasks: List[Task], jobs: List[Tuple[SplitRule, int]],
                tables: List[Tuple[np.ndarray, np.ndarray]], workers: int, writer,
                pad_short: bool) -> None:
    """Workers map and split each task into part files in the writer's temporary folder (the
    tables go there too, for them to memory-map); the parent appends the parts in task order."""
    work = writer.tmp / "_work"
    work.mkdir()
    for i, (keys, ids) in enumerate(tables):
        np.save(work / f"values_{i}.npy", keys)
        np.save(work / f"ids_{i}.npy", ids)
    progress = Progress("pass 2/2 (write)")
    args = [(task, part, rule, row0, work, pad_short)
            for part, (task, (rule, row0)) in enumerate(zip(tasks, jobs))]
    with _pool(workers, _load_tables, (work,)) as pool:
        for part, written in enumerate(pool.map(_write_task, args)):
            _append_part(writer, work, part, written)
            progress.add(sum(written))
    progress.done()
    shutil.rmtree(work)


def _append_part(writer, work: Path, part: int, written: List[int]) -> None:
    for split, rows in zip(SPLITS, written):
        paths = _part_paths(work, part, split)
        if rows:
            labels = np.memmap(paths[0], np.uint8, "r")
            dense = np.memmap(paths[1], np.float16, "r").reshape(rows, NUM_NUMERICAL)
            ids = np.memmap(paths[2], np.uint32, "r").reshape(rows, NUM_CATEGORICAL)
            for lo in range(0, rows, WRITE_ROWS):
                at = slice(lo, lo + WRITE_ROWS)
                writer.write(split, labels[at], dense[at], one_hot_columns(ids[at]))
            del labels, dense, ids
        for path in paths:
            path.unlink(missing_ok=True)


def preprocess_criteo(inputs: Sequence[str], output: str, frequency_threshold: int = 0,
                      max_table_size: Optional[int] = None, workers: Optional[int] = None,
                      strict: bool = False, split_seed: int = 0, split: str = "auto",
                      pad_short_rows: bool = False) -> dict:
    """Raw Criteo TSVs -> split-binary dataset at `output`; returns the report it also writes
    to `output/preprocess_report.json`. `split`: one of SPLIT_MODES. `pad_short_rows`: keep rows
    short only by trailing fields, those fields empty."""
    inputs = [str(p) for p in inputs]
    workers = workers or os.cpu_count() or 1
    _check_arguments(inputs, output, frequency_threshold, max_table_size, workers)
    split = resolve_split(split, inputs)
    if split == "days":
        check_days([day_number(p) for p in inputs], "add day_23.gz")
    start = time.perf_counter()
    tasks = plan_tasks(inputs)
    survey = _count_pass(tasks, workers, strict, pad_short_rows)
    short = short_rows(survey.short, survey.bad[KINDS[WRONG_FIELD_COUNT]], pad_short_rows)
    if not sum(survey.task_rows):
        raise DataError(f"{inputs[0]}: no valid rows in the input (skipped: {survey.bad}); "
                        f"expected Criteo TSV lines of {NUM_FIELDS} tab-separated fields"
                        + (f"; {short['note']}" if short["rows"] else ""))
    tables = [build_table(v, c, frequency_threshold, max_table_size) for v, c in survey.tables]
    spec = DataSpec(NUM_NUMERICAL, [1 + len(keys) for keys, _ in tables], [1] * NUM_CATEGORICAL)
    with SplitBinaryWriter(output, spec) as writer:
        jobs = _split_jobs(split, tasks, survey.task_rows, split_seed)
        _write_pass(tasks, jobs, tables, workers, writer, pad_short_rows)
        check_splits_filled(writer.counts, split)
        day_23 = VALIDATION_FIRST if split == "days" else NOT_DAYS
        writer.note(RULE_KEY, day_23)
        report = {"inputs": inputs, **speed_report(start, writer.counts), "bad_rows": survey.bad,
                  "short_rows": short, "first_problem": survey.first_problem,
                  "cardinalities": spec.cardinalities,
                  "frequency_threshold": frequency_threshold, "max_table_size": max_table_size,
                  "split": split, RULE_KEY: day_23}
        writer.add_file(REPORT, json.dumps(report, indent=2) + "\n")
    return report


def short_rows(by_fields: np.ndarray, wrong_field_count: int, padded: bool) -> dict:
    """The report's account of rows short only by trailing fields (what stripping trailing
    whitespace leaves of rows whose last fields are empty), and what to do about them."""
    found = np.flatnonzero(by_fields)
    rows = int(by_fields.sum())
    if not rows:
        return {"rows": 0, "padded": padded, "note": None}
    fields = f"{found[0]}" if found[0] == found[-1] else f"{found[0]}-{found[-1]}"
    if padded:
        note = (f"{rows} rows of {fields} fields were short only by trailing fields and were "
                f"read with those fields empty (--pad-short-rows)")
    else:
        note = (f"{rows} of the {wrong_field_count} wrong_field_count rows have {fields} fields "
                f"and are short only by trailing fields, as when a tool strips trailing "
                f"whitespace (the tabs of empty last fields); --pad-short-rows reads the "
                f"missing fields as empty and keeps these rows")
    return {"rows": rows, "min_fields": int(found[0]), "max_fields": int(found[-1]),
            "padded": padded, "note": note}


def _check_arguments(inputs, output, threshold, max_table_size, workers) -> None:
    if not inputs:
        raise ConfigError("--input: give at least one Criteo TSV file")
    if threshold < 0:
        raise ConfigError(f"--frequency-threshold: must be >= 0 (0 keeps every value), "
                          f"got {threshold}")
    if max_table_size is not None and max_table_size < 1:
        raise ConfigError(f"--max-table-size: must be at least 1 (the row of id 0), "
                          f"got {max_table_size}")
    if workers < 1:
        raise ConfigError(f"--workers: must be at least 1, got {workers}")
    check_new_output(output)  # before hours of reading, not when the writer starts


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="Criteo TSV files, plain or .gz (day_0 .. day_23 for the 1TB set)")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--frequency-threshold", type=int, default=0, metavar="T",
                        help="values seen fewer than T times get id 0 (default 0: keep all)")
    parser.add_argument("--max-table-size", type=int, default=None, metavar="N",
                        help="at most N rows per table: id 0 and the N-1 most frequent values")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), metavar="K",
                        help="processes (default: all cores)")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first malformed line (FILE:LINE) instead of skipping it")
    parser.add_argument("--pad-short-rows", action="store_true",
                        help="read rows short only by trailing fields (trailing whitespace "
                             "stripped) with those fields empty, instead of skipping them")
    add_split_arguments(parser)


def add_split_arguments(parser) -> None:
    """`--split` and `--split-seed`, the same for TSV and .npy day files."""
    parser.add_argument("--split", choices=SPLIT_MODES, default="auto",
                        help="days: day_23's first ceil(N/2) rows validation and the rest test "
                             "(the MLPerf reference's rule), other days train; hash: a seeded "
                             "90/5/5 split by row; auto (default): days if every input is a "
                             "day_N file, else hash")
    parser.add_argument("--split-seed", type=int, default=0, metavar="S",
                        help="seed of the hash split")


def run(args) -> None:
    report = preprocess_criteo(args.input, args.output, args.frequency_threshold,
                               args.max_table_size, args.workers, args.strict, args.split_seed,
                               args.split, args.pad_short_rows)
    if report["first_problem"]:
        print(f"first malformed line: {report['first_problem']}")
    if report["short_rows"]["note"]:
        print(report["short_rows"]["note"])
    print(f"wrote {args.output} (report: {REPORT})")
    print(summary_line(report))


def summary_line(report: dict) -> str:
    """`done: key=value ...`: rows written per split, bad rows by kind, speed and peak memory."""
    fields = {"rows": report["rows_written"]["total"],
              **{k: v for k, v in report["rows_written"].items() if k != "total"},
              **report.get("bad_rows", {}), "rows_per_s": f"{report['rows_per_s']:.0f}",
              "seconds": f"{report['seconds']:.1f}",
              "peak_rss_mib": f"{report['peak_rss_bytes'] / 2**20:.0f}"}
    return "done: " + " ".join(f"{k}={v}" for k, v in fields.items())
