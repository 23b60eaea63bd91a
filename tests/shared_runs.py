"""Runs that many test files read and none changes, trained once per `pytest` run: under
pytest-xdist (`make test`) the workers share them, the first worker to ask making a run while
another that asks waits for it (each worker used to train its own).

`demo_run` is the demo model after 150 steps (its decay compressed into steps 75..150), trained
through the CLI on one process: serving compares its exported precisions against it, and eval,
export, the resume rules and the checkpoint reader only need a real checkpoint. A test that
changes the run or its checkpoint copies it first (`copy_of`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

import pytest
from filelock import FileLock

from conftest import failure, read_metrics, run_cli

DEMO_STEPS = 150
DEMO_VAL_SAMPLES = 8192  # what serving compares the precisions on
DEMO_RUN = [f"train.max_steps={DEMO_STEPS}", "optim.decay_start_step=75", "optim.decay_steps=75",
            f"data.val_samples={DEMO_VAL_SAMPLES}", "train.progress_bar=false",
            "checkpoint.resume=none"]


def shared(tmp_path_factory, name: str, make: Callable[[Path], dict]) -> tuple[Path, dict]:
    """(`folder`, what `make(folder)` returned) for the run `make` trains into `folder`, made
    once per `pytest` run: under xdist in the workers' common temporary folder, under a lock,
    with what `make` returned kept beside it as JSON."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        folder = tmp_path_factory.mktemp("shared") / name
        return folder, make(folder)
    root = tmp_path_factory.getbasetemp().parent / "shared_runs"  # this run's, all workers'
    root.mkdir(exist_ok=True)
    folder, made = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not made.exists():  # a worker that failed to make it left none: this one tries
            shutil.rmtree(folder, ignore_errors=True)
            made.write_text(json.dumps(make(folder)))
    return folder, json.loads(made.read_text())


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> Path:
    """The run directory of `train --config configs/demo.yaml` with DEMO_RUN: its config.yaml,
    metrics.jsonl and one checkpoint, checkpoints/step_150. Read it; never write into it."""
    def make(run_dir: Path) -> dict:
        result = run_cli(["train", "--config", "configs/demo.yaml", *[
            a for o in [*DEMO_RUN, f"train.run_dir={run_dir}"] for a in ("--set", o)]])
        assert result.returncode == 0, failure(result)
        return {}

    return shared(tmp_path_factory, "demo_run", make)[0]


@pytest.fixture(scope="session")
def demo_checkpoint(demo_run) -> Path:
    """The shared run's final (and only) checkpoint."""
    return demo_run / "checkpoints" / f"step_{DEMO_STEPS}"


# Dense SGD: Adagrad's first steps move each weight by +-lr whatever its gradient's size, so
# the sign of a near-zero gradient (rounding of another reduction order) would decide them.
EQUIVALENCE = ["train.max_steps=20", "train.log_every=1", "train.eval_every=0",
               "data.val_samples=8192", "train.progress_bar=false", "optim.dense=sgd",
               "optim.dense_lr=0.5", "train.precision=fp32", "train.cuda_graphs=false"]
# SGD tables: at the demo's lr 0.1 their rows move so little that 20 steps' losses stay within
# 1e-5 of a run whose tables never change; at 30 the two differ by 2e-4 at step 4.
SGD_TABLE_LR = "optim.embedding_lr=30"


def equivalence_run(run_dir: Path, nproc: int, optimizer: str, extra_env=None):
    """The demo config with EQUIVALENCE and `optimizer` tables on `nproc` gloo ranks (1: the
    plain process): (its per-step losses, the CLI's result)."""
    overrides = [*EQUIVALENCE, f"optim.embedding={optimizer}", f"train.run_dir={run_dir}",
                 *([SGD_TABLE_LR] if optimizer == "sgd" else [])]
    result = run_cli(["train", "--config", "configs/demo.yaml",
                      *[arg for o in overrides for arg in ("--set", o)]],
                     nproc=nproc if nproc > 1 else 0, extra_env=extra_env)
    assert result.returncode == 0, failure(result)
    return [e["loss"] for e in read_metrics(run_dir) if "loss" in e], result


def shared_equivalence_run(tmp_path_factory, nproc: int):
    """equivalence_run with SGD tables on `nproc` ranks, one thread each, made once per `pytest`
    run: (losses, result, run directory). Read it; never write into it."""
    def make(run_dir: Path) -> dict:
        losses, result = equivalence_run(run_dir, nproc, "sgd")
        return {"losses": losses, "args": result.args, "returncode": result.returncode,
                "stdout": result.stdout, "stderr": result.stderr}

    run_dir, made = shared(tmp_path_factory, f"sgd_on_{nproc}", make)
    result = subprocess.CompletedProcess(made["args"], made["returncode"], made["stdout"],
                                         made["stderr"])
    return made["losses"], result, run_dir


@pytest.fixture(scope="session")
def two_rank_sgd(tmp_path_factory):
    """The 2-rank SGD equivalence run, which 1 rank must match (test_distributed.py)."""
    return shared_equivalence_run(tmp_path_factory, 2)


@pytest.fixture(scope="session")
def one_rank_sgd(tmp_path_factory):
    """The 1-rank SGD equivalence run, which 2 ranks (test_distributed.py) and 2 threads
    (test_cpu_lookup.py) must match."""
    return shared_equivalence_run(tmp_path_factory, 1)


def copy_of(folder: Path, to: Path) -> Path:
    """A copy of a shared run or checkpoint at `to`, for a test that changes it."""
    shutil.copytree(folder, to)
    return to
