"""`python -m dlrm_hybrid preprocess criteo`: raw Criteo click logs (TSV, plain or .gz) into the
split-binary layout with the value -> id dictionaries beside it, in bounded memory, in several
processes, resumable.

1. count (pass 1 over the text): per task, exact counts of every (feature, value) as sorted runs
   on disk (counts.py), and the rows and malformed lines by kind (parse.py);
2. number: the runs summed and the ids given (numbering.py), written as the dataset's vocabulary
   (vocabulary.py): in one worker's memory when every count fits the memory plan, else range of
   keys by range of keys (an external aggregation) with the same ids;
3. write (pass 2): each task's rows mapped and written at their place (write.py).
`--vocabulary DATASET` skips counting values: the ids are DATASET's, unseen values id 0.
Every step is recorded in the work folder (work.py) as it finishes: a killed run continues with
the same command, redoing only the steps that were in flight, with the same bytes as a run never
stopped. Splits: splits.py.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo import budget, counts, numbering, tasks as task_plan
from dlrm_hybrid.data.criteo.native import parse_fast
from dlrm_hybrid.data.criteo.parse import (KINDS, NUM_CATEGORICAL, NUM_FIELDS, NUM_NUMERICAL,
                                           REASONS, WRONG_FIELD_COUNT)
from dlrm_hybrid.data.criteo.progress import JobProgress
from dlrm_hybrid.data.criteo.splits import (add_split_arguments, check_days, check_splits_filled,
                                            day_number, resolve_split, split_counts, split_jobs)
from dlrm_hybrid.data.criteo.tasks import Task, read_lines
from dlrm_hybrid.data.criteo.vocabulary import FOLDER, KEY, Vocabulary, file_name
from dlrm_hybrid.data.criteo.work import WorkFolder, identity, write_json
from dlrm_hybrid.data.criteo.write import WriteJob, size_files, split_files, write_task
from dlrm_hybrid.data.criteo.day23 import NOT_DAYS, RULE_KEY, VALIDATION_FIRST
from dlrm_hybrid.data.feature_spec import SPLITS, FeatureSpec
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import REPORT, check_new_output
from dlrm_hybrid.errors import DataError, UserError

MAX_OUTPUT_ROW_BYTES = 1 + 2 * NUM_NUMERICAL + 4 * NUM_CATEGORICAL
# A counter larger than this counts slower, not less: its table no longer stays in cache, and
# more of a task's keys repeat across its runs than within a bigger one. Measured
# (preprocess_scale.py at 1/100, 2 workers, AMD EPYC Zen 4): a counter sized for whole 64 MiB
# tasks (~7M keys) counted 856,980 rows/s, one of ~0.3M keys 1,688,824, for the same spill.
COUNTER_MAX_ENTRIES = 1 << 21


# ---- workers (spawned processes; each returns its own peak RSS with its result) -------------

@dataclass(frozen=True)
class CountJob:
    task: Task
    runs: str  # stem of the task's run files
    strict: bool
    pad_short: bool
    chunk_bytes: int
    capacity: int  # distinct keys counted in memory before a run is spilled; 0: no counting


def count_task(job: CountJob) -> dict:
    """Pass 1 over one task: its runs, rows, lines and malformed lines (strict: stops at the
    first)."""
    counter = counts.key_counter(job.capacity) if job.capacity else None
    bad, short = np.zeros(len(KINDS), np.int64), np.zeros(NUM_FIELDS, np.int64)
    rows = lines = since_drain = 0
    problem, runs = None, []

    def spill() -> None:
        runs.append(counts.write_run(Path(f"{job.runs}.{len(runs)}"), *counter.drain()))

    for data in read_lines(job.task, job.chunk_bytes):
        chunk = parse_fast(data, job.pad_short)
        first = chunk.first_problem()
        if problem is None and first is not None:
            problem = (lines + first[0], first[1])
            if job.strict:
                break
        bad += chunk.bad_counts()
        short += np.bincount(chunk.short, minlength=NUM_FIELDS)
        rows, lines = rows + len(chunk.labels), lines + chunk.lines
        if counter is None:
            continue
        if since_drain + len(chunk.labels) > counts.MAX_RUN_COUNT:
            spill()
            since_drain = 0
        since_drain += len(chunk.labels)
        step = max(1, job.capacity // NUM_CATEGORICAL)  # rows whose keys fit an empty counter
        for lo in range(0, len(chunk.cats), step):
            if not counter.add(chunk.cats[lo:lo + step]):
                spill()
                counter.add(chunk.cats[lo:lo + step])
    if counter is not None and (counter.size or not runs):
        spill()
    return {"rows": rows, "lines": lines, "bad": bad.tolist(), "short": short.tolist(),
            "problem": problem, "runs": [[r.stem, r.entries] for r in runs],
            **_worker_memory()}


def number_all(runs: List[counts.Run], threshold: int, max_rows: Optional[int],
               dataset: str) -> dict:
    """Every count in one range, in memory: sum the runs, number each feature, write the
    vocabulary into the dataset."""
    keys, total = counts.read_range(runs, 0, counts.KEY_SPACE)
    vocabulary = Vocabulary(numbering.number_in_memory(keys, total, threshold, max_rows))
    vocabulary.save(dataset)
    return {"distinct": len(keys), "cardinalities": vocabulary.cardinalities,
            **_worker_memory()}


def aggregate_range(runs: List[counts.Run], lo: int, hi: int, threshold: int, out: str) -> dict:
    """Sum one range of keys over all runs; keep the values counted at least `threshold` times
    as a run at `out`, with their histogram of counts per feature."""
    keys, total = counts.read_range(runs, lo, hi)
    keep = total >= max(threshold, 1)
    counts.write_run(Path(out), keys[keep], total[keep])
    histograms = counts.count_histograms(keys[keep], total[keep])
    np.savez(out + ".histograms.npz", *[a for h in histograms for a in h])
    return {"distinct": len(keys), "kept": int(keep.sum()), **_worker_memory()}


def number_range(kept: counts.Run, bases: list, max_rows: Optional[int],
                 vocabulary: str) -> dict:
    keys = np.fromfile(kept.stem + ".keys", np.uint64)
    total = np.fromfile(kept.stem + ".counts", np.uint32).astype(np.uint64)
    for f, (values, ids) in enumerate(numbering.number_range(keys, total, bases, max_rows)):
        numbering.write_by_ids(str(Path(vocabulary) / file_name(f)), values, ids)
    return _worker_memory()


def copy_vocabulary(dataset: str, folder: str) -> dict:
    """`--vocabulary DATASET`: its vocabulary, checked, into the new dataset."""
    given = Vocabulary.load(dataset)
    given.save(folder)
    return {"cardinalities": given.cardinalities, **_worker_memory()}


def write_job(job: WriteJob) -> dict:
    return {"written": write_task(job), **_worker_memory()}


def _worker_memory() -> dict:
    return {"pid": os.getpid(), "peak_rss": budget.own_peak_rss()}


# ---- the job -------------------------------------------------------------------------------

@dataclass
class Options:
    frequency_threshold: int = 0
    max_table_size: Optional[int] = None
    strict: bool = False
    split: str = "auto"
    split_seed: int = 0
    pad_short_rows: bool = False
    vocabulary: Optional[str] = None
    task_bytes: int = 0


class Job:
    """One run of the command: the plan, the work folder, the pools, the figures."""

    def __init__(self, inputs: List[str], output: Path, options: Options, workers: int,
                 plan: budget.MemoryPlan, work: WorkFolder) -> None:
        self.inputs, self.output, self.options = inputs, output, options
        self.workers, self.plan, self.work = workers, plan, work
        self.tasks = task_plan.plan_tasks(inputs, options.task_bytes)
        self.files = {p: os.stat(p) for p in inputs}
        self.input_bytes = sum(t.size for t in self.tasks)
        self.peaks: Dict[str, Dict[int, int]] = {}  # phase -> worker pid -> peak RSS
        self.passes: Dict[str, dict] = {}
        self.reused = 0
        self.counted_digest: Optional[str] = None  # of the count records the later steps use

    def file_state(self, path: str) -> list:
        stat = self.files[path]
        return [stat.st_size, stat.st_mtime_ns]

    @contextmanager
    def pool(self, phase: str, workers: int):
        """Spawned workers (they start without the parent's memory); always joined."""
        pool = ProcessPoolExecutor(workers, multiprocessing.get_context("spawn"))
        self.peaks.setdefault(phase, {})
        try:
            yield pool
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def run_steps(self, phase: str, workers: int, steps: Sequence[Tuple[str, Callable, tuple]],
                  done: Callable[[int, dict, bool], None]) -> None:
        """Run the `steps` (name, function, arguments) an earlier run did not record, and record
        each as it ends (after `done(index, record, fresh)`, which may add to the record)."""
        todo = []
        for i, (name, fn, args) in enumerate(steps):
            record = self._valid_record(name)
            if record is not None:
                done(i, record, False)
                self.reused += 1
            else:
                todo.append((i, (name, fn, args)))
        if not todo:
            return
        with self.pool(phase, min(workers, len(todo))) as pool:
            futures = {pool.submit(fn, *args): (i, name) for i, (name, fn, args) in todo}
            pending = set(futures)
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in sorted(finished, key=lambda f: futures[f][0]):
                    i, name = futures[future]
                    record = future.result()  # raises the worker's error
                    self.peaks[phase][record["pid"]] = max(
                        record["peak_rss"], self.peaks[phase].get(record["pid"], 0))
                    if not name.startswith("count."):
                        record["counted"] = self.counted_digest
                    done(i, record, True)
                    self.work.commit(name, record)

    def _valid_record(self, name: str) -> Optional[dict]:
        """An earlier run's record of step `name`, if it still holds: a task counted from its
        file as it is now, with its runs complete; a later step made from these very counts."""
        record = self.work.record(name)
        if record is None:
            return None
        if name.startswith("count."):
            i = int(name.split(".")[1])
            valid = record.get("file") == self.file_state(self.tasks[i].path) and all(
                counts.run_complete(counts.Run(stem, n)) for stem, n in record["runs"])
        else:
            valid = record.get("counted") == self.counted_digest
        return record if valid else None

    def peak_rss(self) -> int:
        """Upper bound of the tree's peak: the parent's, and the phase whose workers' peaks sum
        highest."""
        return budget.own_peak_rss() + max((sum(p.values()) for p in self.peaks.values()),
                                           default=0)

    # -- pass 1 --

    def count(self, progress: JobProgress, sample: "Sample") -> List[dict]:
        options, records = self.options, [None] * len(self.tasks)
        largest = max(t.size for t in self.tasks) * sample.expansion
        capacity = min(self.plan.counter_capacity, COUNTER_MAX_ENTRIES,
                       budget.MIN_ENTRIES + int(1.25 * sample.keys_per_byte * largest))
        capacity = 0 if options.vocabulary else capacity
        steps = []
        for i, task in enumerate(self.tasks):
            job = CountJob(task, str(self.work.path("runs", f"t{i}")), options.strict,
                           options.pad_short_rows, self.plan.chunk_bytes, capacity)
            steps.append((f"count.{i}", count_task, (job,)))

        def done(i: int, record: dict, fresh: bool) -> None:
            record["file"] = self.file_state(self.tasks[i].path)
            records[i] = record
            progress.add(record["rows"], self.tasks[i].size, fresh)

        self.run_steps("count", self.workers, steps, done)
        self.counted_digest = hashlib.sha1(json.dumps(
            [[r["rows"], r["runs"], r["file"]] for r in records]).encode()).hexdigest()
        return records

    # -- numbering --

    def number(self, records: List[dict]) -> Tuple[List[int], dict]:
        """Write the vocabulary into the dataset; (cardinalities, figures)."""
        options, vocabulary = self.options, self.work.dataset / FOLDER
        vocabulary.mkdir(parents=True, exist_ok=True)
        if options.vocabulary:
            result = {}
            self.run_steps("number", 1, [("number.given", copy_vocabulary,
                                          (options.vocabulary, str(self.work.dataset)))],
                           lambda i, r, fresh: result.update(r))
            return result["cardinalities"], {"partitions": 0, "distinct_values": None}
        runs = [counts.Run(stem, n) for r in records for stem, n in r["runs"]]
        entries = sum(r.entries for r in runs)
        threshold, max_rows = options.frequency_threshold, options.max_table_size
        if entries <= self.plan.range_entries:
            result = {}
            self.run_steps("number", 1, [("number.all", number_all,
                                          (runs, threshold, max_rows, str(self.work.dataset)))],
                           lambda i, r, fresh: result.update(r))
            return result["cardinalities"], {"partitions": 1,
                                             "distinct_values": result["distinct"]}
        ranges = self._ranges(runs)
        stems = [str(self.work.path("ranges", f"r{k}")) for k in range(len(ranges))]
        results: list = [None] * len(ranges)
        self.run_steps("aggregate", self.workers,
                       [(f"aggregate.{k}", aggregate_range, (runs, lo, hi, threshold, stems[k]))
                        for k, (lo, hi) in enumerate(ranges)],
                       lambda k, r, fresh: results.__setitem__(k, r))
        histograms = [_load_histograms(stem) for stem in stems]
        bases, kept = numbering.range_bases(histograms)
        cardinalities = numbering.cardinalities(kept, max_rows)
        for f, rows in enumerate(cardinalities):
            with open(vocabulary / file_name(f), "ab") as out:
                out.truncate(4 * (rows - 1))
        kept_runs = [counts.Run(stem, r["kept"]) for stem, r in zip(stems, results)]
        self.run_steps("number", self.workers,
                       [(f"number.{k}", number_range, (kept_runs[k], bases[k], max_rows,
                                                       str(vocabulary)))
                        for k in range(len(ranges))], lambda k, r, fresh: None)
        return cardinalities, {"partitions": len(ranges),
                               "distinct_values": sum(r["distinct"] for r in results)}

    def _ranges(self, runs: List[counts.Run]) -> List[Tuple[int, int]]:
        """The aggregation's ranges, as recorded by an earlier run of these counts if it used no
        more memory per range than this one may."""
        record = self.work.record("ranges")
        if record and record.get("counted") == self.counted_digest and \
                record["range_entries"] <= self.plan.range_entries:
            return [tuple(r) for r in record["ranges"]]
        for prefix in ("aggregate.", "number."):  # written rows stand: the ids do not change
            self.work.forget(prefix)
        ranges = counts.plan_ranges(runs, self.plan.range_entries)
        self.work.commit("ranges", {"counted": self.counted_digest, "ranges": ranges,
                                    "range_entries": self.plan.range_entries})
        return ranges

    # -- pass 2 --

    def write(self, records: List[dict], cardinalities: List[int], split: str,
              progress: JobProgress) -> Tuple[FeatureSpec, Dict[str, int]]:
        fspec = FeatureSpec.default(self.work.dataset, DataSpec(NUM_NUMERICAL, cardinalities,
                                                                [1] * NUM_CATEGORICAL))
        task_rows = [r["rows"] for r in records]
        jobs = split_jobs(split, self.tasks, task_rows, self.options.split_seed)
        per_split = np.array([split_counts(rule, row0, rows)
                              for (rule, row0), rows in zip(jobs, task_rows)], np.int64)
        totals = per_split.sum(axis=0).tolist()
        check_splits_filled(dict(zip(SPLITS, totals)), split)
        first = np.cumsum(per_split, axis=0) - per_split
        files = tuple(split_files(fspec))
        size_files(list(files), totals)
        vocabulary_values = sum(cardinalities) - NUM_CATEGORICAL
        workers = self.plan.lookup_workers(vocabulary_values, budget.parse_bytes_per_byte())
        if not workers:
            need = self.plan.base * 2 + vocabulary_values * budget.LOOKUP_BYTES_PER_VALUE
            raise DataError(f"{self.output}: the vocabulary ({vocabulary_values:,} values) needs "
                            f"about {need / 2**30:.2f} GiB to map values to ids, over the memory "
                            f"limit; raise --memory-limit, or keep fewer values with "
                            f"--frequency-threshold or --max-table-size")
        steps = []
        for i, (task, (rule, row0)) in enumerate(zip(self.tasks, jobs)):
            job = WriteJob(task, rule, row0, tuple(first[i].tolist()),
                           tuple(per_split[i].tolist()), files,
                           str(self.work.dataset / FOLDER), self.options.pad_short_rows,
                           self.plan.chunk_bytes)
            steps.append((f"write.{i}", write_job, (job,)))

        def done(i: int, record: dict, fresh: bool) -> None:
            progress.add(sum(record["written"]), self.tasks[i].size, fresh)

        self.run_steps("write", workers, steps, done)
        return fspec, dict(zip(SPLITS, totals))


def _load_histograms(stem: str) -> List[numbering.Histogram]:
    with np.load(stem + ".histograms.npz") as saved:
        arrays = [saved[f"arr_{i}"] for i in range(2 * NUM_CATEGORICAL)]
    return list(zip(arrays[0::2], arrays[1::2]))


def preprocess_criteo(inputs: Sequence[str], output: str, frequency_threshold: int = 0,
                      max_table_size: Optional[int] = None, workers: Optional[int] = None,
                      strict: bool = False, split_seed: int = 0, split: str = "auto",
                      pad_short_rows: bool = False, memory_limit: Optional[int] = None,
                      vocabulary: Optional[str] = None, restart: bool = False) -> dict:
    """Raw Criteo TSVs -> split-binary dataset at `output` with its vocabulary; returns the report
    it also writes to `output/preprocess_report.json`. `memory_limit` in bytes (default: half of
    the memory available)."""
    start = time.perf_counter()
    inputs = [str(p) for p in inputs]
    workers = workers or os.cpu_count() or 1
    _check_arguments(inputs, output, frequency_threshold, max_table_size, workers, vocabulary)
    split = resolve_split(split, inputs)
    if split == "days":
        check_days([day_number(p) for p in inputs], "add day_23.gz")
    available = budget.available_memory()
    limit = memory_limit or int(available * budget.DEFAULT_FRACTION)
    plan = budget.plan_memory(limit, workers, counts.counter_bytes_per_entry(),
                              budget.parse_bytes_per_byte(), task_plan.CHUNK_BYTES)
    print(budget.describe(limit, memory_limit is not None, available), flush=True)
    options = Options(frequency_threshold, max_table_size, strict, split, split_seed,
                      pad_short_rows, vocabulary and os.path.abspath(vocabulary),
                      task_plan.TASK_BYTES)
    out = Path(output)
    work = WorkFolder(out, identity(inputs, options.__dict__), restart)
    try:
        job = Job(inputs, out, options, workers, plan, work)
        report = _run(job, split, start)
    except BaseException as error:
        _keep_or_discard(work, error)
        raise
    work.finish()
    return report


def _run(job: Job, split: str, start: float) -> dict:
    if job.work.resumed:
        print(f"continuing the partial work in {job.work.root}", flush=True)
    sample = sample_input(job.tasks[0])
    _check_disk(job, sample)
    progress = JobProgress(["count", "write"], job.input_bytes)
    records = job.count(progress, sample)
    job.passes["count"] = progress.end()
    survey = _survey(job, records)
    cardinalities, figures = job.number(records)
    progress.begin(1)
    fspec, written = job.write(records, cardinalities, split, progress)
    job.passes["write"] = progress.end()
    fspec.notes[RULE_KEY] = VALIDATION_FIRST if split == "days" else NOT_DAYS
    fspec.notes[KEY] = FOLDER
    fspec.save()
    seconds, total = time.perf_counter() - start, sum(written.values())
    report = {"inputs": job.inputs, "rows_written": {"total": total, **written},
              "seconds": round(seconds, 3), "rows_per_s": round(total / max(seconds, 1e-9), 1),
              "input_bytes": job.input_bytes, "passes": job.passes, **survey,
              "peak_rss_bytes": job.peak_rss(), "memory_limit_bytes": job.plan.limit,
              "workers": job.workers, "spill_bytes": job.work.bytes_on_disk("runs")
              + job.work.bytes_on_disk("ranges"), **figures,
              "vocabulary_bytes": 4 * (sum(cardinalities) - NUM_CATEGORICAL),
              "resumed_steps": job.reused, "cardinalities": cardinalities,
              "frequency_threshold": job.options.frequency_threshold,
              "max_table_size": job.options.max_table_size, "vocabulary": job.options.vocabulary,
              "split": split, RULE_KEY: fspec.notes[RULE_KEY]}
    write_json(job.work.dataset / REPORT, report)
    return report


def _survey(job: Job, records: List[dict]) -> dict:
    """Bad rows by kind, the first problem (file:line), rows short only by trailing fields; a
    strict run stops at the first problem, an input without valid rows is refused."""
    bad = np.sum([r["bad"] for r in records], axis=0)
    short = np.sum([r["short"] for r in records], axis=0)
    first_problem, lines_before = None, {}
    for task, record in zip(job.tasks, records):
        if record["problem"] and first_problem is None:
            line, kind = record["problem"]
            line += lines_before.get(task.path, 0) + 1
            first_problem = f"{task.path}:{line}: {REASONS[kind]} ({kind})"
        lines_before[task.path] = lines_before.get(task.path, 0) + record["lines"]
    if job.options.strict and first_problem:
        raise DataError(f"{first_problem}; fix the line or run without --strict to skip it")
    bad_rows = dict(zip(KINDS, bad.tolist()))
    short_report = short_rows(short, bad_rows[KINDS[WRONG_FIELD_COUNT]], job.options.pad_short_rows)
    if not sum(r["rows"] for r in records):
        raise DataError(f"{job.inputs[0]}: no valid rows in the input (skipped: {bad_rows}); "
                        f"expected Criteo TSV lines of {NUM_FIELDS} tab-separated fields"
                        + (f"; {short_report['note']}" if short_report["rows"] else ""))
    return {"bad_rows": bad_rows, "short_rows": short_report, "first_problem": first_problem}


@dataclass(frozen=True)
class Sample:
    """What the first 256 KiB of the first input say about all of it."""
    expansion: float  # bytes of text per input byte (a .gz: more than 1)
    rows_per_byte: float  # of text
    keys_per_byte: float  # distinct (feature, value) pairs per byte of text, an overestimate


def sample_input(task: Task) -> Sample:
    text = next(read_lines(task, 1 << 18), b"")
    chunk = parse_fast(text)
    expansion = 1.0
    if task.end is None:
        expansion = max(1.0, len(text) / max(_compressed_bytes_read(task.path, len(text)), 1))
    size = max(len(text), 1)
    return Sample(expansion, len(chunk.labels) / size,
                  len(np.unique(counts.keys_of(chunk.cats))) / size)


def _check_disk(job: Job, sample: Sample) -> None:
    """Refuse before reading when the disk cannot hold the runs and the dataset, as estimated
    from the sample (less what the work folder already holds)."""
    text_bytes = job.input_bytes * sample.expansion
    keys = 0 if job.options.vocabulary else sample.keys_per_byte * text_bytes
    need = 2 * counts.RUN_ENTRY_BYTES * keys + text_bytes * sample.rows_per_byte * MAX_OUTPUT_ROW_BYTES
    held = sum(job.work.bytes_on_disk(f) for f in ("runs", "ranges", "dataset"))
    budget.check_free_disk(job.work.root, int(need) - held, "the spilled counts and the dataset")


def _compressed_bytes_read(path: str, text_bytes: int) -> int:
    with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw) as f:
        f.read(text_bytes)
        return raw.tell()


