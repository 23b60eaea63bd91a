"""The report of `preprocess criteo` on its input's rows: bad rows by kind and the first problem
(a strict run stops there), rows short only by trailing fields and what to do about them, and the
`done:` line the preprocess commands end with."""

from __future__ import annotations

from typing import List

import numpy as np

from dlrm_hybrid.data.criteo.parse import KINDS, NUM_FIELDS, REASONS, WRONG_FIELD_COUNT
from dlrm_hybrid.data.criteo.preprocess_job import Job
from dlrm_hybrid.errors import DataError


def survey_rows(job: Job, records: List[dict]) -> dict:
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
