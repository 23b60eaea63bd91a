"""The GPU check (benchmarks/gpu_check.sh OUT): on a GPU host, every stage a user's GPU run goes
through, each with its own time limit, sized for one 10-minute device call:

1. imports: every module of the package imports under this torch;
2. gpu tests: tests/test_gpu.py on parallel workers, each failure's reason kept in
   OUT/gpu_tests.xml (junit) and OUT/gpu_tests.log;
3. bench: `bench` on the Criteo 1TB FL15 model shape per precision setting (synthetic batches
   already on the GPU: the step alone);
4. train vs bench: `train` of the same model and setting from a split-binary dataset on disk
   (written while the tests run), then from the planted synthetic data (made on the GPU), its
   steady-state samples/s against bench's: what feeding the step costs;
5. a 2-process NCCL `train` where two GPUs exist.

Writes OUT/gpu_check.json and OUT/gpu_check.md (the table, printed last) and exits non-zero if a
stage failed. `--cpu-rehearsal` runs the same stages on CPU (demo model, gloo, a few steps) to
check the script before GPU time is spent on it; without a CUDA device and without it, one line.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional

from bench_table import BenchFailed, bench_line, setting_overrides

ROOT = Path(__file__).resolve().parents[1]
FL15 = "configs/criteo_1tb_fl15.yaml"
SETTINGS = ["bf16+graphs"]
TARGET = {"setting": "bf16+graphs", "samples_per_s": 4.0e6}  # NVIDIA's A100-80GB FL15 figure
BUDGET_S = 560  # of the 600 s a device call gets: what the stages may use in all
LIMITS_S = {"imports": 60, "gpu_tests": 240, "bench": 100, "train": 90}


class Plan:
    """What one run measures: the full check on a GPU, or its CPU rehearsal."""

    def __init__(self, rehearsal: bool, config: str, settings: List[str], steps: int) -> None:
        self.rehearsal = rehearsal
        self.config = "configs/demo.yaml" if rehearsal else config
        self.settings = ["fp32", "bf16"] if rehearsal else settings
        self.steps = 3 if rehearsal else steps
        self.ratio_setting = "fp32" if rehearsal else self.settings[-1]
        # train vs bench: dataset = `synth_steps` batches, read over `train_steps` steps whose
        # last `window` are timed (the earlier ones: start-up, warm-up, graph capture).
        self.synth_steps, self.train_steps, self.window = (4, 12, 4) if rehearsal else (20, 60, 20)
        self.backend = "gloo" if rehearsal else "nccl"
        self.batch = 1024 if rehearsal else 65536  # the config's global batch


def versions() -> Dict[str, Optional[str]]:
    import torch

    found = {"python": sys.version.split()[0], "torch": torch.__version__,
             "cuda": torch.version.cuda}
    for dist in ("fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec", "nvidia-dali-cuda120"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["gpus"] = str(torch.cuda.device_count())
        driver = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 20)
        found["driver"] = driver.stdout.strip().splitlines()[0] if driver.returncode == 0 else None
    return found


def run(cmd: List[str], timeout: float, log: Optional[Path] = None) -> subprocess.CompletedProcess:
    """`cmd` in the checkout; a run past `timeout` is interrupted (SIGINT: pytest then still
    writes its report and reasons), killed 20 s later, and comes back with returncode None.
    `log` gets its output whatever happens."""
    try:
        process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
    except FileNotFoundError as e:
        return subprocess.CompletedProcess(cmd, 127, "", str(e))
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        code = process.returncode
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        try:
            stdout, stderr = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        code = None
    if log is not None:
        log.write_text(f"$ {' '.join(cmd)}\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)


def last_line(done: subprocess.CompletedProcess, timeout: float) -> str:
    if done.returncode is None:
        return f"still running after {timeout:.0f} s"
    lines = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
    return f"exit {done.returncode}: {lines[-1]}"


def numbers(fields: Dict[str, str]) -> Dict[str, object]:
    """A printed line's `key=value` fields, numbers as numbers."""
    def value(text: str) -> object:
        try:
            return float(text)
        except ValueError:
            return text
    return {key: value(text) for key, text in fields.items()}


