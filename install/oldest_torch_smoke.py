"""The package under the oldest torch of install/torch_versions.txt, run as a user runs it (CI's
smoke job, after `make test`, which runs under the default torch).

A venv with that torch from PyPI, `make install TORCH=system VENV=...` into it, then, through the
CLI in a scratch folder (the installed package, not the checkout's files on sys.path):
  import     every module of dlrm_hybrid imports, with the table's fbgemm-gpu and torchrec
  train      configs/demo.yaml on 2 gloo ranks, cut to 10 steps, a checkpoint at 5 and 10
  resume     that run taken to step 20: it resumes from step_10 and trains steps 11-20, with
             the losses of the same 20 steps trained uninterrupted (a third run)
  two_tower  configs/two_tower_demo.yaml on 2 ranks, 4 steps, tables sharded (not replicated)
  export     the resumed run's step_20 as a served model
  predict    that model on `synth`'s files of the demo's data: the run's last evaluation again
Each stage has a time limit; a failure prints its command's last lines, then one line
`oldest_torch_smoke: STAGE: what failed`, and exits 1.

usage: python3 install/oldest_torch_smoke.py [--venv DIR] [--keep]
  --venv DIR  the venv to create or reuse (default /tmp/dlrm_hybrid-torch-MINOR); one that
              already holds another torch is refused, never changed
  --keep      keep the scratch folder of the runs (removed when every stage passes)
Standard library only: it runs under the Python that makes the venv.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parent.parent
NAME = "oldest_torch_smoke"
RANKS = ["-m", "dlrm_hybrid.torchrun", "--standalone", "--nproc_per_node=2", "-m", "dlrm_hybrid"]
QUIET = ["train.log_every=1", "train.eval_every=0", "train.progress_bar=false"]
# The demo's data, smaller: `synth` with the same keys writes the rows the run trained and
# evaluated on, so `predict` on its validation split must give the run's last AUC.
DEMO_DATA = ["data.train_samples=65536", "data.val_samples=4096"]
LOSS_TOLERANCE = 1e-5  # resumed vs uninterrupted, per step
SCORE_TOLERANCE = 5e-5  # predict's AUC and log loss vs the run's (both printed to 5 decimals)
TIMEOUT_S = {"pip install torch": 1800, "make install": 1200, "import": 300, "train": 300,
             "resume": 300, "two_tower": 300, "export": 300, "predict": 300}


class StageFailed(Exception):
    def __init__(self, stage: str, what: str, output: str = ""):
        super().__init__(f"{stage}: {what}")
        self.output = output


class Smoke:
    """The venv's Python, the scratch folder, and each stage's seconds."""

    def __init__(self, python: Path, work: Path):
        self.python, self.work = python, work
        self.seconds: Dict[str, float] = {}

    def run(self, stage: str, argv: Sequence[object]) -> str:
        """argv's output (stdout and stderr together); StageFailed on a non-zero exit or past
        the stage's time limit (its whole process group is killed: torchrun's ranks too)."""
        started = time.monotonic()
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.Popen([str(a) for a in argv], cwd=self.work, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S[stage])
        except subprocess.TimeoutExpired:
            output = _kill(proc)
            raise StageFailed(stage, f"still running after {TIMEOUT_S[stage]} s (the limit); "
                              f"killed", output)
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0) + time.monotonic() - started
        if proc.returncode != 0:
            last = (output.strip().splitlines() or ["no output"])[-1]
            raise StageFailed(stage, f"exit {proc.returncode}: {last}", output)
        return output

    def cli(self, stage: str, *args: object, ranks: bool = False, sets: Sequence[str] = ()) -> str:
        argv = [self.python, *(RANKS if ranks else ["-m", "dlrm_hybrid"]), *args]
        for item in sets:
            argv += ["--set", item]
        return self.run(stage, argv)


def _kill(proc: subprocess.Popen) -> str:
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
            return proc.communicate(timeout=wait_s)[0] or ""
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue
    return ""


def oldest_row() -> tuple:
    """(torch minor, fbgemm, torchrec) of install/torch_versions.txt's oldest torch."""
    spec = importlib.util.spec_from_file_location("setup_env", ROOT / "install/setup_env.py")
    assert spec is not None and spec.loader is not None
    setup_env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_env)
    table = setup_env.read_table()
    minor = min(table, key=lambda m: tuple(int(n) for n in m.split(".")))
    return minor, table[minor].fbgemm, table[minor].torchrec


