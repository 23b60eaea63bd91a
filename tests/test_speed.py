"""The fast paths: the dot interaction's backward, autocast and the fp16 loss scaler, the
quantized all-to-all, CUDA Graphs bookkeeping, the `bench` command, how
benchmarks/train_throughput.py starts its ranks, inference.py's clean-up, and the paths and errors
of bench_table.py and loader_throughput.py."""

import contextlib
import json
import re
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch
from torchrec.models.dlrm import InteractionArch

from conftest import ROOT, failure, load_script, read_metrics, run_cli
from dlrm_hybrid.bench.roofline import measure_peaks
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.model.interactions import DotInteraction
from dlrm_hybrid.train.cuda_graphs import DenseGraph
from dlrm_hybrid.train.loop import train
from dlrm_hybrid.train.precision import cpu_capability, cpu_has_native, onednn_has_kernel

SMALL = ["train.progress_bar=false", "data.val_samples=2048", "data.global_batch_size=256",
         "train.log_every=1", "train.eval_every=0"]

# The asked precision even where this CPU emulates it (the demo model is small enough): these
# tests check autocast and the loss scaler themselves, on every kind of host.
EXACT = ["train.precision_fallback=false"]


def small_config(tmp_path, *overrides):
    return load_config(str(ROOT / "configs/demo.yaml"),
                       [*SMALL, f"train.run_dir={tmp_path}", *overrides])


def test_dot_interaction_matches_torchrec_forward_and_backward():
    torch.manual_seed(0)
    dense, sparse = torch.randn(32, 8, requires_grad=True), torch.randn(32, 5, 8, requires_grad=True)
    ours, reference = DotInteraction(5), InteractionArch(5)
    out = ours(dense, sparse)
    expected = reference(dense, sparse)
    assert torch.equal(out, expected)
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (dense, sparse))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (dense, sparse))
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want)


def test_self_interaction_gradient_counts_the_square_twice():
    vectors = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    interaction = DotInteraction(2, self_interaction=True)
    check = lambda v: interaction(v[:, 0].contiguous(), v[:, 1:].contiguous())  # noqa: E731
    assert torch.autograd.gradcheck(check, (vectors,))


@contextlib.contextmanager
def linear_output_dtypes():
    """The dtypes of every nn.Linear output computed inside (the MLPs' matmuls)."""
    seen = set()

    def hook(module, args, output):
        if isinstance(module, torch.nn.Linear):
            seen.add(output.dtype)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_training_tracks_fp32(tmp_path, process_group, precision):
    """The MLPs' matmuls really run in the low precision (and in fp32 without it), and the
    losses and AUC stay close to fp32's."""
    runs, dtypes = {}, {}
    for p in ("fp32", precision):
        with linear_output_dtypes() as dtypes[p]:
            runs[p] = train(small_config(tmp_path / p, f"train.precision={p}", "train.max_steps=40",
                                         "train.log_every=10", *EXACT), process_group)
    low_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    assert dtypes["fp32"] == {torch.float32} and low_dtype in dtypes[precision], dtypes
    fp32, low = runs["fp32"], runs[precision]
    assert low.losses[-1] < low.losses[0]
    for a, b in zip(fp32.losses, low.losses):
        assert abs(a - b) < 0.05, (fp32.losses, low.losses)
    assert abs(fp32.metrics["val_auc"] - low.metrics["val_auc"]) < 0.01


def test_low_precision_on_a_cpu_that_emulates_it_warns_once_and_trains_in_fp32(
        tmp_path, process_group, monkeypatch):
    """What an AVX2-only host does with train.precision=bf16 (a 24x slower step otherwise),
    decided the same way on any host: the check is made to say "emulated"."""
    import dlrm_hybrid.train.precision as precision

    monkeypatch.setattr(precision, "cpu_emulation", lambda dtype: "no avx512_bf16 or amx_bf16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = train(small_config(tmp_path / "bf16", "train.precision=bf16",
                                      "train.max_steps=3"), process_group)
    said = [str(w.message) for w in caught if str(w.message).startswith("train.precision")]
    assert said == [f"train.precision: this CPU ({torch.backends.cpu.get_cpu_capability()}, no "
                    f"avx512_bf16 or amx_bf16) has no native bf16 matmul (a step 3-24x slower "
                    f"than fp32); computing in fp32 (set train.precision_fallback=false to insist)"]
    fp32 = train(small_config(tmp_path / "fp32", "train.max_steps=3"), process_group)
    insisted = train(small_config(tmp_path / "insist", "train.precision=bf16", "train.max_steps=3",
                                  *EXACT), process_group)
    assert fallback.losses == fp32.losses
    assert insisted.losses != fp32.losses  # computed in bf16 after all


