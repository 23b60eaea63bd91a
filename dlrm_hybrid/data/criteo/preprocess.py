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
stopped. The job and its steps: preprocess_job.py, worker_steps.py; splits: splits.py.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional, Sequence

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo import budget, counts, tasks as task_plan
from dlrm_hybrid.data.criteo.input_sample import Sample, sample_input
from dlrm_hybrid.data.criteo.parse import NUM_CATEGORICAL, NUM_NUMERICAL
from dlrm_hybrid.data.criteo.preprocess_job import Job, Options
from dlrm_hybrid.data.criteo.preprocess_report import summary_line, survey_rows
from dlrm_hybrid.data.criteo.progress import JobProgress
from dlrm_hybrid.data.criteo.splits import (add_split_arguments, check_days, day_number,
                                           describe_split, resolve_split)
from dlrm_hybrid.data.criteo.vocabulary import FOLDER, KEY
from dlrm_hybrid.data.criteo.work import WorkFolder, identity, write_json
from dlrm_hybrid.data.criteo.day23 import NOT_DAYS, RULE_KEY, VALIDATION_FIRST
from dlrm_hybrid.data.split_binary_writer import REPORT, check_new_output
from dlrm_hybrid.errors import DataError

MAX_OUTPUT_ROW_BYTES = 1 + 2 * NUM_NUMERICAL + 4 * NUM_CATEGORICAL


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
    given, split = split, resolve_split(split, inputs)
    _check_distinct(inputs, split)
    if split == "days":
        check_days([day_number(p) for p in inputs], "add day_23.gz")
        inputs.sort(key=day_number)  # train in day order, as a shell's day_* (10 before 2) is not
    available = budget.available_memory()
    limit = int(available * budget.DEFAULT_FRACTION) if memory_limit is None else memory_limit
    plan = budget.plan_memory(limit, workers, counts.counter_bytes_per_entry(),
                              budget.parse_bytes_per_byte(), task_plan.CHUNK_BYTES)
    print(budget.describe(limit, memory_limit is not None, available), flush=True)
    print(describe_split(given, split, split_seed, inputs), flush=True)
    options = Options(frequency_threshold, max_table_size, strict, split, split_seed,
                      pad_short_rows, vocabulary and os.path.abspath(vocabulary),
                      task_plan.TASK_BYTES)
    out = Path(output)
    work = WorkFolder(out, identity(inputs, options.__dict__), restart)
    try:
        with Job(inputs, out, options, workers, plan, work) as job:
            report = _run(job, split, start)
    except BaseException as error:
        work.keep_or_discard(error)
        raise
    work.finish()
    return report


def _run(job: Job, split: str, start: float) -> dict:
    if job.work.resumed:
        print(f"continuing the partial work in {job.work.root}", flush=True)
    if not job.tasks:
        raise DataError(f"--input: {', '.join(job.inputs)}: empty; give Criteo TSV files with rows")
    sample = sample_input(job.tasks[0])
    _check_disk(job, sample)
    progress = JobProgress(["count", "write"], job.input_bytes)
    records = job.count(progress, sample)
    job.passes["count"] = progress.end()
    survey = survey_rows(job, records)
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


def _check_disk(job: Job, sample: Sample) -> None:
    """Refuse before reading when the disk cannot hold the runs and the dataset, as estimated
    from the sample (less what the work folder already holds)."""
    text_bytes = job.input_bytes * sample.expansion
    keys = 0 if job.options.vocabulary else sample.keys_per_byte * text_bytes
    need = 2 * counts.RUN_ENTRY_BYTES * keys + text_bytes * sample.rows_per_byte * MAX_OUTPUT_ROW_BYTES
    held = sum(job.work.bytes_on_disk(f) for f in ("runs", "ranges", "dataset"))
    budget.check_free_disk(job.work.root, int(need) - held, "the spilled counts and the dataset")


def _check_distinct(inputs: Sequence[str], split: str) -> None:
    """Each file, and with --split days each day, once: a shell glob beside a file it matches
    (`day_*.gz day_23.gz`) would write every row twice, a hash split into train and test both."""
    seen = {}
    for path in inputs:
        keys = [("file", os.path.realpath(path))]  # any spelling, or a link to it
        keys += [("day", day_number(path))] if split == "days" else []
        for key in keys:
            if key in seen:
                what = "the same file" if key[0] == "file" else f"both day {key[1]}"
                raise ConfigError(f"--input: {seen[key]} and {path} are {what}; give each "
                                  f"{key[0]} once")
            seen[key] = path


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
    limit = None if args.memory_limit is None else budget.parse_size(args.memory_limit)
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
