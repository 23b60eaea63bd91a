"""The GPU path, each part run as a user runs it (the CLI, NCCL, autocast, CUDA Graphs, FSDP,
the models beside the DLRM, serving, Pixie); skipped without CUDA. benchmarks/gpu_check.sh runs
them on the GPU machine.

Equivalence runs train with dense SGD (shared_runs.EQUIVALENCE): Adagrad's first steps move each
weight by +-lr whatever its gradient's size, so the rounding of another kernel (a captured graph,
another reduction order, the CPU) would decide them, not the behaviour compared. Losses agree
within 1e-4 relative: the GPU's atomic-add kernels (cuDNN's weight gradients, attention's
backward) round differently from run to run, and a wrong gradient shows at 1e-2. One GPU holds
one NCCL rank (NCCL refuses two ranks on one device), so the models run as one-rank jobs here;
their 1-vs-2-rank equality is the gloo suite's."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import done_fields, failure, read_metrics, run_cli
from multitask_job import COMMON as MULTITASK, THREE
from shared_runs import EQUIVALENCE
from test_replicated import REPLICATED, write_plan
from two_tower_job import COMMON as TWO_TOWER

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
NCCL = ["parallel.backend=nccl"]
GLOO = ["parallel.backend=gloo"]  # CPU processes on a CUDA host
STEPS = 20  # EQUIVALENCE's
DHEN = ["model.interaction=dhen", "model.dhen.modules=[dot,self_attention,linear,dcn,conv]"]


def sets(*overrides):
    return [arg for o in overrides for arg in ("--set", o)]


def train(run_dir: Path, *overrides: str, config: str = "configs/demo.yaml",
          timeout: int = 300) -> list:
    """A `train` run's per-step losses; asserts it exited cleanly and that CUDA Graphs, when
    asked for, were not left for the eager fallback."""
    chosen = ["--config", config] if config else []  # none: the built-in defaults
    result = run_cli(["train", *chosen, *sets(*overrides, f"train.run_dir={run_dir}")],
                     timeout=timeout)
    assert result.returncode == 0, failure(result)
    assert "train.cuda_graphs:" not in result.stderr, result.stderr[-2000:]
    return [e["loss"] for e in read_metrics(run_dir) if "loss" in e]


def assert_close(got: list, want: list, tolerance: float, what: str) -> None:
    """Step by step within `tolerance` relative; the message lists every step of both."""
    assert len(got) == len(want) > 0, f"{what}: {len(got)} losses against {len(want)}"
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst < tolerance, (f"{what}: worst relative gap {worst:.2e} (allowed {tolerance})\n"
                               + "\n".join(f"step {i}: {a:.7f} {b:.7f}" for i, (a, b) in
                                           enumerate(zip(got, want), start=1)))


@pytest.mark.parametrize("interaction", [[], DHEN], ids=["dot", "dhen"])
def test_cuda_graphs_replay_gives_the_eager_losses(tmp_path, interaction):
    """20 steps: the graph is captured after 10 eager ones (cuda_graphs.WARMUP_STEPS)."""
    eager = train(tmp_path / "eager", *EQUIVALENCE, *NCCL, *interaction)
    graphed = train(tmp_path / "graphs", *EQUIVALENCE, *NCCL, *interaction,
                    "train.cuda_graphs=true")
    assert_close(graphed, eager, 1e-4, "graphed vs eager")


def test_the_gpu_trains_the_cpu_model_step_by_step(tmp_path):
    """fp32 on CUDA is fp32: no tf32 matmuls or convolutions (DHEN's conv included)."""
    gpu = train(tmp_path / "gpu", *EQUIVALENCE, *NCCL, *DHEN)
    cpu = train(tmp_path / "cpu", *EQUIVALENCE, *GLOO, *DHEN)
    assert_close(gpu, cpu, 1e-4, "cuda vs cpu")


def test_by_default_a_gpu_run_is_bf16_with_cuda_graphs(tmp_path):
    losses = train(tmp_path, "train.max_steps=15", "train.log_every=1", "train.eval_every=0",
                   "data.val_samples=8192", "train.progress_bar=false", *NCCL)
    first = read_metrics(tmp_path)[0]
    assert first["precision"] == "bf16" and first["cuda_graphs"] is True
    assert len(losses) == 15


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_each_precision_with_cuda_graphs_trains(tmp_path, precision):
    losses = train(tmp_path, "train.max_steps=40", "train.log_every=1", "train.eval_every=0",
                   "data.val_samples=8192", "train.progress_bar=false", *NCCL,
                   f"train.precision={precision}", "train.cuda_graphs=true")
    assert sum(losses[-5:]) < sum(losses[:5])


def test_bench_on_gpu_reports_the_comparison():
    result = run_cli(["bench", "--config", "configs/demo.yaml", "--steps", "30",
                      *sets("train.precision=bf16", "train.cuda_graphs=true", *NCCL)])
    assert result.returncode == 0, failure(result)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("bench: precision=bf16 ") and "ratio=" in last


@pytest.mark.parametrize("dense", ["fsdp", "hsdp"])
def test_sharded_dense_layers_on_nccl_give_the_ddp_losses(tmp_path, dense):
    """FSDP2 over NCCL (one GPU: a mesh of one rank still runs fully_shard's hooks)."""
    ddp = train(tmp_path / "ddp", *EQUIVALENCE, *NCCL, *DHEN)
    sharded = train(tmp_path / dense, *EQUIVALENCE, *NCCL, *DHEN, f"parallel.dense={dense}")
    assert_close(sharded, ddp, 1e-4, f"{dense} vs ddp")


def test_replicated_tables_under_cuda_graphs_give_the_eager_losses(tmp_path):
    """Tables data-parallel (test_replicated's plan: their gradient all-reduced, no
    all-to-all), the dense part captured."""
    plan = write_plan(tmp_path / "plan.json", 1, REPLICATED)
    replicated = [*EQUIVALENCE, *NCCL, f"parallel.plan={plan}"]
    eager = train(tmp_path / "eager", *replicated)
    graphed = train(tmp_path / "graphs", *replicated, "train.cuda_graphs=true")
    assert_close(graphed, eager, 1e-4, "replicated, graphed vs eager")
    used = json.loads((tmp_path / "graphs" / "plan.json").read_text())["tables"]
    assert sorted(n for n, t in used.items() if t["sharding"] == "data_parallel") == \
        sorted(REPLICATED)


@pytest.mark.parametrize("model", ["two_tower", "multitask"])
def test_the_other_models_train_on_cuda_as_on_cpu(tmp_path, model):
    """The two-tower model (its in-batch softmax over the global batch, on NCCL) and the
    multi-task ranker, 10 steps on CUDA against the same run on CPU."""
    common = [*(TWO_TOWER if model == "two_tower" else [*MULTITASK, *THREE]),
              "train.precision=fp32", "train.cuda_graphs=false"]  # the CPU's defaults
    gpu = train(tmp_path / "gpu", *common, *NCCL, config="")
    cpu = train(tmp_path / "cpu", *common, *GLOO, config="")
    assert_close(gpu, cpu, 1e-4, f"{model}: cuda vs cpu")


def test_export_int8_then_predict_on_a_cuda_host(tmp_path):
    """A model trained on CUDA from a split-binary dataset, exported at fp32 and int8: predict
    scores the validation split as `eval` does (fp32) and within int8's tolerance of it."""
    data = tmp_path / "data"
    small = ["data.train_samples=40960", "data.val_samples=8192"]
    made = run_cli(["synth", "--config", "configs/demo.yaml", "--output", str(data), *sets(*small)])
    assert made.returncode == 0, failure(made)
    train(tmp_path / "run", *NCCL, f"data.path={data}", "train.max_steps=40",
          "train.eval_every=0", "train.progress_bar=false")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_40"
    evaluated = run_cli(["eval", "--checkpoint", str(checkpoint), "--split", "val"])
    assert evaluated.returncode == 0, failure(evaluated)
    eval_auc = float(evaluated.stdout.split("auc=")[1].split()[0])
    scores = {}
    for quantize in ("fp32", "int8"):
        model = tmp_path / f"{quantize}.pt"
        exported = run_cli(["export", "--checkpoint", str(checkpoint), "--out", str(model),
                            "--quantize", quantize])
        assert exported.returncode == 0, failure(exported)
        out = tmp_path / f"{quantize}.txt"
        predicted = run_cli(["predict", "--model", str(model), "--data", str(data), "--split",
                             "val", "--out", str(out)])
        assert predicted.returncode == 0, failure(predicted)
        scores[quantize] = np.loadtxt(out)
        if quantize == "fp32":
            predict_auc = float(predicted.stdout.split("auc=")[1].split()[0])
            assert abs(predict_auc - eval_auc) < 1e-4, (predict_auc, eval_auc)
    assert len(scores["int8"]) == len(scores["fp32"]) == 8192
    assert np.abs(scores["int8"] - scores["fp32"]).max() < 3.5e-3  # test_serving's tolerance


def test_pixie_walks_on_cuda_follow_the_cpu_walks_distribution():
    """The same walk on the GPU (its own random numbers): both within the walk tests' total
    variation of the exact restart distribution, and of each other."""
    from test_pixie_walk import TV_TOLERANCE, exact_visits, random_graph, total_variation, \
        walk_counts
    from dlrm_hybrid.graph.pixie import PixieParams, PixieWalker

    graph, query = random_graph(), 5
    exact = exact_visits(graph, query, 0.5)
    cpu, _ = walk_counts(graph, [query])
    settings = dict(steps=200_000, walkers=256, early_stop_candidates=0, boost=False, seed=0)
    result = PixieWalker(graph, "cuda").walk([query], None, PixieParams(**settings),
                                             keep_queries=True)
    gpu = np.zeros(graph.items)
    gpu[result.items] = result.scores
    assert gpu.sum() == cpu.sum() == 200_000
    assert total_variation(gpu, exact) < TV_TOLERANCE
    assert 0.5 * np.abs(gpu / gpu.sum() - cpu / cpu.sum()).sum() < TV_TOLERANCE


FL15 = "configs/criteo_1tb_fl15.yaml"


def test_train_reads_an_fl15_shaped_split_binary_dataset(tmp_path):
    """The Criteo 1TB FL15 model's shapes (26 tables up to 8.2M rows, dim 128, global batch
    65,536) trained from files on disk with bf16 and CUDA Graphs: every step's batch read,
    copied and trained, the validation split evaluated."""
    data = tmp_path / "data"
    size = ["data.train_samples=655360", "data.val_samples=65536"]  # 10 steps
    made = run_cli(["synth", "--config", FL15, "--output", str(data), *sets(*size)], timeout=600)
    assert made.returncode == 0, failure(made)
    result = run_cli(["train", "--config", FL15, *sets(
        f"data.path={data}", f"train.run_dir={tmp_path / 'run'}", "train.max_steps=10",
        "train.log_every=5", "train.eval_every=0", "train.progress_bar=false",
        "train.precision=bf16", "train.cuda_graphs=true", "checkpoint.resume=none", *NCCL)],
        timeout=600)
    assert result.returncode == 0, failure(result)
    done = done_fields(result.stdout)
    assert done["steps"] == 10 and np.isfinite(done["train_loss"]) and 0.4 < done["val_auc"] < 1