def test_fp16_overflow_skips_the_step_everywhere_and_is_counted(tmp_path, process_group):
    """A loss scale of 2^40 overflows fp16: those steps change neither the MLPs nor the tables
    (their fused update sees a zeroed gradient), the scale backs off and training goes on."""
    from dlrm_hybrid.data.source import make_loader, open_dataset
    from dlrm_hybrid.train.loop import build_sharded_model
    from dlrm_hybrid.train.optim import build_optimizer
    from dlrm_hybrid.train.step import TrainStep

    cfg = small_config(tmp_path, "train.precision=fp16", "optim.embedding=sgd", *EXACT)
    dataset = open_dataset(cfg.data)
    dmp, _ = build_sharded_model(cfg, dataset.spec, process_group, lambda line: None)
    step = TrainStep(dmp, *build_optimizer(dmp, cfg.optim), cfg.train, process_group.device)
    step.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    batches = make_loader(cfg.data, dataset, "train", process_group)
    before = {k: _local(v).clone() for k, v in dmp.state_dict().items()}
    step(batches)
    assert step.precision.skipped_steps() == 1
    for key, value in dmp.state_dict().items():
        assert torch.equal(_local(value), before[key]), f"{key} changed in a skipped step"
    losses = [step(batches).item() for _ in range(60)]
    batches.close()
    skipped = step.precision.skipped_steps()
    assert 1 < skipped < 40  # backs off by half per skip, from 2^40 to what fp16 holds
    assert losses[-1] < losses[skipped]


def _local(value: torch.Tensor) -> torch.Tensor:
    """A sharded table's local values, or the tensor itself."""
    if hasattr(value, "local_shards"):
        return torch.cat([shard.tensor.flatten() for shard in value.local_shards()])
    return value


