"""Training in one process (a gloo group of one): LR schedule, optimizers, run-directory output."""

from pathlib import Path

import pytest
import torch
import yaml

from conftest import ROOT, read_metrics
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.source import open_dataset
from dlrm_hybrid.train.inference import read_model_state
from dlrm_hybrid.train.loop import build_sharded_model, train
from dlrm_hybrid.train.optim import lr_factor

SMALL = ["train.progress_bar=false", "data.val_samples=2048", "data.global_batch_size=256",
         "train.log_every=1"]


def small_config(tmp_path: Path, *overrides: str):
    return load_config(str(ROOT / "configs/demo.yaml"),
                       [*SMALL, f"train.run_dir={tmp_path}", *overrides])


def test_lr_schedule_warms_up_holds_and_decays():
    cfg = load_config(None, ["optim.warmup_steps=4", "optim.decay_start_step=10",
                             "optim.decay_steps=10", "optim.decay_power=2",
                             "optim.decay_end_factor=0.1"]).optim
    assert [lr_factor(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(9, cfg) == 1.0
    assert lr_factor(15, cfg) == pytest.approx(0.1 + 0.9 * 0.25)
    assert lr_factor(20, cfg) == lr_factor(99, cfg) == pytest.approx(0.1)


def test_embedding_updates_follow_the_schedule(tmp_path, process_group):
    # One batch per epoch, and every LR scheduled to 0 after the first step: from step 2 on
    # nothing may change, which fails if the fused embedding optimizer lags the schedule.
    cfg = small_config(tmp_path, "data.train_samples=256", "optim.warmup_steps=0", "optim.decay_start_step=0",
                       "optim.decay_steps=1", "train.max_steps=4", "optim.embedding=sgd",
                       "optim.embedding_lr=5.0")
    losses = train(cfg, process_group).losses
    assert losses[0] != losses[1]
    assert losses[1] == losses[2] == losses[3]


@pytest.mark.parametrize("embedding", ["sgd", "rowwise_adagrad", "adagrad"])
def test_each_cpu_embedding_optimizer_lowers_the_loss(tmp_path, process_group, embedding):
    cfg = small_config(tmp_path, f"optim.embedding={embedding}", "train.max_steps=60",
                       "train.log_every=20")
    result = train(cfg, process_group)
    assert result.losses[-1] < result.losses[0]
    assert 0.5 < result.metrics["val_auc"] <= 1.0
    # the MLPs alone lower the loss: the rows of every table must have moved too (94-100% do)
    initial, _ = build_sharded_model(cfg, open_dataset(cfg.data).spec, process_group,
                                     lambda line: None)
    before = {name: tensor.local_shards()[0].tensor for name, tensor in initial.state_dict().items()
              if ".embedding_bags." in name}
    after = read_model_state(tmp_path / "checkpoints/step_60")
    assert len(before) == len(cfg.data.cardinalities)
    for name, weight in before.items():
        moved = (after[name] - weight).abs().amax(dim=1) > 0
        assert moved.float().mean() > 0.6, f"{name}: {moved.sum()} of {len(moved)} rows moved"


def test_adam_embeddings_on_cpu_is_a_clear_error(tmp_path, process_group):
    cfg = small_config(tmp_path, "optim.embedding=adam", "optim.embedding_lr=0.01")
    with pytest.raises(ConfigError, match="optim.embedding: adam"):
        train(cfg, process_group)


def test_run_dir_gets_resolved_config_and_metrics(tmp_path, process_group):
    cfg = small_config(tmp_path, "train.max_steps=6", "train.log_every=2", "train.eval_every=3")
    train(cfg, process_group)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == 6 and saved["data"]["global_batch_size"] == 256
    assert load_config(str(tmp_path / "config.yaml")).to_dict() == cfg.to_dict()
    events = read_metrics(tmp_path)
    assert [e["step"] for e in events if "loss" in e] == [2, 4, 6]
    evals = [e for e in events if "val_auc" in e]
    assert [e["step"] for e in evals] == [3, 6]
    assert all({"val_auc", "val_logloss", "oracle_auc"} <= set(e) for e in evals)


@pytest.mark.parametrize("name", ["criteo_1tb_fl15", "mlperf_dcnv2"])
def test_large_configs_train_on_synthetic_data_of_their_shape(tmp_path, process_group, name):
    """The shipped Criteo-scale configs, with table rows capped so they fit a CI machine:
    dims, MLPs, interaction, multi-hot lookups and optimizers are the configs' own."""
    full = load_config(str(ROOT / f"configs/{name}.yaml"))
    capped = [min(rows, 2000) for rows in full.data.cardinalities]
    cfg = load_config(str(ROOT / f"configs/{name}.yaml"), [
        f"data.cardinalities={capped}", "data.global_batch_size=128", "data.val_samples=256",
        "train.max_steps=3", "train.log_every=1", "train.progress_bar=false",
        f"train.run_dir={tmp_path}"])
    result = train(cfg, process_group)
    assert len(result.losses) == 3 and all(0 < loss < 5 for loss in result.losses)
    assert 0 <= result.metrics["val_auc"] <= 1


def test_a_dataset_with_an_empty_validation_split_stops_training_at_start(tmp_path):
    """Not a `torch.cat(): expected a non-empty list` traceback at the first evaluation."""
    from conftest import run_cli
    from dlrm_hybrid.data.synth_dataset import write_synthetic

    data = tmp_path / "data"
    write_synthetic(load_config(None, ["data.train_samples=4096", "data.val_samples=256"]).data,
                    str(data))
    for column in (data / "validation").iterdir():
        column.write_bytes(b"")
    result = run_cli(["train", "--set", f"data.path={data}", "--set", "train.max_steps=2",
                      "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {data}: the validation split has no samples and training reads it; preprocess "
        f"again with rows for it (Criteo day files: include day_23, or use --split hash)"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_data_smaller_than_one_global_batch_stops_before_anything_is_written(tmp_path):
    """Before the plan is printed and before the run folder is made or an earlier run in it set
    aside: one line with the dataset's count and the key to lower."""
    from conftest import run_cli
    from dlrm_hybrid.data.synth_dataset import write_synthetic

    data, earlier, fresh = tmp_path / "data", tmp_path / "earlier", tmp_path / "fresh"
    write_synthetic(load_config(None, ["data.train_samples=500", "data.val_samples=64"]).data,
                    str(data))
    earlier.mkdir()
    (earlier / "metrics.jsonl").write_text('{"step": 5, "loss": 0.5}\n')
    result = run_cli(["train", "--set", f"data.path={data}", "--set", "train.max_steps=2",
                      "--set", "data.global_batch_size=1024", "--set", f"train.run_dir={earlier}"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"error: {data}: its training split holds 500 samples, fewer than one global batch "
        f"(data.global_batch_size=1024); lower data.global_batch_size to at most 500, or train "
        f"on more data"]
    assert [p.name for p in earlier.iterdir()] == ["metrics.jsonl"]
    assert (earlier / "metrics.jsonl").read_text() == '{"step": 5, "loss": 0.5}\n'
    result = run_cli(["train", "--set", "data.train_samples=500", "--set", "train.max_steps=2",
                      "--set", "data.global_batch_size=1024", "--set", f"train.run_dir={fresh}"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: synthetic data: data.train_samples=500 is fewer than one global batch "
        "(data.global_batch_size=1024); lower data.global_batch_size to at most 500, or raise "
        "data.train_samples"]
    assert not fresh.exists()


def test_auc_of_a_one_class_split_is_reported_undefined_not_zero(tmp_path, process_group):
    """200 real Criteo rows give ~6 validation rows, sometimes all non-clicks."""
    import math
    import warnings

    from dlrm_hybrid.data.synth_dataset import write_synthetic

    data = tmp_path / "data"
    write_synthetic(load_config(None, ["data.train_samples=4096", "data.val_samples=6"]).data,
                    str(data))
    (data / "validation" / "label.bin").write_bytes(bytes(6))  # six non-clicks
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(small_config(tmp_path, f"data.path={data}", "train.max_steps=2"),
                       process_group)
    assert [str(w.message) for w in caught if "undefined" in str(w.message)] == [
        f"{name}: undefined (nan): all 6 samples of the split are non-clicks; evaluate on a "
        f"split with both" for name in ("val_auc", "oracle_auc")]
    assert math.isnan(result.metrics["val_auc"])
    assert math.isfinite(result.metrics["val_logloss"])


def test_auc_of_scores_with_a_nan_is_reported_undefined_not_a_number():
    """A nan or inf among a split's dense values scores nan: the AUC sorted it anywhere and
    printed a plausible value beside val_logloss=nan."""
    import math

    from dlrm_hybrid.train.evaluate import auc_or_nan

    with pytest.warns(UserWarning, match=r"^val_auc: undefined \(nan\): 1 of 4 samples scored "
                                         r"nan \(a nan or inf among their dense values\?\)$"):
        auc = auc_or_nan(torch.tensor([0.1, math.nan, 0.8, 0.3]), torch.tensor([0., 1, 1, 0]),
                         "val_auc")
    assert math.isnan(auc)


def test_auc_is_torchmetrics_binary_auroc_ties_included():
    """The validation AUC (train/evaluate.py's own, without torchmetrics' import) is the value
    torchmetrics' binary_auroc gives: tied scores, unbalanced classes, two samples."""
    from torchmetrics.functional.classification import binary_auroc as reference

    from dlrm_hybrid.train.evaluate import binary_auroc

    generator = torch.Generator().manual_seed(0)
    cases = [(torch.tensor([0.3, 0.7]), torch.tensor([1, 0])),
             (torch.tensor([0.5, 0.5, 0.5, 0.2]), torch.tensor([1, 0, 0, 1]))]
    for size, levels in ((50, 4), (3000, 30), (3000, 0)):
        scores = torch.rand(size, generator=generator)
        scores = (scores * levels).round() / levels if levels else scores  # ties, or none
        cases.append((scores, (torch.rand(size, generator=generator) < 0.1).long()))
    for scores, labels in cases:
        assert binary_auroc(scores, labels).item() == reference(scores, labels).item()
    assert binary_auroc(torch.tensor([0.9, 0.1]), torch.tensor([1, 0])).item() == 1.0


def test_a_shuffled_epoch_is_ordered_by_train_seed(tmp_path, process_group, monkeypatch):
    """data.shuffle: each epoch's global batches in a permutation seeded by (train.seed, epoch).
    Training hands its loader train.seed, and with seed 3 (8 batches an epoch) that loader
    yields the batches in the order pinned here (numpy's default_rng([3, epoch]))."""
    from dlrm_hybrid.train import loop

    seeds, make_loader = [], loop.make_loader

    def recording(data_cfg, dataset, split, env, seed=0, **kwargs):
        seeds.append((split, seed))
        return make_loader(data_cfg, dataset, split, env, seed, **kwargs)

    monkeypatch.setattr(loop, "make_loader", recording)
    cfg = small_config(tmp_path, "data.shuffle=true", "train.seed=3", "data.train_samples=2048",
                       "train.max_steps=2")
    train(cfg, process_group)
    assert ("train", 3) in seeds
    dataset = open_dataset(cfg.data)
    loader = make_loader(cfg.data, dataset, "train", process_group, 3)
    firsts = [next(loader).dense[0] for _ in range(16)]
    loader.close()
    order = [6, 7, 2, 1, 4, 5, 3, 0] + [2, 1, 4, 0, 5, 7, 6, 3]  # epochs 0 and 1
    assert all(torch.equal(row, dataset.batch("train", b * 256, 1).dense[0])
               for row, b in zip(firsts, order))