def install(smoke: Smoke, venv: Path, minor: str) -> None:
    """The venv (made or reused) with torch MINOR.* from PyPI, then the project's own install,
    which keeps that torch (TORCH=system)."""
    if not smoke.python.exists():
        smoke.run("pip install torch", [sys.executable, "-m", "venv", venv])
    else:
        held = subprocess.run([smoke.python, "-c", "import torch; print(torch.__version__)"],
                              capture_output=True, text=True).stdout.strip()
        if held and not held.startswith(minor + "."):
            raise StageFailed("pip install torch", f"{venv} holds torch {held}, not {minor}; "
                              f"choose another --venv")
    smoke.run("pip install torch", [smoke.python, "-m", "pip", "install", "--quiet",
                                    "--disable-pip-version-check", f"torch=={minor}.*"])
    smoke.run("make install", ["make", "-C", ROOT, "install", "TORCH=system", f"VENV={venv}"])


IMPORT_ALL = r"""
import importlib, importlib.metadata, importlib.util, json, pkgutil, sys
import dlrm_hybrid, fbgemm_gpu, torch
failed = []
def failure(name):
    kind, error = sys.exc_info()[:2]
    said = (str(error).strip().splitlines() or [""])[0][:200]
    failed.append(f"{name} ({kind.__name__}: {said})")
names = [m.name for m in pkgutil.walk_packages(dlrm_hybrid.__path__, "dlrm_hybrid.", failure)]
# __main__ runs the CLI when imported (the other stages run it); _cpu_lookup and _criteo are C
# libraries that ctypes loads, not Python modules.
names = [n for n in names if not n.endswith(".__main__")
         and (importlib.util.find_spec(n).origin or "").endswith(".py")]
for name in names:
    try:
        importlib.import_module(name)
    except BaseException:
        failure(name)
print(json.dumps({"modules": len(names), "failed": failed, "torch": torch.__version__,
                  "fbgemm": fbgemm_gpu.__version__, "package": dlrm_hybrid.__file__,
                  "torchrec": importlib.metadata.version("torchrec")}))
"""


def check_imports(smoke: Smoke, minor: str, fbgemm: str, torchrec: str) -> Dict:
    output = smoke.run("import", [smoke.python, "-c", IMPORT_ALL])
    found = json.loads(output.strip().splitlines()[-1])
    if found["failed"]:
        raise StageFailed("import", f"{len(found['failed'])} of {found['modules']} modules fail "
                          f"to import: {'; '.join(found['failed'])}", output)
    if Path(found["package"]).parent != ROOT / "dlrm_hybrid":
        raise StageFailed("import", f"the venv's dlrm_hybrid is {found['package']}, another "
                          f"checkout's (an earlier `make install` there); use another --venv")
    versions = (found["torch"], found["fbgemm"], found["torchrec"])
    if not (versions[0].startswith(minor + ".") and versions[1:] == (fbgemm, torchrec)):
        raise StageFailed("import", f"torch, fbgemm_gpu, torchrec are {', '.join(versions)}, "
                          f"not install/torch_versions.txt's {minor}, {fbgemm}, {torchrec}")
    if found["modules"] < 30:
        raise StageFailed("import", f"only {found['modules']} modules found under dlrm_hybrid")
    return found


def done_fields(stage: str, output: str) -> Dict[str, float]:
    """The `done:` line (the run's last) as numbers."""
    last = (output.strip().splitlines() or [""])[-1]
    if not last.startswith("done: "):
        raise StageFailed(stage, f"the last line is not `done: ...` but {last!r}", output)
    return {k: float(v) for k, v in (item.split("=", 1) for item in last.split()[1:])}


