"""The GPU path (NCCL, autocast, CUDA Graphs), each run as a user would; skipped without CUDA."""

import pytest
import torch

from conftest import failure, read_metrics, run_cli

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
COMMON = ["train.max_steps=40", "train.log_every=1", "train.eval_every=0",
          "data.val_samples=8192", "train.progress_bar=false", "parallel.backend=nccl"]


def gpu_losses(run_dir, *overrides):
    args = [*COMMON, f"train.run_dir={run_dir}", *overrides]
    result = run_cli(["train", "--config", "configs/demo.yaml",
                      *[a for o in args for a in ("--set", o)]])
    assert result.returncode == 0, failure(result)
    assert "train.cuda_graphs:" not in result.stderr, result.stderr[-2000:]  # no eager fallback
    return [e["loss"] for e in read_metrics(run_dir) if "loss" in e]


DHEN = ["model.interaction=dhen", "model.dhen.modules=[dot,self_attention,linear,dcn,conv]"]


@pytest.mark.parametrize("interaction", [[], DHEN], ids=["dot", "dhen"])
def test_cuda_graphs_replay_gives_the_eager_losses(tmp_path, interaction):
    eager = gpu_losses(tmp_path / "eager", *interaction)
    graphed = gpu_losses(tmp_path / "graphs", "train.cuda_graphs=true", *interaction)
    assert len(eager) == len(graphed) == 40
    for step, (a, b) in enumerate(zip(eager, graphed), start=1):
        assert abs(a - b) < 1e-3 * abs(a), f"step {step}: eager {a}, graphed {b}"


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_each_precision_with_cuda_graphs_trains(tmp_path, precision):
    losses = gpu_losses(tmp_path, f"train.precision={precision}", "train.cuda_graphs=true")
    assert sum(losses[-5:]) < sum(losses[:5])


def test_bench_on_gpu_reports_the_comparison(tmp_path):
    result = run_cli(["bench", "--config", "configs/demo.yaml", "--steps", "30", "--set",
                      "train.precision=bf16", "--set", "train.cuda_graphs=true", "--set",
                      "parallel.backend=nccl"])
    assert result.returncode == 0, failure(result)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("bench: precision=bf16 ") and "ratio=" in last


@pytest.mark.parametrize("dense", ["fsdp", "hsdp"])
def test_sharded_dense_layers_on_nccl_give_the_ddp_losses(tmp_path, dense):
    """FSDP2 over NCCL (one GPU here: a mesh of one rank still runs fully_shard's hooks)."""
    ddp = gpu_losses(tmp_path / "ddp", *DHEN)
    sharded = gpu_losses(tmp_path / dense, *DHEN, f"parallel.dense={dense}")
    for step, (a, b) in enumerate(zip(ddp, sharded), start=1):
        assert abs(a - b) < 1e-4 * abs(a), f"step {step}: ddp {a}, {dense} {b}"
