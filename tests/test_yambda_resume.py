"""`preprocess yambda` spilled to disk, killed half-way and run again: it continues from the
partitions it had made and writes the bytes an uninterrupted run writes; other settings are
refused, --restart starts over."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, generated_yambda


def _command(log: Path, out: Path, *extra: str) -> list:
    return [sys.executable, "-m", "dlrm_hybrid", "preprocess", "yambda", "--input", str(log),
            "--output", str(out), "--history", "6", "--partitions", "6", *extra]


def _files(folder: Path) -> dict:
    """Every file's bytes; timelines.npz's arrays (its zip headers hold the time written)."""
    files = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*")
             if p.suffix in (".bin", ".txt")}
    with np.load(folder / "timelines.npz") as timelines:
        files.update({key: timelines[key].tobytes() for key in timelines.files})
    return files


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("yambda_resume")
    generated_yambda(root, "whole", ["400000", "--users", "4000", "--items", "3000", "--days",
                                     "20", "--seed", "5"], history=6)
    return root


def _killed_after(log: Path, out: Path, record: str) -> Path:
    """Start the spilling run and SIGKILL it once its work folder holds `record`."""
    work = out.parent / f".{out.name}.preprocess"
    proc = subprocess.Popen(_command(log / "log", out), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (work / "done" / record).exists() and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and (work / "done" / record).exists()  # stopped half-way
    return work


def test_a_run_killed_after_some_partitions_continues_to_the_same_bytes(log, tmp_path):
    out = tmp_path / "data"
    work = _killed_after(log, out, "part_1.json")
    made = len(list((work / "done").glob("part_*.json")))
    assert 2 <= made < 6
    changed = subprocess.run(_command(log / "log", out, "--listen-plus", "60"), cwd=ROOT,
                             capture_output=True, text=True)
    assert changed.returncode == 2 and not out.exists()
    assert changed.stderr.strip().splitlines()[-1] == (
        f"error: {work}: holds the partial work of a run with --listen-plus 50 (now 60); run "
        f"that same command to finish it, or add --restart to discard it")
    again = subprocess.run(_command(log / "log", out, "--memory-limit", "64G"), cwd=ROOT,
                           capture_output=True, text=True)  # in memory now: the work goes on
    assert again.returncode == 0, again.stderr
    assert (f"continuing the partial work in {work}: the events spilled in 6 partitions, "
            f"{made} of them made") in again.stdout
    assert "6 partitions by user, spilled" in again.stdout
    assert not work.exists()
    expected = _files(log / "whole")
    assert len(expected) > 10 and _files(out) == expected


def test_restart_discards_the_earlier_work(log, tmp_path):
    out = tmp_path / "data"
    work = _killed_after(log, out, "spill.json")
    again = subprocess.run(_command(log / "log", out, "--listen-plus", "60", "--restart"),
                           cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert "continuing" not in again.stdout and not work.exists()
    assert "listen_plus rate" in again.stdout
