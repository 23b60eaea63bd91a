"""Shared test helpers: run the CLI as a user would, in a one-process group or under torchrun."""

from __future__ import annotations

import gc
import importlib.util
import json
import locale
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

from cli_zygote import FRESH_ENV_PREFIXES, Zygote, needs_fresh

# the timing notice; the runs tests share; the slowest test files first under xdist
pytest_plugins = ["suite_timing", "shared_runs", "file_order"]

ROOT = Path(__file__).resolve().parents[1]
# torchrun as a module of this interpreter: in a venv that sees a system torch (TORCH=system), the
# `torchrun` script on PATH belongs to the system Python, which does not see this package.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
# One thread a process where the suite's caller set none (`make test`): as every CLI run of the
# suite (run_cli), the tests themselves and the interpreters they start. Two workers whose torch
# spins a thread per core beside the other's cost 18% more CPU (in-process training files).
if not os.environ.get("OMP_NUM_THREADS", "").isdigit() or os.environ["OMP_NUM_THREADS"] == "0":
    os.environ["OMP_NUM_THREADS"] = "1"  # unset, empty or not a count: torch would refuse it
SESSION_ENV = dict(os.environ)  # before any test changes it: the zygote's environment
# Collecting imports torch, torchrec and the test modules: the collector paused meanwhile and
# what they made frozen once collected (as dlrm_hybrid/startup.py does for the CLI).
gc.disable()
_zygote: Optional[Zygote] = None
_fresh_cli = False  # --fresh-cli


def pytest_addoption(parser):
    parser.addoption("--fresh-cli", action="store_true", help="run_cli: start every run as a "
                     "fresh `python -m dlrm_hybrid` / torchrun, not forked from the CLI zygote")


def run_cli(args: List[str], nproc: int = 0, timeout: int = 300, extra_env: Optional[dict] = None,
            fresh: bool = False, cwd: Path = ROOT, script: Optional[Path] = None,
            raw: bool = False) -> subprocess.CompletedProcess:
    """`python -m dlrm_hybrid ARGS` (or `python SCRIPT ARGS`, e.g. a test's own job script) in
    `cwd`, or under `torchrun --nproc_per_node=nproc` when nproc > 0.

    Forked from the CLI zygote (tests/cli_zygote.py: the same run without ~3 s of imports per
    process), unless `fresh`, `--fresh-cli`, or `extra_env` sets what libraries read when they
    load (OMP_NUM_THREADS, ATEN_CPU_CAPABILITY, PYTHONPATH...): then a real interpreter/torchrun.
    `raw`: stdout and stderr as written (decoded, carriage returns kept), where text mode would
    read a carriage return as a newline."""
    global _zygote
    program = [str(script)] if script else ["-m", "dlrm_hybrid"]
    if nproc:
        cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *program, *args]
    else:
        cmd = [sys.executable, *program, *args]
    env = _cli_env(os.environ, extra_env)
    if fresh or _fresh_cli or needs_fresh(env, _cli_env(SESSION_ENV)):
        if not raw:
            return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, timeout=timeout)
        encoding = locale.getpreferredencoding(False)
        return subprocess.CompletedProcess(cmd, done.returncode, done.stdout.decode(encoding),
                                           done.stderr.decode(encoding))
    if _zygote is None:
        _zygote = Zygote(_cli_env(SESSION_ENV))
    return _zygote.run(args, env, cwd, nproc, timeout, cmd, str(script or ""), raw)


def start_cli(args: List[str], cwd: Path = ROOT, raw: bool = False):
    """`python -m dlrm_hybrid ARGS` started as a terminal starts it: its own session (a process
    group to signal), SIGINT's default action, stdout and stderr pipes read as text (`raw`:
    carriage returns kept). Forked from the CLI zygote (a ZygoteProcess, read as a
    subprocess.Popen) unless run_cli would start it fresh (then a subprocess.Popen)."""
    global _zygote
    cmd = [sys.executable, "-m", "dlrm_hybrid", *args]
    env = _cli_env(os.environ)
    if _fresh_cli or needs_fresh(env, _cli_env(SESSION_ENV)):
        return (RawPopen if raw else subprocess.Popen)(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=not raw, start_new_session=True, preexec_fn=default_sigint)
    if _zygote is None:
        _zygote = Zygote(_cli_env(SESSION_ENV))
    return _zygote.start(args, env, cwd, cmd, raw=raw)


