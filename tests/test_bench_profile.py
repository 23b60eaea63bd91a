"""`bench --profile DIR`: the step's top kernels with the rate each achieved, and its trace."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import failure, run_cli
from dlrm_hybrid.bench.kernels import Kernel, top_kernels

BENCH = ["bench", "--config", "configs/demo.yaml", "--steps", "3", "--warmup", "1",
         "--peers", "none", "--set", "data.global_batch_size=512"]


def test_top_ops_on_cpu_count_a_matmuls_flops_and_calls_per_step():
    n, steps = 96, 3
    x, w = torch.randn(n, n), torch.randn(n, n)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        for _ in range(steps):
            torch.mm(x, w)
            x.relu()
    rows = {row.name: row for row in top_kernels(prof, steps, torch.device("cpu"))}
    mm, relu = rows["aten::mm"], rows["aten::relu"]
    assert mm.calls == 1 and mm.flops == 2 * n**3 and mm.bytes == 2 * n * n * 4
    assert relu.calls == 1 and relu.flops == 0 and relu.bytes == n * n * 4
    assert "TFLOP/s" in mm.achieved(1e12, 1e10) and "GB/s" in relu.achieved(1e12, 1e10)


def test_on_a_gpu_each_kernel_is_charged_once_with_its_ops_flops():
    """The CUDA branch on hand-made events: an addmm launching a gemm and a bias kernel gives its
    FLOPs to the longer one; the same gemm from a second op adds up under its name."""
    kernel = lambda name, us: SimpleNamespace(name=name, duration=us)  # noqa: E731
    addmm = SimpleNamespace(kernels=[kernel("gemm", 90.0), kernel("bias", 10.0)], flops=1000,
                            input_shapes=[[4, 8]], input_dtypes=["c10::BFloat16"])
    mm = SimpleNamespace(kernels=[kernel("gemm", 30.0)], flops=500, input_shapes=[[4, 8]],
                         input_dtypes=["float"])
    rows = {r.name: r for r in top_kernels(SimpleNamespace(events=lambda: [addmm, mm]), 2,
                                           torch.device("cuda"))}
    assert rows["gemm"].ms == pytest.approx(0.06) and rows["gemm"].calls == 1
    assert rows["gemm"].flops == 750 and rows["gemm"].bytes == (64 + 128) / 2
    assert rows["bias"].flops == 0 and rows["bias"].calls == 0.5


def test_a_kernel_without_counted_work_shows_no_rate():
    assert Kernel("launch", ms=1.0).achieved(1e12, 1e10) == "-"


def test_bench_profile_prints_top_ops_and_writes_a_trace(tmp_path):
    folder = tmp_path / "profile"
    result = run_cli([*BENCH, "--profile", str(folder)], timeout=120)
    assert result.returncode == 0, failure(result)
    assert "USDT:" not in result.stderr  # kineto's profiler_start/stop lines: not the user's
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("top "))
    step_ms = float(lines[start].split("per step of ")[1].split()[0])
    rows = [line.split() for line in lines[start + 1:start + 16] if " ms " in line]
    assert len(rows) == 15
    times = [float(row[0]) for row in rows]
    assert times == sorted(times, reverse=True) and sum(times) <= step_ms * 1.001
    assert any(row[-1] in ("aten::mm", "aten::addmm") and "TFLOP/s" in row for row in rows)
    trace = json.loads((folder / "trace.json").read_text())
    names = {event.get("name") for event in trace["traceEvents"]}
    assert "aten::addmm" in names
    assert (folder / "top_kernels.txt").read_text().strip() == "\n".join(
        lines[start:start + 1 + len(rows)]).strip()
    assert not list(folder.glob(".*partial"))


def test_bench_profile_never_writes_over_an_earlier_profile(tmp_path):
    folder = tmp_path / "profile"
    folder.mkdir()
    (folder / "trace.json").write_text("earlier")
    result = run_cli([*BENCH, "--profile", str(folder)], timeout=60)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, failure(result)
    assert "trace.json exists" in result.stderr
    assert (folder / "trace.json").read_text() == "earlier"
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    result = run_cli([*BENCH, "--profile", str(not_a_folder)], timeout=60)
    assert result.returncode == 2 and "is not a folder" in result.stderr, failure(result)
    under_a_file = not_a_folder / "profile"  # refused before the timing, not a traceback after
    result = run_cli([*BENCH, "--profile", str(under_a_file)], timeout=60)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, failure(result)
    assert f"{not_a_folder} is a file" in result.stderr and "samples_per_s" not in result.stdout