def _keep_or_discard(work: WorkFolder, error: BaseException) -> None:
    """After a failure: a refusal (bad data or options: this command cannot succeed as it is)
    leaves nothing; an interruption (Ctrl-C, a full disk, a lost worker) keeps the work done, for
    the same command to continue."""
    if isinstance(error, UserError) or not any((work.root / "done").glob("*.json")):
        work.discard()
        return
    size = sum(work.bytes_on_disk(f) for f in ("runs", "ranges", "dataset"))
    print(f"kept the partial work in {work.root} ({size / 2**20:,.0f} MiB): the same command "
          f"continues from it", file=sys.stderr, flush=True)


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


def _check_arguments(inputs, output, threshold, max_table_size, workers, vocabulary) -> None:
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
    if vocabulary and (threshold or max_table_size is not None):
        raise ConfigError("--vocabulary: the ids are that dataset's; drop --frequency-threshold "
                          "and --max-table-size")
    check_new_output(output)  # before hours of reading, not when the dataset is moved in


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="FILE",
                        help="Criteo TSV files, plain or .gz (day_0 .. day_23 for the 1TB set)")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--frequency-threshold", type=int, default=0, metavar="T",
                        help="values seen fewer than T times get id 0 (default 0: keep all)")
    parser.add_argument("--max-table-size", type=int, default=None, metavar="N",
                        help="at most N rows per table: id 0 and the N-1 most frequent values")
    parser.add_argument("--vocabulary", default=None, metavar="DATASET",
                        help="map values with the ids of DATASET (made by preprocess criteo), "
                             "unseen values to id 0, e.g. to add a new day")
    parser.add_argument("--workers", type=int, default=os.cpu_count(), metavar="K",
                        help="processes (default: all cores)")
    parser.add_argument("--memory-limit", default=None, metavar="SIZE",
                        help="peak memory of all processes together, e.g. 8G (default: half "
                             "of the memory available); counts that do not fit go to disk")
    parser.add_argument("--restart", action="store_true",
                        help="discard the partial work a stopped run left, instead of "
                             "continuing it")
    parser.add_argument("--strict", action="store_true",
                        help="stop at the first malformed line (FILE:LINE) instead of skipping it")
    parser.add_argument("--pad-short-rows", action="store_true",
                        help="read rows short only by trailing fields (trailing whitespace "
                             "stripped) with those fields empty, instead of skipping them")
    add_split_arguments(parser)


def run(args) -> None:
    limit = budget.parse_size(args.memory_limit) if args.memory_limit else None
    report = preprocess_criteo(args.input, args.output, args.frequency_threshold,
                               args.max_table_size, args.workers, args.strict, args.split_seed,
                               args.split, args.pad_short_rows, limit, args.vocabulary,
                               args.restart)
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
    if "spill_bytes" in report:
        fields["spill_mib"] = f"{report['spill_bytes'] / 2**20:.0f}"
    return "done: " + " ".join(f"{k}={v}" for k, v in fields.items())
