"""HSTU's attention memory: `plan`'s estimate against what autograd keeps for the model, whether a
rank's full-length batch fits, and `model.hstu.attention_chunk`, which computes the attention a
block of queries at a time and gives the very outputs and gradients."""

import sys
from pathlib import Path

import pytest
import torch

from conftest import failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.model.hstu import HSTU
from dlrm_hybrid.parallel.attention_memory import bytes_per_batch, bytes_per_sample

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from hstu_attention_memory import saved_bytes  # noqa: E402  (the benchmark's own counting)

SMALL = ["model.hstu.max_length=767", "model.hstu.layers=2", "model.hstu.heads=2",
         "model.embedding_dim=64", "model.hstu.attention_dim=16", "model.hstu.linear_dim=16",
         "model.hstu.dropout=0", "model.bottom_mlp=[16, 64]", "model.hstu.attention_chunk=0",
         "model.hstu.checkpoint_layers=false"]


@pytest.mark.parametrize("precision, autocast", [("fp32", False), ("bf16", True)])
def test_the_estimate_is_what_autograd_keeps_for_the_models_attention(precision, autocast):
    cfg = load_config("configs/mlperf_dlrmv4.yaml", SMALL)
    kept = saved_bytes(768, 2, 2, autocast)
    estimate = bytes_per_sample(cfg.model, precision) + bytes_per_batch(cfg.model)
    assert 0.9 * kept <= estimate <= 1.1 * kept
    blocks = load_config("configs/mlperf_dlrmv4.yaml", SMALL + ["model.hstu.attention_chunk=96"])
    kept_in_blocks = saved_bytes(768, 2, 2, autocast, chunk=96)
    per_sample = saved_bytes(768, 2, 2, autocast, batch=2) - kept
    per_sample_in_blocks = saved_bytes(768, 2, 2, autocast, batch=2, chunk=96) - kept_in_blocks
    assert per_sample_in_blocks < 0.2 * per_sample  # no [n, n] scores kept per sample
    assert kept_in_blocks <= bytes_per_sample(blocks.model, precision) + bytes_per_batch(
        blocks.model)  # what it keeps, plus the block it computes
    layers = load_config("configs/mlperf_dlrmv4.yaml", SMALL + [
        "model.hstu.attention_chunk=96", "model.hstu.checkpoint_layers=true"])
    kept_by_layers = saved_bytes(768, 2, 2, autocast, chunk=96, checkpoint_layers=True)
    per_sample_by_layers = saved_bytes(768, 2, 2, autocast, batch=2, chunk=96,
                                       checkpoint_layers=True) - kept_by_layers
    assert per_sample_by_layers < 0.5 * per_sample_in_blocks  # the layers' inputs only
    assert per_sample_by_layers <= bytes_per_sample(layers.model, precision)


@pytest.mark.parametrize("memory, fit", [("80GiB", 29), ("141GiB", 56)])
def test_plan_says_a_full_length_dlrmv4_batch_does_not_fit_and_what_would(memory, fit):
    result = run_cli(["plan", "--config", "configs/mlperf_dlrmv4.yaml", "--world-size", "8",
                      "--gpu-memory", memory, "--set", "model.hstu.attention_chunk=0", "--set",
                      "model.hstu.checkpoint_layers=false"])
    assert result.returncode == 0, failure(result)
    line = next(l for l in result.stdout.splitlines() if l.startswith("hstu attention"))
    assert "2.3GiB a sample (5 layers of 4 heads' [4,096, 4,096] scores kept" in line
    assert "at the local batch of 1,024" in line
    assert f"does NOT fit: at most {fit} full-length samples a rank fit" in line
    assert "set model.hstu.attention_chunk" in line


def test_in_blocks_64_ranks_fit_and_with_layers_recomputed_8_ranks_of_141_gib():
    blocks = run_cli(["plan", "--config", "configs/mlperf_dlrmv4.yaml", "--world-size", "64",
                      "--gpus-per-node", "8", "--gpu-memory", "80GiB", "--set",
                      "model.hstu.checkpoint_layers=false"])  # the config's blocks of 256
    assert blocks.returncode == 0, failure(blocks)
    line = next(l for l in blocks.stdout.splitlines() if l.startswith("hstu attention"))
    assert "326MiB a sample (one block of 256 queries x 4,096 keys" in line
    assert line.endswith("at the local batch of 128, 69.9GiB free on the fullest rank: fits")
    for memory, verdict in (("80GiB", "does NOT fit: at most 559 full-length samples"),
                            ("141GiB", "127.1GiB at the local batch of 1,024, 130.9GiB free on "
                                       "the fullest rank: fits")):
        config = run_cli(["plan", "--config", "configs/mlperf_dlrmv4.yaml", "--world-size", "8",
                          "--gpu-memory", memory])  # the config: blocks, layers recomputed
        assert config.returncode == 0, failure(config)
        line = next(l for l in config.stdout.splitlines() if l.startswith("hstu attention"))
        assert "126MiB a sample" in line and verdict in line


def test_a_model_without_hstu_has_no_line():
    plain = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2"])
    assert plain.returncode == 0 and "hstu attention" not in plain.stdout


@pytest.mark.parametrize("chunk, layers", [(1, False), (7, False), (32, False), (7, True),
                                           (0, True)])
def test_attention_in_blocks_and_layers_recomputed_give_the_same_outputs_and_gradients(
        chunk, layers):
    results = []
    for blocks, recomputed in ((0, False), (chunk, layers)):
        torch.manual_seed(0)
        model = HSTU(16, 40, 2, 2, 8, 8, 0.3, 16, blocks, recomputed)  # dropout: drawn alike
        torch.manual_seed(1)
        items = torch.randn(4, 33, 16, requires_grad=True)
        times = torch.cumsum(torch.rand(4, 33) * 1000, 1)
        torch.manual_seed(2)
        out = model(items, torch.tensor([33, 12, 1, 20]), times)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        results.append((out.detach(), items.grad, [p.grad for p in model.parameters()]))
    (out0, grad0, params0), (out1, grad1, params1) = results
    torch.testing.assert_close(out1, out0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad1, grad0, rtol=1e-5, atol=1e-7)
    for a, b in zip(params1, params0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    scripted = torch.jit.script(HSTU(16, 40, 2, 2, 8, 8, 0.3, 16, chunk, layers).eval())
    assert scripted(items.detach(), torch.tensor([33, 12, 1, 20]), times).shape == (4, 33, 16)
