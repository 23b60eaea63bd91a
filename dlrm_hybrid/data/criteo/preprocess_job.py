"""One run of `preprocess criteo` (`Job`): its tasks, memory plan and work folder; the pool of
workers that runs its steps (worker_steps.py), each step recorded as it ends and reused by a later
run while its record still holds; the three phases (count, number, write) as steps.

The job's workers are started once, as its first steps need them, and run every phase. They are
forked from a fork server (`_worker_context`) that imported numpy and the steps' modules once, so
no worker pays that import again. They are joined when the job ends (`close`)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.data.criteo import budget, counts, numbering, tasks as task_plan, worker_steps
from dlrm_hybrid.data.criteo.input_sample import Sample
from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL, NUM_NUMERICAL
from dlrm_hybrid.data.criteo.progress import JobProgress
from dlrm_hybrid.data.criteo.splits import check_splits_filled, split_counts, split_jobs
from dlrm_hybrid.data.criteo.vocabulary import FOLDER, file_name
from dlrm_hybrid.data.criteo.work import WorkFolder
from dlrm_hybrid.data.criteo.worker_steps import (CountJob, aggregate_range, copy_vocabulary,
                                                 count_task, number_all, number_range, write_job)
from dlrm_hybrid.data.criteo.write import WriteJob, size_files, split_files
from dlrm_hybrid.data.feature_spec import SPLITS, FeatureSpec
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.errors import DataError

# A counter larger than this counts slower, not less: its table no longer stays in cache, and
# more of a task's keys repeat across its runs than within a bigger one. Measured
# (preprocess_scale.py at 1/100, 2 workers, AMD EPYC Zen 4): a counter sized for whole 64 MiB
# tasks (~7M keys) counted 856,980 rows/s, one of ~0.3M keys 1,688,824, for the same spill.
COUNTER_MAX_ENTRIES = 1 << 21


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
    """One run of the command: the plan, the work folder, the pool, the figures."""

    def __init__(self, inputs: List[str], output: Path, options: Options, workers: int,
                 plan: budget.MemoryPlan, work: WorkFolder) -> None:
        self.inputs, self.output, self.options = inputs, output, options
        self.workers, self.plan, self.work = workers, plan, work
        self.tasks = task_plan.plan_tasks(inputs, options.task_bytes)
        self.files = {p: os.stat(p) for p in inputs}
        self.input_bytes = sum(t.size for t in self.tasks)
        self.peaks: List[Dict[int, int]] = []  # per pool started: worker pid -> peak RSS
        self.server_peak = 0  # the fork server's peak RSS, as its workers last read it
        self.passes: Dict[str, dict] = {}
        self.reused = 0
        self.counted_digest: Optional[str] = None  # of the count records the later steps use
        self._pool: Optional[ProcessPoolExecutor] = None
        self._processes = 0  # at most this many workers started in the pool

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Join the workers (steps not started are cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._processes = None, 0

    def file_state(self, path: str) -> list:
        stat = self.files[path]
        return [stat.st_size, stat.st_mtime_ns]

    def pool(self, workers: int) -> ProcessPoolExecutor:
        """The job's workers (they start without the parent's memory), for a phase that
        runs at most `workers` steps at a time. The pool starts a worker only when no started one
        is idle, so it holds at most the most steps any phase ran at once."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, _worker_context())
            self.peaks.append({})
        self._processes = max(self._processes, workers)
        return self._pool

    def at_most(self, workers: int) -> None:
        """At most `workers` processes from now on: a phase whose memory plan counts only its own
        workers (the write pass) must not run beside idle ones still holding their memory."""
        if self._processes > workers:
            self.close()

    def run_steps(self, workers: int, steps: Sequence[Tuple[str, Callable, tuple]],
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
        workers = min(workers, len(todo))
        pool, queued = self.pool(workers), iter(todo)
        futures: Dict = {}
        pending = set()

        def submit() -> None:  # the next step, if any: at most `workers` run at once
            step = next(queued, None)
            if step is not None:
                i, (name, fn, args) = step
                future = pool.submit(fn, *args)
                futures[future] = (i, name)
                pending.add(future)

        for _ in range(workers):
            submit()
        while pending:
            finished, _ = wait(pending, return_when=FIRST_EXCEPTION)
            pending.difference_update(finished)
            for future in sorted(finished, key=lambda f: futures[f][0]):
                i, name = futures[future]
                record = future.result()  # raises the worker's error
                self.peaks[-1][record["pid"]] = max(record["peak_rss"],
                                                    self.peaks[-1].get(record["pid"], 0))
                self.server_peak = max(self.server_peak, record["server_peak_rss"])
                if not name.startswith("count."):
                    record["counted"] = self.counted_digest
                done(i, record, True)
                self.work.commit(name, record)
                submit()

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
        """Upper bound of the tree's peak: the parent's, the fork server's, and the pool whose
        workers' peaks sum highest (a worker lives as long as its pool, idle or not)."""
        return budget.own_peak_rss() + self.server_peak + max(
            (sum(p.values()) for p in self.peaks), default=0)

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

        self.run_steps(self.workers, steps, done)
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
            self.run_steps(1, [("number.given", copy_vocabulary,
                                (options.vocabulary, str(self.work.dataset)))],
                           lambda i, r, fresh: result.update(r))
            return result["cardinalities"], {"partitions": 0, "distinct_values": None}
        runs = [counts.Run(stem, n) for r in records for stem, n in r["runs"]]
        entries = sum(r.entries for r in runs)
        threshold, max_rows = options.frequency_threshold, options.max_table_size
        if entries <= self.plan.range_entries:
            result = {}
            self.run_steps(1, [("number.all", number_all,
                                (runs, threshold, max_rows, str(self.work.dataset)))],
                           lambda i, r, fresh: result.update(r))
            return result["cardinalities"], {"partitions": 1,
                                             "distinct_values": result["distinct"]}
        ranges = self._ranges(runs)
        stems = [str(self.work.path("ranges", f"r{k}")) for k in range(len(ranges))]
        results: list = [None] * len(ranges)
        self.run_steps(self.workers,
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
        self.run_steps(self.workers,
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

        self.at_most(workers)
        self.run_steps(workers, steps, done)
        return fspec, dict(zip(SPLITS, totals))


def _load_histograms(stem: str) -> List[numbering.Histogram]:
    with np.load(stem + ".histograms.npz") as saved:
        arrays = [saved[f"arr_{i}"] for i in range(2 * NUM_CATEGORICAL)]
    return list(zip(arrays[0::2], arrays[1::2]))


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers forked from a fork server that imported worker_steps once: fresh processes that
    hold none of the parent's memory or threads (torch's, in a training process) as spawned ones
    would, without each importing numpy and the steps' modules anew (~0.3 s of CPU a worker)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([worker_steps.__name__])
    return context
