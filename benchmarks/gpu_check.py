"""The GPU check in one command (benchmarks/gpu_check.sh OUT): the `gpu` tests, `bench` on the
Criteo 1TB FL15 model shape (synthetic data, one GPU) per precision setting, and a 2-process
NCCL training run where two GPUs exist. Writes OUT/gpu_check.json and OUT/gpu_check.md (the
table, also printed) and exits non-zero if a stage failed. Sized for one 10-minute call: each
stage has a time limit, and stages that no longer fit are reported as skipped.

    benchmarks/gpu_check.sh OUT [--steps 30] [--settings fp32 bf16 bf16+graphs ...]
    benchmarks/gpu_check.sh OUT --cpu-rehearsal   # the same stages on CPU, demo model, few steps

Without a CUDA device it stops at once with one line (unless --cpu-rehearsal).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Dict, List, Optional

from bench_table import BenchFailed, bench_line

ROOT = Path(__file__).resolve().parents[1]
FL15 = "configs/criteo_1tb_fl15.yaml"
SETTINGS = ["fp32", "bf16", "bf16+graphs", "bf16+graphs+nopipeline"]
TARGET = {"setting": "bf16+graphs", "samples_per_s": 4.0e6}  # NVIDIA's A100-80GB FL15 figure
BUDGET_S = 570  # of the 600 s a device call gets: what the stages may use in all


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
    return found


def numbers(fields: Dict[str, str]) -> Dict[str, object]:
    """A printed line's `key=value` fields, numbers as numbers."""
    def value(text: str) -> object:
        try:
            return float(text)
        except ValueError:
            return text
    return {key: value(text) for key, text in fields.items()}


def gpu_tests(out: Path, timeout: float) -> dict:
    report = out / "gpu_tests.xml"
    start = time.time()
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py",
                              f"--junitxml={report}", "-p", "no:cacheprovider"], cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"still running after {timeout:.0f} s"}
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    if report.exists():
        suite = ElementTree.parse(report).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
        failed = int(suite.get("failures")) + int(suite.get("errors"))
        counts = {"passed": total - skipped - failed, "failed": failed, "skipped": skipped}
    tail = run.stdout.strip().splitlines()[-1:] if run.stdout.strip() else []
    # pytest exits 5 when the marker selects nothing: that is a failure of the check too.
    return {"ok": run.returncode == 0, "seconds": round(time.time() - start, 1), **counts,
            "summary": tail[0] if tail else ""}


def bench_settings(config: str, settings: List[str], steps: int, extra: List[str],
                   deadline: float, reserve: float) -> List[dict]:
    rows = []
    for i, setting in enumerate(settings):
        left = deadline - time.time() - reserve
        per_run = left / (len(settings) - i)
        if per_run < 30:
            rows.append({"setting": setting, "ok": False, "error": "skipped: out of time"})
            continue
        start = time.time()
        try:
            fields = bench_line(config, setting, steps, extra=extra,
                                 timeout=min(left, per_run * 1.5))
            rows.append({"setting": setting, "ok": True, **numbers(fields),
                         "seconds": round(time.time() - start, 1)})
        except BenchFailed as error:
            rows.append({"setting": setting, "ok": False, "error": str(error)})
        print(f"gpu_check: bench {setting}: "
              f"{rows[-1].get('samples_per_s', rows[-1].get('error'))}", flush=True)
    return rows


