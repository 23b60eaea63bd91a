"""`plan`'s HSTU attention line: the bytes autograd keeps per sample, as the model keeps them,
and whether a rank's local batch of full-length sequences fits beside its tables."""

import sys
from pathlib import Path

import pytest

from conftest import failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.parallel.attention_memory import bytes_per_sample

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from hstu_attention_memory import saved_bytes  # noqa: E402  (the benchmark's own counting)


@pytest.mark.parametrize("precision, autocast", [("fp32", False), ("bf16", True)])
def test_the_estimate_is_what_autograd_keeps_for_the_models_attention(precision, autocast):
    cfg = load_config("configs/mlperf_dlrmv4.yaml", ["model.hstu.max_length=767",
                                                    "model.hstu.layers=2", "model.hstu.heads=2"])
    kept = saved_bytes(768, 2, 2, autocast)  # width 64: the n-wide part is small beside n^2
    assert 0.9 * kept <= bytes_per_sample(cfg.model, precision) <= 1.1 * kept


@pytest.mark.parametrize("memory, fit", [("80GiB", 25), ("141GiB", 47)])
def test_plan_says_a_full_length_dlrmv4_batch_does_not_fit_and_what_would(memory, fit):
    result = run_cli(["plan", "--config", "configs/mlperf_dlrmv4.yaml", "--world-size", "8",
                      "--gpu-memory", memory])
    assert result.returncode == 0, failure(result)
    line = next(l for l in result.stdout.splitlines() if l.startswith("hstu attention"))
    assert "2.8GiB a sample (5 layers of 4 heads' [4,096, 4,096] scores kept" in line
    assert "2,829.6GiB at the local batch of 1,024" in line
    assert f"does NOT fit: at most {fit} full-length samples a rank fit" in line


def test_a_short_history_fits_and_a_model_without_hstu_has_no_line():
    short = run_cli(["plan", "--config", "configs/mlperf_dlrmv4.yaml", "--world-size", "8",
                     "--gpu-memory", "80GiB", "--set", "model.hstu.max_length=127"])
    assert short.returncode == 0, failure(short)
    assert "hstu attention activations (sequences of 128 positions" in short.stdout
    assert ": fits" in short.stdout
    plain = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2"])
    assert plain.returncode == 0 and "hstu attention" not in plain.stdout
