"""What the workers of `preprocess criteo` run, one step each: count a task (pass 1),
number the counted values (all in one range, or range of keys by range of keys), copy a given
vocabulary, write a task (pass 2). Each returns its result with its process's peak RSS, which the
job sums for the report."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np

from dlrm_hybrid.data.criteo import budget, counts, numbering
from dlrm_hybrid.data.criteo.native import parse_fast
from dlrm_hybrid.data.criteo.parse import KINDS, NUM_CATEGORICAL, NUM_FIELDS
from dlrm_hybrid.data.criteo.tasks import Task, read_lines
from dlrm_hybrid.data.criteo.vocabulary import Vocabulary, file_name
from dlrm_hybrid.data.criteo.write import WriteJob, write_task


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
    return {"pid": os.getpid(), "peak_rss": budget.own_peak_rss(),
            "server_peak_rss": budget.parent_peak_rss()}