def imports(out: Path) -> dict:
    """Every module of the package imports (the oldest-torch smoke job's check)."""
    spec = importlib.util.spec_from_file_location("smoke", ROOT / "install/oldest_torch_smoke.py")
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    done = run([sys.executable, "-c", smoke.IMPORT_ALL], LIMITS_S["imports"], out / "imports.log")
    if done.returncode != 0:
        return {"ok": False, "error": last_line(done, LIMITS_S["imports"])}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if found["failed"]:
        return {"ok": False, "error": "; ".join(found["failed"])}
    return {"ok": True, "modules": found["modules"]}


def gpu_tests(out: Path, timeout: float) -> dict:
    """The tests marked `gpu` (tests/test_gpu.py and any other file's); `failures`: each failed
    test's name and the first line of its reason."""
    import torch

    report = out / "gpu_tests.xml"
    # 6 workers share the GPU; on CPU (the rehearsal: every test skipped) they only collect
    workers = (["-n", "6", "--dist", "load"] if importlib.util.find_spec("xdist")
               and torch.cuda.is_available() else [])
    start = time.time()
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in f.read_text())  # collecting the others costs time here
    done = run([sys.executable, "-m", "pytest", "-v", "-m", "gpu", *files, *workers,
                "-rA", "--tb=short", f"--junitxml={report}", "-p", "no:cacheprovider"],
               timeout, out / "gpu_tests.log")
    result = {"ok": done.returncode == 0, "seconds": round(time.time() - start, 1),
              "passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for case in suite.iter("testcase"):
            problem = case.find("failure")
            problem = case.find("error") if problem is None else problem
            if problem is not None:
                reason = (problem.get("message") or problem.text or "").strip().splitlines()
                result["failures"].append(f"{case.get('name')}: {(reason or ['?'])[0][:200]}")
            elif case.find("skipped") is not None:
                result["skipped"] += 1
            else:
                result["passed"] += 1
        result["failed"] = len(result["failures"])
    if done.returncode is None:
        result["error"] = f"still running after {timeout:.0f} s (see gpu_tests.log)"
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    result["summary"] = tail[0] if tail else result.get("error", "")
    return result


def bench(plan: Plan, deadline: float, reserve: float) -> List[dict]:
    rows = []
    for i, setting in enumerate(plan.settings):
        left = deadline - time.time() - reserve
        per_run = left / (len(plan.settings) - i)
        if per_run < 30:
            rows.append({"setting": setting, "ok": False, "error": "skipped: out of time"})
            continue
        start = time.time()
        try:
            fields = bench_line(plan.config, setting, plan.steps, timeout=min(left, per_run * 1.5),
                                extra=[f"parallel.backend={plan.backend}"])
            rows.append({"setting": setting, "ok": True, **numbers(fields),
                         "seconds": round(time.time() - start, 1)})
        except BenchFailed as error:
            rows.append({"setting": setting, "ok": False, "error": str(error)})
        print(f"gpu_check: bench {setting}: "
              f"{rows[-1].get('samples_per_s', rows[-1].get('error'))}", flush=True)
    return rows


def synth_command(plan: Plan, data: Path) -> List[str]:
    """The split-binary dataset `train` reads: `synth_steps` global batches of the model's
    shape (an epoch is re-read as often as the steps need)."""
    sizes = [f"data.train_samples={plan.synth_steps * plan.batch}",
             f"data.val_samples={plan.batch}"]
    return [sys.executable, "-m", "dlrm_hybrid", "synth", "--config", plan.config, "--output",
            str(data), *[a for s in sizes for a in ("--set", s)]]


def train_vs_bench(plan: Plan, source: str, data: Path, out: Path, bench_rows: List[dict],
                   timeout: float, run_dir: Path) -> dict:
    """`train` at the ratio setting from `source` ("files": the split-binary dataset at `data`;
    "synthetic": the planted data, made where the run is), into `run_dir` (OUT gets only logs
    and reports); its last `window` steps' samples/s (from the run's metrics.jsonl) over
    bench's for that setting."""
    sets = [f"train.run_dir={run_dir}", f"train.max_steps={plan.train_steps}",
            f"train.log_every={plan.window}", "train.eval_every=0", "train.progress_bar=false",
            "checkpoint.resume=none", "checkpoint.every=0", f"parallel.backend={plan.backend}",
            f"data.val_samples={plan.batch}", *setting_overrides(plan.ratio_setting)]
    if source == "files":
        sets.append(f"data.path={data}")
    limit = min(LIMITS_S["train"], timeout)
    if limit < 30:
        return {"ok": False, "error": "skipped: out of time"}
    done = run([sys.executable, "-m", "dlrm_hybrid", "train", "--config", plan.config,
                *[a for s in sets for a in ("--set", s)]], limit, out / f"train_{source}.log")
    if done.returncode != 0:
        return {"ok": False, "error": last_line(done, limit)}
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rate = [e["samples_per_s"] for e in windows if "samples_per_s" in e and "loss" in e][-1]
    result = {"ok": True, "setting": plan.ratio_setting, "train_samples_per_s": rate}
    bench_row = next((r for r in bench_rows if r["setting"] == plan.ratio_setting and r["ok"]),
                     None)
    if bench_row is not None:
        result["bench_samples_per_s"] = bench_row["samples_per_s"]
        result["ratio"] = round(rate / bench_row["samples_per_s"], 3)
    return result


def wait_for_synth(synth: subprocess.Popen, timeout: float) -> Optional[str]:
    """None once the dataset is written, else why not."""
    try:
        synth.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        synth.kill()
        return "synth still writing the dataset"
    return None if synth.returncode == 0 else f"synth exit {synth.returncode} (see synth.log)"


def two_process(plan: Plan, timeout: float, run_dir: Path) -> dict:
    """A real `train` job on 2 ranks (GPUs: NCCL, bf16, CUDA Graphs) into `run_dir`: its
    `done:` line."""
    sets = [f"train.max_steps={10 if plan.rehearsal else 300}", "train.eval_every=0",
            "train.progress_bar=false", f"data.val_samples={2 * plan.batch}",
            f"train.run_dir={run_dir}",
            "checkpoint.resume=none", f"parallel.backend={plan.backend}",
            *setting_overrides("fp32" if plan.rehearsal else "bf16+graphs")]
    done = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node=2", "-m", "dlrm_hybrid", "train", "--config", plan.config,
                *[a for s in sets for a in ("--set", s)]], timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("done: "):
        return {"ok": False, "error": last_line(done, timeout)}
    fields = dict(item.split("=", 1) for item in lines[-1].split()[1:])
    return {"ok": True, **numbers(fields)}


