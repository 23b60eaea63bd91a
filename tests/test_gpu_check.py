"""benchmarks/gpu_check.sh: one line without a GPU; with --cpu-rehearsal, every stage runs on
CPU and the report (JSON + table) comes out, so a GPU session does not find the script's bugs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

ENV = {**os.environ, "PYTHON": sys.executable}  # the interpreter (and torch) under test
# The rehearsal's processes one thread each, as every other run of the suite (conftest's
# run_cli): it checks that each stage runs and reports, not CPU speed, and torch's threads
# spinning beside the other worker's cost 2 CPU cores 15% more (72 s instead of 84 s).
REHEARSAL_ENV = {**ENV, "OMP_NUM_THREADS": "1"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_stops_in_one_line_and_writes_nothing(tmp_path):
    run = subprocess.run(["benchmarks/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.startswith("gpu_check: no CUDA device") and run.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_cpu_rehearsal_runs_every_stage_and_writes_the_report(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["benchmarks/gpu_check.sh", str(out), "--cpu-rehearsal"], cwd=ROOT,
                         env=REHEARSAL_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["versions"]["torch"] == torch.__version__
    assert report["imports"]["ok"] and report["imports"]["modules"] > 100
    assert report["gpu_tests"]["ok"] and report["gpu_tests"]["skipped"] >= 15  # no GPU here
    assert [r["setting"] for r in report["bench"]] == ["fp32", "bf16"]
    for row in report["bench"]:
        assert row["ok"] and row["samples_per_s"] > 0 and row["baseline_samples_per_s"] > 0
    for source in ("files", "synthetic"):  # train, its last 4 of 12 steps timed, vs bench
        ratio = report["train_vs_bench"][source]
        assert ratio["ok"] and ratio["setting"] == "fp32" and ratio["train_samples_per_s"] > 0
        assert ratio["ratio"] == pytest.approx(ratio["train_samples_per_s"] /
                                               report["bench"][0]["samples_per_s"], abs=1e-3)
    assert report["two_process"]["ok"] and report["two_process"]["steps"] == 10
    assert report["target"]["verdict"] == "not measured"  # no bf16+graphs row in a rehearsal
    table = (out / "gpu_check.md").read_text()
    assert "| bench fp32 | " in table and "| train from files vs bench | " in table
    assert "| train from synthetic vs bench | " in table
    assert table.strip() in run.stdout
    assert not list(out.glob("*data*"))  # the dataset was written outside OUT and removed
