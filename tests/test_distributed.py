"""Real multi-process runs under torchrun with gloo: what `make demo` and users rely on."""

import pytest
import yaml

from conftest import done_fields, read_metrics, run_cli

EQUIVALENCE = ["train.max_steps=20", "train.log_every=1", "train.eval_every=0",
               "data.val_samples=8192", "train.progress_bar=false"]


def train_losses(tmp_path, nproc, optimizer):
    run_dir = tmp_path / f"{optimizer}-{nproc}"
    overrides = [*EQUIVALENCE, f"optim.embedding={optimizer}", f"train.run_dir={run_dir}"]
    result = run_cli(["train", "--config", "configs/demo.yaml",
                      *[arg for o in overrides for arg in ("--set", o)]], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    events = read_metrics(run_dir)
    return [e["loss"] for e in events if "loss" in e], done_fields(result.stdout)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_one_and_two_ranks_give_the_same_losses(tmp_path, optimizer):
    one, done_one = train_losses(tmp_path, 1, optimizer)
    two, done_two = train_losses(tmp_path, 2, optimizer)
    assert len(one) == len(two) == 20
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) / abs(a) < 1e-4, f"step {step}: 1 rank {a}, 2 ranks {b}"
    assert one[-1] < one[0]
    assert abs(done_one["val_auc"] - done_two["val_auc"]) < 1e-4


def test_demo_config_on_two_ranks_reaches_the_oracle(tmp_path):
    """`make demo`: 2 gloo ranks, the shipped config, within 0.02 AUC of the planted teacher."""
    result = run_cli(["train", "--config", "configs/demo.yaml", "--set",
                      f"train.run_dir={tmp_path}"], nproc=2, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    done = done_fields(result.stdout)
    assert done["steps"] == 3000 and done["samples_per_s"] > 0
    assert done["oracle_auc"] - done["val_auc"] < 0.02, result.stdout[-1000:]
    assert "rank 0:" in result.stdout and "rank 1:" in result.stdout  # the placement printout
    events = read_metrics(tmp_path)
    assert [e["step"] for e in events if "val_auc" in e] == [1000, 2000, 3000]
    assert len([e for e in events if "loss" in e]) == 3000 // 50
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 3000