class RawPopen(subprocess.Popen):
    """A Popen of bytes whose communicate() decodes them as written (carriage returns kept)."""

    def communicate(self, *args, **kwargs):
        encoding = locale.getpreferredencoding(False)
        return tuple(b.decode(encoding) for b in super().communicate(*args, **kwargs))


def default_sigint() -> None:
    """The suite itself may run where SIGINT is ignored (a shell's background job), which a
    command would inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli_env(base, extra_env: Optional[dict] = None) -> dict:
    env = {k: v for k, v in base.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", **(extra_env or {})}


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()


def pytest_configure(config):
    """On a CUDA host every run is fresh: importing fbgemm-gpu's CUDA build starts CUDA's own
    threads in the zygote, and a process forked from one that loaded CUDA cannot use it."""
    global _fresh_cli
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        return  # pytest-xdist's controller: it runs no test, and needs no torch (2 s of CPU)
    import torch

    _fresh_cli = config.getoption("--fresh-cli") or torch.cuda.is_available()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # a plugin may have imported torch


@pytest.fixture(scope="module", autouse=True)
def load_time_environment_kept(request):
    """A test module leaves the variables libraries read when they load as it found them: one
    left set (threadpoolctl's import sets KMP_DUPLICATE_LIB_OK) would make every later run_cli
    of this worker start a fresh interpreter instead of forking the zygote."""
    def load_time(env) -> dict:
        return {k: v for k, v in env.items() if k.startswith(FRESH_ENV_PREFIXES)}
    before = load_time(os.environ)
    yield
    assert load_time(os.environ) == before, f"{request.module.__name__} changed os.environ"


@pytest.fixture(scope="session", autouse=True)
def cli_zygote():
    """The zygote lives for the session: started by the first run_cli, ended here."""
    yield
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None


def load_script(path: str, name: str):
    """A script of the checkout (benchmarks/ and install/ are no packages) loaded as module
    `name`, registered in sys.modules (dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def failure(result: subprocess.CompletedProcess) -> str:
    """What a failed run said that matters: the ranks' own error lines, then the tail."""
    lines = result.stderr.splitlines()
    errors = [l for l in lines if any(k in l for k in ("Error", "error", "terminate", "what()"))
              and "Location" not in l]
    return "\n".join(errors[:40] + ["..."] + lines[-15:])


def read_metrics(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def done_fields(stdout: str) -> dict:
    """The `done:` line's key=value pairs; asserts it is the last line printed."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("done: "), stdout[-2000:]
    return {k: float(v) for k, v in (item.split("=") for item in last.split()[1:])}


def exported_val_scores(checkpoint: Path, exported: Path):
    """(logits, labels) of the validation split scored by an `export`ed file of `checkpoint`,
    in one unsharded model built from the checkpoint's config."""
    import torch

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synthetic import SyntheticClicks
    from dlrm_hybrid.model.dlrm import build_model

    cfg = load_config(str(checkpoint / "config.yaml"))
    data = SyntheticClicks(cfg.data)
    model = build_model(cfg.model, data.spec, embedding_device=torch.device("cpu"))
    model.load_state_dict(torch.load(exported, weights_only=True))
    batch = data.batch("val", 0, cfg.data.val_samples)
    with torch.no_grad():
        return model(batch.dense, batch.sparse), batch.labels


def assert_eval_and_export_reproduce(checkpoint: Path, val_auc: float, exported: Path) -> None:
    """`eval` of `checkpoint` prints the run's validation AUC, and the model its `export` wrote
    scores the same AUC in one unsharded process."""
    import torch
    from torchmetrics.functional.classification import binary_auroc

    result = run_cli(["eval", "--checkpoint", str(checkpoint), "--split", "val"])
    assert result.returncode == 0, failure(result)
    assert f"val_auc={val_auc:.5f}" in result.stdout.strip().splitlines()[-1]
    result = run_cli(["export", "--checkpoint", str(checkpoint), "--out", str(exported),
                      "--state-dict"])
    assert result.returncode == 0, failure(result)
    logits, labels = exported_val_scores(checkpoint, exported)
    assert abs(binary_auroc(torch.sigmoid(logits), labels.long()).item() - val_auc) < 1e-5


def assert_one_two_and_resumed_alike(root: Path, common: List[str], plan: Path) -> None:
    """The demo config with `common` overrides (12 steps, a checkpoint at step 6) trained on 2
    ranks with `plan`, on 1 rank, and resumed on 1 rank from the 2-rank step 6: the same loss
    at every step (1e-4); `eval` and the export of the final checkpoint reproduce its AUC."""
    losses = {}
    for name, nproc, extra in (("two", 2, [f"parallel.plan={plan}"]), ("one", 0, []),
                               ("resumed", 0, [f"checkpoint.resume={root / 'two' / 'checkpoints' / 'step_6'}"])):
        overrides = [*common, f"train.run_dir={root / name}", *extra]
        result = run_cli(["train", "--config", "configs/demo.yaml",
                          *(f"--set={o}" for o in overrides)], nproc=nproc)
        assert result.returncode == 0, failure(result)
        losses[name] = {e["step"]: e["loss"] for e in read_metrics(root / name) if "loss" in e}
    assert sorted(losses["two"]) == sorted(losses["one"]) == list(range(1, 13))
    assert sorted(losses["resumed"]) == list(range(7, 13))
    for step, loss in losses["two"].items():
        assert abs(losses["one"][step] - loss) <= 1e-4 * loss, (step, losses)
        if step > 6:
            assert abs(losses["resumed"][step] - loss) <= 1e-4 * loss, (step, losses)
    final = [e for e in read_metrics(root / "two") if "val_auc" in e][-1]
    assert_eval_and_export_reproduce(root / "two" / "checkpoints" / "step_12", final["val_auc"],
                                     root / "m.pt")


def generated_yambda(root: Path, output: str, generate: List[str], history: int) -> None:
    """`preprocess yambda --generate` (its `generate` options) into root/log, then that log
    preprocessed with `--history` into root/`output`."""
    for args in (["--generate", *generate, "--output", str(root / "log")],
                 ["--input", str(root / "log"), "--output", str(root / output), "--history",
                  str(history)]):
        result = run_cli(["preprocess", "yambda", *args])
        assert result.returncode == 0, failure(result)


def train_with_each_loader(data_path, run_root: Path, env, batch: int, steps: int) -> dict:
    """{loader: TrainResult} of the demo model trained on `data_path`, shuffled, same seeds."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.train.loop import train

    results = {}
    for loader in ("torch", "dali"):
        cfg = load_config(str(ROOT / "configs/demo.yaml"), [
            f"data.path={data_path}", f"data.loader={loader}", "data.shuffle=true",
            f"data.global_batch_size={batch}", f"train.max_steps={steps}", "train.log_every=1",
            "train.progress_bar=false", f"train.run_dir={run_root / loader}"])
        results[loader] = train(cfg, env)
    return results


@pytest.fixture(scope="module")
def process_group():
    """A gloo group of one process, for tests that shard a model in-process."""
    import torch.distributed as dist

    from dlrm_hybrid.parallel.process_group import init_distributed, shutdown

    saved = dict(os.environ)
    env = init_distributed("gloo")
    yield env
    shutdown()
    os.environ.clear()
    os.environ.update(saved)
    assert not dist.is_initialized()
