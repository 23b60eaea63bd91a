"""benchmarks/gpu_check.sh: one line without a GPU; with --cpu-rehearsal, every stage runs on
CPU and the report (JSON + table) comes out, so a GPU session does not find the script's bugs."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, load_script, run_cli

ENV = {**os.environ, "PYTHON": sys.executable}  # the interpreter (and torch) under test


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_a_gpu_it_stops_in_one_line_and_writes_nothing(tmp_path):
    run = subprocess.run(["benchmarks/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=ENV,
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert run.stderr.startswith("gpu_check: no CUDA device") and run.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists()


def cli_command(cmd):
    """(CLI arguments, ranks) of `python -m dlrm_hybrid ARGS`, also under
    `torchrun --standalone --nproc_per_node=N`; None for any other command."""
    if cmd[:3] == [sys.executable, "-m", "dlrm_hybrid"]:
        return cmd[3:], 0
    if cmd[:4] == [sys.executable, "-m", "torch.distributed.run", "--standalone"] and \
            cmd[4].startswith("--nproc_per_node=") and cmd[5:7] == ["-m", "dlrm_hybrid"]:
        return cmd[7:], int(cmd[4].split("=")[1])
    return None


class ForkedRun:
    """subprocess.Popen for a CLI command, forked from the CLI zygote (conftest.run_cli) when it
    is waited for, with the limit the caller waits: a run past it is stopped by the zygote, and
    communicate/wait raise TimeoutExpired as Popen's do."""

    def __init__(self, cmd, cwd=None, env=None, stdout=None, stderr=None, text=False, **_):
        self.args, (self.cli, self.nproc) = cmd, cli_command(cmd)
        self.cwd, self.env, self.stdout, self.stderr = Path(cwd or ROOT), env, stdout, stderr
        self.returncode, self.out, self.err = None, "", ""
        # a log file the caller may close once started, as a child keeps its own descriptor
        self.log = os.fdopen(os.dup(stdout.fileno()), "w") if hasattr(stdout, "fileno") else None

    def _finish(self, timeout):
        if self.returncode is not None:
            return
        try:
            done = run_cli(self.cli, nproc=self.nproc, timeout=timeout or 600, cwd=self.cwd,
                           extra_env=self.env)
        except subprocess.TimeoutExpired as late:
            self.returncode, self.out, self.err = -9, late.output or "", late.stderr or ""
            raise
        self.returncode, self.out, self.err = done.returncode, done.stdout, done.stderr
        if self.log is not None:  # stderr with it (STDOUT) or dropped
            with self.log:
                self.log.write(self.out + (self.err if self.stderr == subprocess.STDOUT else ""))

    def communicate(self, timeout=None):
        self._finish(timeout)
        return (self.out if self.stdout == subprocess.PIPE else None,
                self.err if self.stderr == subprocess.PIPE else None)

    def wait(self, timeout=None):
        self._finish(timeout)
        return self.returncode

    def poll(self):
        return self.returncode

    def send_signal(self, signum):  # the zygote stopped it when its limit passed
        pass

    kill = terminate = lambda self: None


class ZygoteSubprocess:
    """The `subprocess` module as gpu_check.py and bench_table.py see it in the rehearsal: the
    package's CLI commands forked from the zygote, every other command (the imports' fresh
    interpreter, pytest) started as it is."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def Popen(cmd, *args, **kwargs):  # noqa: N802
        return (ForkedRun(cmd, *args, **kwargs) if cli_command(cmd)
                else subprocess.Popen(cmd, *args, **kwargs))

    @staticmethod
    def run(cmd, *, capture_output=False, timeout=None, **kwargs):
        if not cli_command(cmd):
            return subprocess.run(cmd, capture_output=capture_output, timeout=timeout, **kwargs)
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE} if capture_output else {}
        run = ForkedRun(cmd, **pipes, **kwargs)
        out, err = run.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, run.returncode, out, err)


def test_the_cpu_rehearsal_runs_every_stage_and_writes_the_report(tmp_path, monkeypatch, capsys):
    """gpu_check.py's main as `gpu_check.sh OUT --cpu-rehearsal` runs it (the script's path
    through the shell: the test above), its `train`, `synth`, `bench` and 2-rank torchrun
    commands forked from the CLI zygote as every CLI run of the suite (not 8 fresh interpreters
    of imports); the imports and the gpu tests start fresh, as they check a fresh start."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    gpu_check = load_script("benchmarks/gpu_check.py", "gpu_check")
    bench_table = sys.modules["bench_table"]
    for module in (gpu_check, bench_table):
        monkeypatch.setattr(module, "subprocess", ZygoteSubprocess())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the fresh ones too, as every run of the suite
    out = tmp_path / "out"
    scratch = tmp_path / "tmp"  # where its dataset and runs go
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(sys, "argv", ["benchmarks/gpu_check.py", str(out), "--cpu-rehearsal"])
    assert gpu_check.main() == 0, capsys.readouterr()
    assert not list(scratch.iterdir())  # removed at the end
    printed = capsys.readouterr().out
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
    assert table.strip() in printed
    assert not list(out.glob("*data*"))  # the dataset was written outside OUT
