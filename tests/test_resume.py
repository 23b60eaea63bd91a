"""Resuming: only the same experiment continues (what may change is listed in the README), a
finished run says so, and an fp16 run resumes with its loss scaler and fbgemm's step counter."""

import json

import pytest
import torch

from conftest import ROOT, failure, read_metrics, run_cli
from dlrm_hybrid.config import ConfigError, load_config
from dlrm_hybrid.train.loop import train

COMMON = ["checkpoint.resume=auto", "data.global_batch_size=256", "data.val_samples=2048",
          "train.log_every=1", "train.progress_bar=false"]


def config(run_dir, *overrides):
    return load_config(str(ROOT / "configs/demo.yaml"),
                       [*COMMON, f"train.run_dir={run_dir}", *overrides])


def test_resuming_under_other_settings_is_refused_naming_them(tmp_path, process_group):
    train(config(tmp_path, "train.max_steps=4"), process_group)
    step_4, saved = tmp_path / "checkpoints" / "step_4", (tmp_path / "config.yaml").read_text()
    events = read_metrics(tmp_path)
    with pytest.raises(ConfigError) as info:
        train(config(tmp_path, "train.max_steps=8", "optim.dense_lr=0.2"), process_group)
    assert str(info.value) == (
        f"checkpoint.resume: {step_4} was trained with other settings: optim.dense_lr (0.05 "
        f"there, 0.2 here); resume it with its own settings, or start anew with "
        f"checkpoint.resume=none or another train.run_dir")
    with pytest.raises(ConfigError, match=r"model\.embedding_dim \(16 there, 32 here\)"):
        train(config(tmp_path, "train.max_steps=8", "model.embedding_dim=32",
                     "model.bottom_mlp=[64,32]"), process_group)
    assert (tmp_path / "config.yaml").read_text() == saved  # nothing of the refused runs kept
    assert read_metrics(tmp_path) == events

    result = run_cli(["train", "--config", "configs/demo.yaml", *[
        a for o in [*COMMON, f"train.run_dir={tmp_path}", "train.max_steps=8", "data.seed=7"]
        for a in ("--set", o)]])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint.resume: {step_4} was trained with other settings: data.seed (1234 "
        f"there, 7 here); resume it with its own settings, or start anew with "
        f"checkpoint.resume=none or another train.run_dir"]


def test_run_length_evaluation_and_parallel_settings_may_change(tmp_path, process_group):
    whole = train(config(tmp_path / "whole", "train.max_steps=8"), process_group)
    train(config(tmp_path / "parts", "train.max_steps=4"), process_group)
    resumed = train(config(tmp_path / "parts", "train.max_steps=8", "train.eval_every=3",
                           "checkpoint.keep=5", "parallel.memory_per_rank=4GiB",
                           "data.prefetch=2"), process_group)
    assert resumed.losses == whole.losses[4:]


def test_a_run_with_nothing_left_to_train_says_so(tmp_path, process_group, capsys):
    train(config(tmp_path, "train.max_steps=4"), process_group)
    events = read_metrics(tmp_path)
    capsys.readouterr()
    result = train(config(tmp_path, "train.max_steps=3"), process_group)
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "nothing left to train: the checkpoint is at step 4 and train.max_steps is 3; raise "
        "train.max_steps to train further, or start anew with checkpoint.resume=none or another "
        "train.run_dir")
    assert result.steps == 4 and result.losses == []
    assert read_metrics(tmp_path) == events


def meta(run_dir, step):
    return json.loads((run_dir / "checkpoints" / f"step_{step}" / "meta.json").read_text())


def test_an_fp16_run_resumes_with_its_loss_scaler(tmp_path, process_group):
    fp16 = ["train.precision=fp16", "train.precision_fallback=false"]
    whole = train(config(tmp_path / "whole", *fp16, "train.max_steps=8"), process_group)
    train(config(tmp_path / "parts", *fp16, "train.max_steps=4"), process_group)
    resumed = train(config(tmp_path / "parts", *fp16, "train.max_steps=8"), process_group)
    assert resumed.losses == whole.losses[4:]
    expected = meta(tmp_path / "whole", 8)
    assert expected["loss_scaler"]["_growth_tracker"] == 8  # steps since the scale last moved
    assert meta(tmp_path / "parts", 8)["loss_scaler"] == expected["loss_scaler"]
    assert meta(tmp_path / "parts", 8)["skipped_steps"] == expected["skipped_steps"]


def test_resume_restores_fbgemms_step_counter(tmp_path, process_group):
    """Adam's bias correction counts steps in the tables' `iter`, outside the optimizer state."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        SplitTableBatchedEmbeddingBagsCodegen)

    from dlrm_hybrid.data.source import open_dataset
    from dlrm_hybrid.train.loop import build_sharded_model, resume
    from dlrm_hybrid.train.metrics_log import MetricsLog
    from dlrm_hybrid.train.optim import build_optimizer
    from dlrm_hybrid.train.step import TrainStep

    cfg = config(tmp_path, "train.max_steps=5")
    train(cfg, process_group)
    dmp, _ = build_sharded_model(cfg, open_dataset(cfg.data).spec, process_group, lambda _: None)
    step = TrainStep(dmp, *build_optimizer(dmp, cfg.optim), cfg.train, process_group.device)
    assert resume(cfg, step, MetricsLog(tmp_path, 0)) == 5
    kernels = [kernel._emb_module for lookup in dmp.module.embedding_bags._lookups
               for kernel in lookup._emb_modules]
    counters = [k.iter.item() for k in kernels
                if isinstance(k, SplitTableBatchedEmbeddingBagsCodegen)]
    assert counters and counters == [5] * len(counters)


def test_eval_of_a_checkpoint_trained_with_a_gpu_only_optimizer_runs_on_cpu(tmp_path,
                                                                           process_group):
    """A GPU run's Adam checkpoint, evaluated on a CPU host (fbgemm's CPU build has no Adam)."""
    import yaml

    train(config(tmp_path, "train.max_steps=2", "optim.embedding=sgd"), process_group)
    step = tmp_path / "checkpoints" / "step_2"
    saved = yaml.safe_load((step / "config.yaml").read_text())
    saved["optim"]["embedding"] = "adam"
    (step / "config.yaml").write_text(yaml.safe_dump(saved))
    result = run_cli(["eval", "--checkpoint", str(step), "--split", "val"])
    assert result.returncode == 0, failure(result)
    assert result.stdout.strip().splitlines()[-1].startswith(f"eval: checkpoint={step} step=2 ")
    assert torch.isfinite(torch.tensor(float(result.stdout.split("val_auc=")[1].split()[0])))