def records(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(events: List[dict]) -> Dict[int, float]:
    return {e["step"]: e["loss"] for e in events if "loss" in e}


def demo_run(smoke: Smoke, stage: str, run_dir: Path, steps: int, *more: str) -> Dict:
    sets = [*QUIET, *DEMO_DATA, "checkpoint.every=5", f"train.max_steps={steps}",
            f"train.run_dir={run_dir}", *more]
    output = smoke.cli(stage, "train", "--config", ROOT / "configs/demo.yaml", ranks=True,
                       sets=sets)
    done = done_fields(stage, output)
    if done["steps"] != steps:
        raise StageFailed(stage, f"done after {done['steps']:g} steps, not {steps}", output)
    if not (run_dir / f"checkpoints/step_{steps}").is_dir():
        raise StageFailed(stage, f"no checkpoint {run_dir}/checkpoints/step_{steps}", output)
    return {"output": output, "done": done}


def train_and_resume(smoke: Smoke) -> Dict:
    """10 steps, then the same run to 20 (resume=auto), then 20 uninterrupted steps."""
    run_dir = smoke.work / "demo"
    demo_run(smoke, "train", run_dir, 10)
    resumed = demo_run(smoke, "resume", run_dir, 20, "checkpoint.resume=auto")
    said = f"resumed from {run_dir / 'checkpoints/step_10'} (step 10)"
    if said not in resumed["output"].splitlines():
        raise StageFailed("resume", f"no line {said!r}", resumed["output"])
    events = records(run_dir)
    marks = [i for i, e in enumerate(events) if e.get("resumed")]
    if len(marks) != 1 or events[marks[0]]["step"] != 10:
        raise StageFailed("resume", f"metrics.jsonl's resumed records: "
                          f"{[events[i] for i in marks]}, not one at step 10")
    after = sorted(losses(events[marks[0]:]))
    if after != list(range(11, 21)):
        raise StageFailed("resume", f"the resumed run trained steps {after}, not 11-20")
    whole = demo_run(smoke, "resume", smoke.work / "whole", 20)
    gap = max(abs(losses(events[marks[0]:])[s] - losses(records(smoke.work / "whole"))[s])
              for s in after)
    if not gap <= LOSS_TOLERANCE:
        raise StageFailed("resume", f"steps 11-20 of the resumed run differ from the "
                          f"uninterrupted run's by up to {gap:.3g} (over {LOSS_TOLERANCE:g})")
    resumed["summary"] = f"resumed at step 10, trained 11-20, losses within {gap:.2g} of " \
                         f"the uninterrupted run's (val_auc {whole['done']['val_auc']:.5f})"
    return resumed


def two_tower(smoke: Smoke) -> str:
    run_dir = smoke.work / "two_tower"
    output = smoke.cli("two_tower", "train", "--config", ROOT / "configs/two_tower_demo.yaml",
                       ranks=True, sets=[*QUIET, "train.max_steps=4", "parallel.replicate=false",
                                         f"train.run_dir={run_dir}"])
    done = done_fields("two_tower", output)
    events = records(run_dir)
    trained = losses(events)
    if sorted(trained) != [1, 2, 3, 4] or not all(map(math.isfinite, trained.values())):
        raise StageFailed("two_tower", f"losses by step {trained}, not finite at 1-4", output)
    if not any(e.get("exchange_fwd_bytes", 0) > 0 for e in events):
        raise StageFailed("two_tower", "no embedding lookup crossed ranks (exchange_fwd_bytes "
                          "0 at every step)", output)
    if "val_recall@10" not in done:
        raise StageFailed("two_tower", "the done line has no val_recall@10", output)
    return f"4 steps, loss {trained[1]:.4f} -> {trained[4]:.4f}, " \
           f"val_recall@10 {done['val_recall@10']:.4f}"


def export_and_predict(smoke: Smoke, run: Dict) -> str:
    model, data, scores = smoke.work / "model.pt", smoke.work / "data", smoke.work / "scores.txt"
    checkpoint = smoke.work / "demo/checkpoints/step_20"
    output = smoke.cli("export", "export", "--checkpoint", checkpoint, "--out", model)
    if not output.strip().splitlines()[-1].startswith(f"wrote {model} ("):
        raise StageFailed("export", f"no `wrote {model} (...)` line", output)
    smoke.cli("predict", "synth", "--config", ROOT / "configs/demo.yaml", "--output", data,
              sets=DEMO_DATA)
    output = smoke.cli("predict", "predict", "--model", model, "--data", data, "--split", "val",
                       "--out", scores)
    said = dict(item.split("=", 1) for item in output.strip().splitlines()[-1].split()
                if "=" in item)
    values = [float(line) for line in scores.read_text().split()]
    if len(values) != 4096 or said.get("samples") != "4096" or not all(
            0 < v < 1 for v in values):
        raise StageFailed("predict", f"{len(values)} scores (samples={said.get('samples')}), "
                          f"not 4096 probabilities in (0, 1)", output)
    for name in ("auc", "logloss"):
        theirs = run["done"][f"val_{name}"]
        if not abs(float(said.get(name, "nan")) - theirs) <= SCORE_TOLERANCE:
            raise StageFailed("predict", f"{name}={said.get(name)} on the validation split; the "
                              f"run's last evaluation gave {theirs:.5f}", output)
    return f"4096 scores, auc {said['auc']} logloss {said['logloss']}: the run's own"


def stages(smoke: Smoke, venv: Path, row: tuple) -> str:
    """Every stage in turn; the torch version they ran under."""
    install(smoke, venv, row[0])
    print(f"{NAME}: installed ({smoke.seconds['pip install torch']:.0f} s pip install torch, "
          f"{smoke.seconds['make install']:.0f} s make install)", flush=True)
    found = check_imports(smoke, *row)
    print(f"{NAME}: import: {found['modules']} modules import under torch {found['torch']}, "
          f"fbgemm_gpu {found['fbgemm']}, torchrec {found['torchrec']}", flush=True)
    run = train_and_resume(smoke)
    print(f"{NAME}: train, resume: {run['summary']}", flush=True)
    print(f"{NAME}: two_tower: {two_tower(smoke)}", flush=True)
    print(f"{NAME}: export, predict: {export_and_predict(smoke, run)}", flush=True)
    return found["torch"]


def report(failed: StageFailed, work: Path) -> None:
    """The failed command's last lines, then the one line naming the stage."""
    print("\n".join(failed.output.strip().splitlines()[-30:]), file=sys.stderr)
    kept = f" (runs kept in {work})" if any(work.iterdir()) else ""
    if not kept:
        work.rmdir()
    print(f"{NAME}: {failed}{kept}", file=sys.stderr)


def main() -> None:
    row = oldest_row()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(f"/tmp/dlrm_hybrid-torch-{row[0]}"))
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    venv = args.venv.absolute()
    smoke = Smoke(venv / "bin/python", Path(tempfile.mkdtemp(prefix="dlrm_hybrid-smoke-")))
    started = time.monotonic()
    try:
        torch_version = stages(smoke, venv, row)
    except StageFailed as failed:
        report(failed, smoke.work)
        sys.exit(1)
    if not args.keep:
        shutil.rmtree(smoke.work)
    runs = sum(s for k, s in smoke.seconds.items() if k not in ("pip install torch",
                                                                "make install"))
    print(f"{NAME}: passed under torch {torch_version} in {time.monotonic() - started:.0f} s "
          f"(pip install torch {smoke.seconds['pip install torch']:.0f} s, make install "
          f"{smoke.seconds['make install']:.0f} s, runs {runs:.0f} s)")


if __name__ == "__main__":
    main()