def test_fp16_run_logs_skipped_steps_and_resumes_with_them(tmp_path, process_group,
                                                           monkeypatch):
    """Loss scalers that start at 2^19 overflow the demo's fp16 gradients (2^17 holds them):
    the first steps are skipped, each counted in metrics.jsonl and halving the scale. A run
    resumed after them goes on from the checkpoint's count and scale: no step skipped again
    (a fresh scaler would start at 2^19 again), the count not reset."""
    init_scale = 2.0**19

    class LargeInitialScale(torch.amp.GradScaler):
        def __init__(self, device: str = "cuda", **kwargs) -> None:
            super().__init__(device, **{"init_scale": init_scale, **kwargs})

    monkeypatch.setattr(torch.amp, "GradScaler", LargeInitialScale)
    fp16 = ["train.precision=fp16", *EXACT]
    train(small_config(tmp_path, *fp16, "train.max_steps=4"), process_group)
    train(small_config(tmp_path, *fp16, "train.max_steps=8",
                       f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_4'}"), process_group)
    counts = [e["skipped_steps"] for e in read_metrics(tmp_path) if "loss" in e]
    skipped = counts[3]  # by the checkpoint
    assert 1 <= skipped < 4, counts  # the resumed run starts after a skip and a trained step
    assert counts == list(range(1, skipped + 1)) + [skipped] * (8 - skipped)
    meta = json.loads((tmp_path / "checkpoints" / "step_8" / "meta.json").read_text())
    assert meta["skipped_steps"] == skipped
    assert meta["loss_scaler"]["scale"] == init_scale / 2**skipped
    assert meta["loss_scaler"]["_growth_tracker"] == 8 - skipped  # steps since the last skip


def two_rank_losses(run_dir, *overrides):
    """Per-log-step losses of the demo config on 2 gloo ranks under torchrun."""
    args = ["data.val_samples=4096", "train.progress_bar=false", f"train.run_dir={run_dir}",
            *overrides]
    result = run_cli(["train", "--config", "configs/demo.yaml",
                      *[a for o in args for a in ("--set", o)]], nproc=2)
    assert result.returncode == 0, failure(result)
    return [e["loss"] for e in read_metrics(run_dir) if "loss" in e]


def step_drivers(run_dir):
    """What ran a run's steps, as its metrics.jsonl records it at each start."""
    return [e["step_driver"] for e in read_metrics(run_dir) if "step_driver" in e]


def test_pipelined_steps_give_the_plain_losses_with_evaluation_between(tmp_path, process_group):
    runs = {mode: train(small_config(tmp_path / mode, f"train.pipeline={mode}", "train.max_steps=12",
                                     "train.eval_every=5", "optim.embedding=sgd"), process_group)
            for mode in ("disabled", "enabled")}
    assert step_drivers(tmp_path / "enabled") == ["torchrec pipeline"]
    assert step_drivers(tmp_path / "disabled") == ["plain"]
    assert runs["enabled"].losses == runs["disabled"].losses
    assert runs["enabled"].metrics == runs["disabled"].metrics


def test_pipeline_and_fp16_all_to_all_on_two_ranks(tmp_path):
    """One plain 2-rank run as the reference for two others (launches are the slow part): the
    train pipeline gives exactly its losses, with evaluation in between; the fp16 all-to-all
    rounds the payload, and training stays within 0.1% of it. Dense SGD: the demo's dense
    Adagrad moves a weight by up to its LR whatever a near-zero gradient's size, which turns
    the payload's rounding into 6% by step 12 where the demo's small tables are replicated.
    Every table sharded: the placer replicates all of the demo's on 2 CPU ranks, leaving the
    all-to-all nothing to carry."""
    common = ["train.max_steps=12", "train.log_every=1", "train.eval_every=6", "optim.dense=sgd",
              "optim.dense_lr=0.5", "parallel.replicate=false"]
    plain = two_rank_losses(tmp_path / "plain", *common, "train.pipeline=disabled")
    pipelined = two_rank_losses(tmp_path / "pipelined", *common, "train.pipeline=enabled")
    fp16 = two_rank_losses(tmp_path / "fp16", *common, "train.pipeline=disabled",
                           "parallel.comm_precision=fp16")
    assert len(plain) == 12 and pipelined == plain
    assert step_drivers(tmp_path / "pipelined") == ["torchrec pipeline"]
    assert step_drivers(tmp_path / "plain") == step_drivers(tmp_path / "fp16") == ["plain"]
    assert fp16 != plain  # the payload really is rounded
    for a, b in zip(plain, fp16):
        assert abs(a - b) / a < 1e-3


class _Model(torch.nn.Module):
    """What DenseGraph needs of a model: the dense layers and `dense_loss`."""

    def __init__(self):
        super().__init__()
        self.dense_arch, self.interaction = torch.nn.Linear(3, 2), torch.nn.Identity()
        self.over_arch = torch.nn.Linear(2, 1)
        self.eager_calls = 0

    def dense_loss(self, dense, pooled, labels):
        self.eager_calls += 1
        return (self.over_arch(self.dense_arch(dense)) * pooled.sum()).mean()


def test_dense_graph_captures_once_after_warmup_and_replays_fixed_shapes():
    model, captured = _Model(), []

    def capture(module, static_args):
        captured.append([a.shape for a in static_args])
        return lambda *args: module(*args) * 0  # a stand-in for the graphed callable

    graph = DenseGraph(model, torch.device("cpu"), warmup=3, capture=capture)
    args = (torch.randn(8, 3), torch.randn(8, 4, requires_grad=True), torch.ones(8))
    eager = [model.dense_loss(*args) for _ in range(3)]  # the warm-up runs eagerly
    assert all(loss != 0 for loss in eager) and captured == []
    assert model.dense_loss(*args) == 0 and model.dense_loss(*args) == 0  # captured, replayed
    assert captured == [[(8, 3), (8, 4), (8,)]]
    short = (torch.randn(5, 3), torch.randn(5, 4, requires_grad=True), torch.ones(5))
    assert model.dense_loss(*short) != 0  # another shape: eager, no new capture
    assert len(captured) == 1 and graph.eager_reason is None


def test_dense_graph_warns_once_and_stays_eager_when_capture_fails():
    model = _Model()

    def capture(module, static_args):
        raise RuntimeError("operation not permitted when stream is capturing")

    graph = DenseGraph(model, torch.device("cpu"), warmup=0, capture=capture)
    args = (torch.randn(8, 3), torch.randn(8, 4, requires_grad=True), torch.ones(8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.dense_loss(*args)
    assert model.eager_calls == 3
    assert [str(w.message) for w in caught] == [
        "train.cuda_graphs: capture failed (RuntimeError: operation not permitted when stream "
        "is capturing); running the dense part eagerly"]
    assert graph.eager_reason.startswith("capture failed")


def test_cuda_graphs_on_cpu_warn_and_train_eagerly(tmp_path, process_group):
    with pytest.warns(UserWarning, match="train.cuda_graphs: needs a CUDA device"):
        result = train(small_config(tmp_path, "train.cuda_graphs=true", "train.max_steps=3"),
                       process_group)
    plain = train(small_config(tmp_path / "plain", "train.max_steps=3"), process_group)
    assert result.losses == plain.losses


AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # an AVX2 EPYC, emulated


def run_bench(*overrides, extra_env=None):
    """`bench` on the demo model, briefly: (its report lines, its last line's fields, stderr).
    The timeout is well under what measuring an emulated bf16 matmul at full size takes."""
    args = ["bench", "--config", "configs/demo.yaml", "--steps", "6", "--warmup", "2",
            *[a for o in overrides for a in ("--set", o)]]
    result = run_cli(args, timeout=90, extra_env=extra_env)
    assert result.returncode == 0, failure(result)
    lines = result.stdout.strip().splitlines()
    last = lines[-1].split()
    assert last[0] == "bench:", lines[-1]
    return lines, dict(item.split("=", 1) for item in last[1:]), result.stderr


def check_report(lines, fields, ran: str):
    """The report and its last line agree: the precision that ran, the matmul rate measured in
    it, the ratio and roofline fraction computed from the printed rates."""
    matmul = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[ran]
    assert fields["precision"] == ran
    assert any(line.strip().startswith("step split") for line in lines)
    roofline = next(line for line in lines if "roofline" in line)
    assert re.search(rf"measured (\d+)x\1 {matmul} matmul", roofline), roofline
    assert roofline.rsplit("achieved ", 1)[1].split()[0] == fields["roofline_fraction"]
    x, y = float(fields["samples_per_s"]), float(fields["baseline_samples_per_s"])
    # the ratio is printed to 2 decimals (0.38 for 0.3759: a relative tolerance fails it)
    assert x > 0 and y > 0 and float(fields["ratio"]) == pytest.approx(x / y, abs=0.0051)
    assert 0 < float(fields["peak_mem_gib"]) < 24


def test_bench_prints_the_comparison_line():
    """bf16 runs where this CPU has a bf16 matmul, fp32 (said so) where it would emulate it."""
    lines, fields, stderr = run_bench("train.precision=bf16")
    for notice in ("TopologyFactory", "HeuristicalStorageReservation", "Sharding spec not found"):
        assert notice not in stderr  # torchrec's planner on the torchrec peer: nothing to a user
    ran = "bf16" if cpu_has_native(torch.bfloat16) else "fp32"
    keys = ["precision", "requested", "samples_per_s", "baseline_samples_per_s", "ratio",
            "torchrec_samples_per_s", "torchrec_ratio", "roofline_fraction", "peak_mem_gib",
            "cpu", "exchange", "exchange_bytes"]
    assert list(fields) == [k for k in keys if k != "requested" or ran != "bf16"]
    assert fields["exchange"] == "pooled" and fields["exchange_bytes"] == "0"  # one process
    check_report(lines, fields, ran)
    x, z = float(fields["samples_per_s"]), float(fields["torchrec_samples_per_s"])
    assert float(fields["torchrec_ratio"]) == pytest.approx(x / z, abs=0.0051)  # 2 decimals
    assert any(line.strip().startswith("torchrec (DLRM, DistributedModelParallel") for line in lines)
    assert fields.get("requested", "bf16") == "bf16"
    assert fields["cpu"] == re.sub(r",\s*", ",", cpu_capability()).replace(" ", "-")
    assert lines[0].endswith(f"cpu: {cpu_capability()}")
    assert any(line.strip().startswith(f"dlrm_hybrid ({ran}") for line in lines)


def test_bench_peers_are_what_was_asked_or_what_can_model_the_config(tmp_path):
    """--peers none: ours alone; a model torchrec's DLRM cannot express (cat): the reference
    alone by default, and a one-line refusal when torchrec is asked for."""
    lines, fields, _ = run_bench("model.interaction=cat")
    assert "baseline_samples_per_s" in fields and "torchrec_ratio" not in fields
    reference = next(line for line in lines if line.strip().startswith("reference"))
    assert "its interaction dot, ours cat" in reference  # the ratio compares other models too
    args = ["bench", "--config", "configs/demo.yaml", "--steps", "3", "--warmup", "1"]
    alone = run_cli([*args, "--peers", "none"], timeout=90)
    assert alone.returncode == 0, failure(alone)
    last = alone.stdout.strip().splitlines()[-1]
    assert last.startswith("bench: ") and "ratio=" not in last
    assert not any(line.strip().startswith(("reference", "torchrec"))
                   for line in alone.stdout.splitlines())
    for peers, message in [(["none", "reference"], "none means ours alone"),
                           (["torchrec", "--set", "model.interaction=cat"],
                            "torchrec's DLRM has no model.interaction cat")]:
        refused = run_cli([*args, "--peers", *peers], timeout=60)
        assert refused.returncode == 2 and message in refused.stderr, failure(refused)
        assert refused.stderr.strip().count("\n") == 0 and not refused.stdout.strip()


def test_bench_on_an_avx2_cpu_runs_bf16_in_fp32_and_says_so():
    lines, fields, stderr = run_bench("train.precision=bf16", extra_env=AVX2_ONLY)
    check_report(lines, fields, "fp32")
    assert fields["requested"] == "bf16"
    assert fields["cpu"] == "AVX2,bf16-emulated,fp16-emulated"
    assert any(line.strip().startswith("dlrm_hybrid (fp32, bf16 requested)") for line in lines)
    assert "has no native bf16 matmul" in stderr and "computing in fp32" in stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_measuring_the_matmul_peak_stays_short_where_the_cpu_emulates_the_dtype(dtype):
    """Where oneDNN has no kernel for the dtype, torch's reference kernel takes 15-40 s for a
    2048^2 matmul; the peak is measured on a smaller one. (An AVX-512 CPU without AVX512-BF16
    converts: about 2x fp32's time, so its matrix may grow to 2048 within the time bound.)"""
    start = time.perf_counter()
    peaks = measure_peaks(torch.device("cpu"), dtype)
    assert time.perf_counter() - start < 10
    assert peaks.dtype == dtype and peaks.flops_per_s > 0 and peaks.bandwidth > 0
    if not onednn_has_kernel(dtype):
        assert peaks.matmul_size < 2048
    assert measure_peaks(torch.device("cpu"), dtype, seconds=0).matmul_size == 256


def test_bench_refuses_several_ranks():
    result = run_cli(["bench", "--config", "configs/demo.yaml"], nproc=2)
    assert result.returncode != 0
    assert "bench: runs in one process" in result.stderr


def test_train_throughput_launches_its_ranks_with_the_interpreter_alone(tmp_path, monkeypatch):
    """benchmarks/train_throughput.py where no torchrun script lies beside the interpreter (a
    TORCH=system venv has none): the ranks start through `python -m dlrm_hybrid.torchrun`."""
    script = load_script("benchmarks/train_throughput.py", "train_throughput_bench")
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(script.sys.executable)
    monkeypatch.setattr(script.sys, "executable", str(python))
    launched = []

    def run(cmd, **kwargs):
        launched.append(cmd)
        assert Path(cmd[0]).exists(), cmd[0]
        return subprocess.CompletedProcess(cmd, 0, "done: samples_per_s=1000\n", "")

    monkeypatch.setattr(script.subprocess, "run", run)
    assert script.samples_per_s("configs/demo.yaml", 2, 5) == 1000
    assert launched[0][1:4] == ["-m", "dlrm_hybrid.torchrun", "--standalone"]


def test_bench_table_reads_a_relative_config_from_where_it_is_run(tmp_path, monkeypatch,
                                                                     capsys):
    """benchmarks/bench_table.py --config my.yaml run in another folder: bench (started in the
    checkout's root) measures that file, not a namesake of the checkout or none."""
    script = load_script("benchmarks/bench_table.py", "bench_table_for_cwd")
    (tmp_path / "my.yaml").write_text((ROOT / "configs/demo.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    read = []

    def run(cmd, cwd, **kwargs):
        config = Path(cwd) / cmd[cmd.index("--config") + 1]
        read.append(config.read_text() if config.is_file() else None)
        out = ("step split | dense 1.0 (50%) |\nbench: precision=fp32 samples_per_s=2 "
               "baseline_samples_per_s=1 ratio=2 roofline_fraction=0.1 peak_mem_gib=0.1 cpu=x")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(script.subprocess, "run", run)
    monkeypatch.setattr("sys.argv", ["bench_table.py", "--config", "my.yaml", "--settings",
                                     "fp32"])
    script.main()
    assert read == [(tmp_path / "my.yaml").read_text()]


def test_loader_throughput_trains_on_a_relative_data_folder_or_says_why_not(tmp_path,
                                                                            monkeypatch):
    """benchmarks/loader_throughput.py --data DIR (relative, run elsewhere than the checkout):
    its training run reads that folder, and where training refuses it (here: fewer samples
    than a batch) the script ends with train's error line, not a CalledProcessError."""
    made = run_cli(["synth", "--config", "configs/demo.yaml", "--set", "data.train_samples=300",
                    "--set", "data.val_samples=100", "--output", str(tmp_path / "d")])
    assert made.returncode == 0, failure(made)
    script = load_script("benchmarks/loader_throughput.py", "loader_throughput_bench")
    monkeypatch.chdir(tmp_path)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):  # this process's group (an earlier test's): not its train's
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["loader_throughput.py", "--data", "d", "--batches", "2",
                                     "--train-steps", "2"])
    with pytest.raises(SystemExit) as stopped:
        script.main()
    assert str(stopped.value).startswith(f"train failed: error: {tmp_path / 'd'}: its training "
                                         "split holds 300 samples, fewer than one global batch")


def test_inference_benchmark_leaves_no_exports_behind(tmp_path, monkeypatch):
    """benchmarks/inference.py's trained demo and its four exports (for a large --checkpoint,
    twice its tables' bytes) are removed when it ends, however it ends."""
    script = load_script("benchmarks/inference.py", "inference_bench")
    monkeypatch.setattr(script.tempfile, "tempdir", str(tmp_path))

    def train_demo(run_dir, steps):
        run_dir.mkdir()
        (run_dir / "model.pt").write_bytes(b"x" * 1024)
        raise KeyboardInterrupt

    monkeypatch.setattr(script, "train_demo", train_demo)
    monkeypatch.setattr("sys.argv", ["inference.py", "--steps", "2"])
    with pytest.raises(KeyboardInterrupt):
        script.main()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind, peer", [("two_tower", "retrieval.py"),
                                        ("hstu", "sequential_speed.py")])
def test_bench_of_a_retrieval_config_names_its_own_benchmark(kind, peer):
    result = run_cli(["bench", "--config", f"configs/{kind}_demo.yaml"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: bench: measures the ranker (model.kind dlrm) against its baseline; for {kind} "
        f"use benchmarks/{peer}"]


def test_by_default_a_cpu_run_is_fp32_and_eager(tmp_path, process_group):
    """train.precision and train.cuda_graphs default to auto: bf16 with CUDA Graphs on a GPU
    (test_gpu.py checks that there), fp32 without graphs on a CPU, and no warning about it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        train(small_config(tmp_path, "train.max_steps=2"), process_group)
    first = read_metrics(tmp_path)[0]
    assert first["precision"] == "fp32" and first["cuda_graphs"] is False


def test_cuda_graphs_auto_is_on_where_a_gpu_step_can_be_captured():
    from dlrm_hybrid.train.cuda_graphs import graphs_wanted
    from test_model import make_model

    model, cuda, cpu = make_model("dot"), torch.device("cuda"), torch.device("cpu")
    assert graphs_wanted("auto", model, cuda) and not graphs_wanted("auto", model, cpu)
    assert graphs_wanted("true", model, cpu) and not graphs_wanted("false", model, cuda)
    model.exchange = "des"  # the owners' partial sums enter inside the dense part
    assert not graphs_wanted("auto", model, cuda)
    assert not graphs_wanted("auto", torch.nn.Linear(2, 2), cuda)  # no dense_loss: not a ranker