def table(result: dict) -> str:
    v = result["versions"]
    lines = [f"GPU check on {v.get('gpu', 'CPU (rehearsal)')} (driver {v.get('driver')}): "
             f"torch {v['torch']} (CUDA {v['cuda']}), fbgemm-gpu "
             f"{v.get('fbgemm-gpu', v.get('fbgemm-gpu-cpu'))}, torchrec {v.get('torchrec')}, "
             f"Python {v['python']}; config {result['config']}, {result['seconds']} s", "",
             "| stage | result |", "|---|---|",
             f"| imports | " + (f"{result['imports']['modules']} modules" if result["imports"]["ok"]
                                else result["imports"]["error"]) + " |"]
    tests = result["gpu_tests"]
    lines.append(f"| gpu tests | {tests['passed']} passed, {tests['failed']} failed, "
                 f"{tests['skipped']} skipped in {tests['seconds']} s"
                 f"{'; ' + tests['error'] if 'error' in tests else ''} |")
    lines += [f"| failed: {failure} |  |" for failure in tests["failures"]]
    for r in result["bench"]:
        lines.append(f"| bench {r['setting']} | " + (
            f"{r['samples_per_s']:,.0f} samples/s ({r['precision']}), reference "
            f"{r['baseline_samples_per_s']:,.0f} (x{r['ratio']:.2f}), roofline fraction "
            f"{r['roofline_fraction']:.2f}, peak {r['peak_mem_gib']:.1f} GiB |" if r["ok"] else
            f"failed: {r['error']} |"))
    for source, ratio in result["train_vs_bench"].items():
        lines.append(f"| train from {source} vs bench | " + (
            f"{ratio['train_samples_per_s']:,.0f} samples/s, "
            + (f"{ratio['ratio']:.2f} of bench ({ratio['setting']})" if "ratio" in ratio else
               "no bench figure to compare") + " |" if ratio["ok"] else
            f"failed: {ratio['error']} |"))
    two = result["two_process"]
    lines.append("| 2-process train | " + (f"{two['samples_per_s']:,.0f} samples/s |"
                                            if two.get("ok") else f"{two.get('error')} |"))
    target = result["target"]
    lines.append(f"| target {target['setting']} >= {target['samples_per_s'] / 1e6:.1f}M "
                 f"samples/s | {target['verdict']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the reports and logs")
    parser.add_argument("--config", default=FL15)
    parser.add_argument("--steps", type=int, default=30, help="timed bench steps per setting")
    parser.add_argument("--settings", nargs="+", default=SETTINGS,
                        help="bench settings (bench_table.py's); the last one is also trained "
                             "from files for the train-vs-bench ratio")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run the stages on CPU (demo model, gloo, a few steps) to check "
                             "the script itself before spending GPU time")
    args = parser.parse_args()
    import torch

    start = time.time()
    deadline = start + BUDGET_S
    if not args.cpu_rehearsal and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__} sees none); run it on a GPU "
              f"host, or with --cpu-rehearsal to check the script", file=sys.stderr)
        return 2
    plan = Plan(args.cpu_rehearsal, args.config, args.settings, args.steps)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"config": plan.config, "versions": versions(), "steps": plan.steps}
    result["imports"] = imports(args.out)
    # the dataset (written on the CPU while the tests use the GPU) and the runs: not under
    # OUT, which comes back; removed at the end
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        return _stages(args, plan, result, scratch, deadline, start)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _stages(args, plan: Plan, result: dict, scratch: Path, deadline: float,
            start: float) -> int:
    import torch

    data = scratch / "data"
    with open(args.out / "synth.log", "w") as synth_log:
        synth = subprocess.Popen(synth_command(plan, data), cwd=ROOT, stdout=synth_log,
                                 stderr=subprocess.STDOUT)
    after_tests = LIMITS_S["bench"] + 2 * LIMITS_S["train"]  # what the later stages need
    result["gpu_tests"] = gpu_tests(args.out, timeout=min(LIMITS_S["gpu_tests"],
                                                          deadline - time.time() - after_tests))
    two_ranks = torch.cuda.device_count() >= 2 or plan.rehearsal
    result["bench"] = bench(plan, deadline, reserve=2 * LIMITS_S["train"] +
                            (120 if two_ranks else 0))
    result["train_vs_bench"] = {}
    for source in ("files", "synthetic"):
        left = deadline - time.time() - (LIMITS_S["train"] if source == "files" else 0) - (
            120 if two_ranks else 0)
        why_not = wait_for_synth(synth, left - 30) if source == "files" else None
        result["train_vs_bench"][source] = ({"ok": False, "error": why_not} if why_not else
                                            train_vs_bench(plan, source, data, args.out,
                                                           result["bench"], left,
                                                           scratch / f"train_{source}"))
    shutil.rmtree(data, ignore_errors=True)
    result["two_process"] = (two_process(plan, max(deadline - time.time(), 30),
                                         scratch / "two") if two_ranks
                             else {"ok": None, "error": "not run: fewer than 2 GPUs"})
    hit = [r for r in result["bench"] if r["setting"] == TARGET["setting"] and r["ok"]]
    verdict = ("not measured" if not hit else
               "met" if hit[0]["samples_per_s"] >= TARGET["samples_per_s"] else "missed")
    result["target"] = {**TARGET, "verdict": verdict}
    result["seconds"] = round(time.time() - start, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (args.out / "gpu_check.md").write_text(text + "\n")
    print(text)
    failed = (not result["imports"]["ok"] or not result["gpu_tests"]["ok"]
              or not all(r["ok"] for r in result["bench"])
              or not all(r["ok"] for r in result["train_vs_bench"].values())
              or result["two_process"]["ok"] is False)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