def two_process_run(config: str, steps: int, extra: List[str], timeout: float) -> dict:
    """A real `train` job on 2 GPUs (NCCL, bf16, CUDA Graphs; `extra` overrides): its `done:`
    line."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as run_dir:
        sets = [f"train.max_steps={steps}", "train.eval_every=0", "train.progress_bar=false",
                f"data.val_samples={65536 * 2}", f"train.run_dir={run_dir}",
                "parallel.backend=nccl", "train.precision=bf16", "train.cuda_graphs=true",
                "checkpoint.resume=none", *extra]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "-m", "dlrm_hybrid", "train", "--config", config,
               *[a for s in sets for a in ("--set", s)]]
        start = time.time()
        try:
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"still running after {timeout:.0f} s"}
    lines = run.stdout.strip().splitlines()
    if run.returncode != 0 or not lines or not lines[-1].startswith("done: "):
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "error": f"exit {run.returncode}: {last}"}
    fields = dict(item.split("=", 1) for item in lines[-1].split()[1:])
    return {"ok": True, "seconds": round(time.time() - start, 1), **numbers(fields)}


def table(result: dict) -> str:
    v = result["versions"]
    lines = [f"GPU check on {v.get('gpu', 'CPU (rehearsal)')}: torch {v['torch']} "
             f"(CUDA {v['cuda']}), fbgemm-gpu {v.get('fbgemm-gpu', v.get('fbgemm-gpu-cpu'))}, "
             f"torchrec {v.get('torchrec')}; config {result['config']}",
             "", f"gpu tests: {result['gpu_tests'].get('summary') or result['gpu_tests']}", "",
             "| setting | ran | samples/s | reference samples/s | ratio | roofline fraction "
             "| peak memory GiB |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["bench"]:
        if r["ok"]:
            lines.append(f"| {r['setting']} | {r['precision']} | {r['samples_per_s']:,.0f} "
                         f"| {r['baseline_samples_per_s']:,.0f} | {r['ratio']:.2f} "
                         f"| {r['roofline_fraction']:.2f} | {r['peak_mem_gib']:.2f} |")
        else:
            lines.append(f"| {r['setting']} | failed: {r['error']} | | | | | |")
    two = result["two_process"]
    lines += ["", "2-process train: " + (
        f"{two['samples_per_s']:,.0f} samples/s" if two.get("ok") else
        two.get("error", "not run"))]
    target = result["target"]
    lines.append(f"target {target['setting']} >= {target['samples_per_s'] / 1e6:.1f}M samples/s: "
                 f"{target['verdict']}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--config", default=FL15)
    parser.add_argument("--steps", type=int, default=30, help="timed bench steps per setting")
    parser.add_argument("--settings", nargs="+", default=SETTINGS)
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="run the stages on CPU (demo model, fp32/bf16, a few steps) to "
                             "check the script itself before spending GPU time")
    args = parser.parse_args()
    import torch

    start = time.time()
    deadline = start + BUDGET_S
    if args.cpu_rehearsal:
        config, settings, steps, train_steps = "configs/demo.yaml", ["fp32", "bf16"], 3, 10
        extra, train_extra = [], ["parallel.backend=gloo", "train.precision=fp32",
                                  "train.cuda_graphs=false"]
    elif not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device (torch {torch.__version__} sees none); run it on a GPU "
              f"host, or with --cpu-rehearsal to check the script", file=sys.stderr)
        return 2
    else:
        config, settings, steps, train_steps = args.config, args.settings, args.steps, 300
        extra, train_extra = [], []
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"config": config, "versions": versions(), "steps": steps}
    result["gpu_tests"] = gpu_tests(args.out, timeout=200)
    two_ranks = torch.cuda.device_count() >= 2 or args.cpu_rehearsal
    result["bench"] = bench_settings(config, settings, steps, extra, deadline,
                                     reserve=120 if two_ranks else 0)
    if two_ranks:
        result["two_process"] = two_process_run(config, train_steps, train_extra,
                                                timeout=max(deadline - time.time(), 30))
    else:
        result["two_process"] = {"ok": None, "error": "not run: fewer than 2 GPUs"}
    hit = [r for r in result["bench"] if r["setting"] == TARGET["setting"] and r["ok"]]
    verdict = ("not measured" if not hit else
               "met" if hit[0]["samples_per_s"] >= TARGET["samples_per_s"] else "missed")
    result["target"] = {**TARGET, "verdict": verdict}
    result["seconds"] = round(time.time() - start, 1)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    text = table(result)
    (args.out / "gpu_check.md").write_text(text + "\n")
    print(text)
    failed = not result["gpu_tests"]["ok"] or not all(r["ok"] for r in result["bench"]) \
        or result["two_process"]["ok"] is False
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
