"""Resuming: only the same experiment continues (what may change is listed in docs/checkpoints.md), a
finished run says so, and an fp16 run resumes with its loss scaler and fbgemm's step counter."""

import fcntl
import json
import os

import pytest
import torch

from conftest import ROOT, failure, read_metrics, run_cli
from shared_runs import DEMO_RUN, DEMO_STEPS, copy_of
from test_checkpoint_reader import rehash
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.errors import UserError
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


def test_an_fp16_run_resumes_with_its_loss_scaler(tmp_path, process_group, monkeypatch):
    """A large initial scale makes the first steps overflow: the checkpoint is taken after a
    skip, and the resumed run goes on with the halved scale and the count."""
    import torch

    class LargeInitialScale(torch.amp.GradScaler):
        def __init__(self, device: str = "cuda", **kwargs) -> None:
            super().__init__(device, **{"init_scale": 2.0**19, **kwargs})

    monkeypatch.setattr(torch.amp, "GradScaler", LargeInitialScale)
    fp16 = ["train.precision=fp16", "train.precision_fallback=false"]
    whole = train(config(tmp_path / "whole", *fp16, "train.max_steps=8"), process_group)
    train(config(tmp_path / "parts", *fp16, "train.max_steps=4"), process_group)
    resumed = train(config(tmp_path / "parts", *fp16, "train.max_steps=8"), process_group)
    assert resumed.losses == whole.losses[4:]
    expected = meta(tmp_path / "whole", 8)
    assert 1 <= meta(tmp_path / "parts", 4)["skipped_steps"] == expected["skipped_steps"] < 4
    # steps since the scale last moved
    assert expected["loss_scaler"]["_growth_tracker"] == 8 - expected["skipped_steps"]
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
    assert resume(cfg, step, MetricsLog(tmp_path, 0))[0] == 5
    kernels = [kernel._emb_module for lookup in dmp.module.embedding_bags._lookups
               for kernel in lookup._emb_modules]
    counters = [k.iter.item() for k in kernels
                if isinstance(k, SplitTableBatchedEmbeddingBagsCodegen)]
    assert counters and counters == [5] * len(counters)


def test_eval_of_a_checkpoint_trained_with_a_gpu_only_optimizer_runs_on_cpu(tmp_path,
                                                                           demo_checkpoint):
    """A GPU run's Adam checkpoint, evaluated on a CPU host (fbgemm's CPU build has no Adam)."""
    import yaml

    step = copy_of(demo_checkpoint, tmp_path / demo_checkpoint.name)
    saved = yaml.safe_load((step / "config.yaml").read_text())
    saved["optim"]["embedding"] = "adam"
    (step / "config.yaml").write_text(yaml.safe_dump(saved))
    rehash(step, "config.yaml")  # as that run recorded it
    result = run_cli(["eval", "--checkpoint", str(step), "--split", "val"])
    assert result.returncode == 0, failure(result)
    assert result.stdout.strip().splitlines()[-1].startswith(
        f"eval: checkpoint={step} step={DEMO_STEPS} ")
    assert torch.isfinite(torch.tensor(float(result.stdout.split("val_auc=")[1].split()[0])))


def resuming(checkpoint, run_dir, *overrides):
    """The shared demo run's settings (shared_runs.py), resuming its `checkpoint` into `run_dir`
    for one more step."""
    return load_config(str(ROOT / "configs/demo.yaml"), [
        *DEMO_RUN, f"train.max_steps={DEMO_STEPS + 1}", f"checkpoint.resume={checkpoint}",
        f"train.run_dir={run_dir}", *overrides])


@pytest.mark.parametrize("changes", [
    ["train.log_every=2", "train.eval_every=3", "train.progress_bar=true", "train.rank_logs=true",
     "train.precision=bf16", "train.pipeline=disabled", "train.target_auc=0.99",
     "data.prefetch=1", "parallel.memory_per_rank=4GiB", "parallel.strategy=nvidia",
     "parallel.comm_precision=bf16", "parallel.exchange=pooled", "checkpoint.keep=5",
     "checkpoint.every=1"],
    ["train.eval_every=0", "train.evals_per_epoch=2", "train.cuda_graphs=true",
     "train.precision_fallback=false", "data.loader=dali", "parallel.backend=gloo",
     "parallel.reserve_per_rank=1GiB"],
], ids=["run-and-parallel", "schedule-and-loader"])
def test_every_setting_the_resume_rules_allow_to_change_resumes(tmp_path, process_group,
                                                                demo_checkpoint, capsys, changes):
    """docs/checkpoints.md "Resume rules": the run directory, checkpoint folder and the keys above change at
    once, and the run continues from the checkpoint (train.mlperf_log: test_mlperf.py)."""
    capsys.readouterr()
    result = train(resuming(demo_checkpoint, tmp_path / "elsewhere",
                            f"checkpoint.dir={tmp_path / 'checkpoints'}", *changes), process_group)
    assert f"resumed from {demo_checkpoint} (step {DEMO_STEPS})" in \
        capsys.readouterr().out.splitlines()
    assert result.steps == DEMO_STEPS + 1
    assert (tmp_path / "checkpoints" / f"step_{DEMO_STEPS + 1}").exists()


def test_settings_of_the_experiment_are_refused_each_named(tmp_path, process_group,
                                                          demo_checkpoint):
    changes = {"model.top_mlp": ([64, 32, 1], [32, 1]), "optim.embedding_lr": (0.1, 0.2),
               "data.global_batch_size": (1024, 512), "data.shuffle": (False, True),
               "train.seed": (0, 1), "optim.warmup_steps": (20, 0)}
    with pytest.raises(ConfigError) as info:
        train(resuming(demo_checkpoint, tmp_path,
                       *[f"{key}={here}" for key, (_, here) in changes.items()]), process_group)
    named = str(info.value).split(" was trained with other settings: ")[1]
    for key, (there, here) in changes.items():
        assert f"{key} ({there!r} there, {here!r} here)" in named
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("overrides", [
    ["model.embedding_dim=32", "model.bottom_mlp=[64,32]"],  # a tensor of another size
    ["model.interaction=dhen"],  # tensors the checkpoint lacks (torch: a RuntimeError)
    ["model.compositional=[{technique: hash, features: [cat_0], buckets: 10}]"]])
def test_a_checkpoint_of_another_model_is_reported_as_such_not_as_corrupt(demo_checkpoint,
                                                                          process_group,
                                                                          overrides):
    from dlrm_hybrid.errors import DataError
    from dlrm_hybrid.train.inference import evaluate_checkpoint

    with pytest.raises(DataError) as info:
        evaluate_checkpoint(str(demo_checkpoint), None, overrides, process_group, "val")
    message = str(info.value)
    assert message.startswith(f"{demo_checkpoint}: does not fit this model (")
    assert message.endswith("it was trained with other model or table settings: use the config "
                            "it was written with")
    assert "corrupt" not in message


def synthetic_dataset(folder, *overrides):
    """A split-binary copy of small planted data, written to `folder`."""
    from dlrm_hybrid.data.synth_dataset import write_synthetic

    write_synthetic(load_config(str(ROOT / "configs/demo.yaml"), [
        "data.train_samples=4096", "data.val_samples=1024", *overrides]).data, str(folder))
    return folder


def test_the_same_dataset_under_another_path_resumes_and_another_dataset_is_refused(
        tmp_path, process_group):
    """A dataset is compared by its identity (feature spec, samples, file contents), not by the
    spelling of data.path; the synthetic data's keys do not apply to it."""
    import os
    import shutil

    from test_checkpoint import as_earlier_version

    data = synthetic_dataset(tmp_path / "data")
    run_dir = tmp_path / "run"

    def run(path, steps, *overrides):
        return train(config(run_dir, f"data.path={path}", f"train.max_steps={steps}",
                            *overrides), process_group).steps

    assert run(f"{data}/", 1) == 1
    assert run(os.path.relpath(data), 2, "data.seed=7", "data.val_samples=999",
               "data.cardinalities=[9,9,9,9,9,9,9,9]", "data.teacher_scale=3.0") == 2
    staged = tmp_path / "job_17" / "data"
    shutil.copytree(data, staged)
    assert run(staged, 3) == 3
    step_3 = run_dir / "checkpoints" / "step_3"

    other = synthetic_dataset(tmp_path / "other", "data.train_samples=5120")
    args = [a for o in [*COMMON, f"train.run_dir={run_dir}", f"data.path={other}",
                        "train.max_steps=4"] for a in ("--set", o)]
    result = run_cli(["train", "--config", "configs/demo.yaml", *args])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint.resume: {step_3} was trained with other settings: data.path "
        f"('{staged}' there, '{other}' here: another dataset, samples per split {{'test': 1024, "
        f"'train': 4096, 'validation': 1024}} there, {{'test': 1024, 'train': 5120, "
        f"'validation': 1024}} here); resume it with its own settings, or start anew with "
        f"checkpoint.resume=none or another train.run_dir"]
    shuffled = synthetic_dataset(tmp_path / "shuffled", "data.seed=99")
    with pytest.raises(ConfigError, match=r"another dataset, same shape, other file contents"):
        run(shuffled, 4)

    # An earlier version's checkpoint records no identity: the dataset at its path stands in.
    as_earlier_version(step_3)
    assert run(staged, 4) == 4  # nothing changed
    as_earlier_version(run_dir / "checkpoints" / "step_4")
    assert run(data, 5) == 5  # the same files under another path
    as_earlier_version(run_dir / "checkpoints" / "step_5")
    data.rename(tmp_path / "moved")
    with pytest.raises(ConfigError) as info:
        run(tmp_path / "moved", 6)
    assert str(info.value).split(": ", 2)[2].startswith(
        f"data.path ('{data}' there, '{tmp_path / 'moved'}' here; the checkpoint, from an "
        f"earlier version, records no dataset identity and there is no dataset at {data} to "
        f"compare: resume once with the dataset at {data}, and the checkpoints written then "
        f"record it)")


def test_a_fresh_run_sets_an_earlier_run_aside_and_prunes_only_its_own_checkpoints(
        tmp_path, process_group, capsys):
    """resume=none into a run directory holding another run: that run's files move aside (so a
    later resume=auto continues the new run), and pruning never removes another run's
    checkpoints."""
    root = tmp_path / "checkpoints"

    def run(steps, resume, *overrides):
        capsys.readouterr()
        train(config(tmp_path, f"train.max_steps={steps}", f"checkpoint.resume={resume}",
                     "checkpoint.every=1", "checkpoint.keep=2", *overrides), process_group)
        return capsys.readouterr().out.splitlines()

    run(3, "none")  # an earlier run: step_2 and step_3
    earlier_metrics = (tmp_path / "metrics.jsonl").read_text()
    out = run(1, "none")
    (aside,) = tmp_path.glob("earlier_run_*")
    assert f"{tmp_path} held an earlier run: moved its files to {aside}; this run starts " \
           f"afresh" in out
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_2", "step_3"]
    assert (aside / "metrics.jsonl").read_text() == earlier_metrics
    assert [e["step"] for e in read_metrics(tmp_path) if "loss" in e] == [1]

    assert f"resumed from {root / 'step_1'} (step 1)" in run(2, "auto")
    # The earlier run continued here: its checkpoints join this run's, which stay.
    run(5, aside / "checkpoints" / "step_3")
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2", "step_4", "step_5"]
    runs = {p.name: json.loads((p / "meta.json").read_text())["run"] for p in root.iterdir()}
    assert runs["step_1"] == runs["step_2"] != runs["step_4"] == runs["step_5"]


def test_a_run_directory_another_run_is_training_in_is_refused_untouched(tmp_path,
                                                                         process_group):
    """A job started twice, or started again while the ranks of a SIGKILLed torchrun still
    train: the second run neither moves the first one's files aside nor writes beside them."""
    train(config(tmp_path, "train.max_steps=2"), process_group)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    held = os.open(tmp_path, os.O_RDONLY)  # what the running job's rank 0 holds
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        for resume in ("none", "auto"):
            with pytest.raises(UserError) as info:
                train(config(tmp_path, "train.max_steps=4", f"checkpoint.resume={resume}"),
                      process_group)
            assert str(info.value) == (
                f"train.run_dir: {tmp_path} is in use by another training run; wait for it "
                f"to end (or stop its ranks), or use another train.run_dir")
    finally:
        os.close(held)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    train(config(tmp_path, "train.max_steps=4"), process_group)  # released: resumes
    assert [e["step"] for e in read_metrics(tmp_path) if "loss" in e] == [1, 2, 3, 4]

    shared = tmp_path / "checkpoints"  # another run directory, the same checkpoint.dir
    held = os.open(shared, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(UserError, match=f"^checkpoint.dir: {shared} is in use by another "
                                            f"training run; .* or use another checkpoint.dir$"):
            train(config(tmp_path / "other", "train.max_steps=2", "checkpoint.resume=none",
                         f"checkpoint.dir={shared}"), process_group)
    finally:
        os.close(held)
    assert sorted(p.name for p in shared.iterdir()) == ["step_2", "step_4"]
    here = tmp_path / "here"  # checkpoints in the run directory itself: one folder, one lock
    train(config(here, "train.max_steps=1", f"checkpoint.dir={here}/."), process_group)
    assert (here / "step_1").is_dir()


@pytest.mark.parametrize("where, problem", [("file", "is a file"),
                                             ("file/run", "cannot be made a folder")])
def test_a_run_directory_that_cannot_be_a_folder_is_one_named_error(tmp_path, process_group,
                                                                    where, problem):
    (tmp_path / "file").write_text("mine\n")
    with pytest.raises(UserError, match=f"^train.run_dir: {tmp_path / where} {problem}"):
        train(config(tmp_path / where, "train.max_steps=1"), process_group)
    assert (tmp_path / "file").read_text() == "mine\n"


def test_a_resumed_run_supersedes_the_records_of_the_steps_it_trains_again(tmp_path,
                                                                          process_group):
    """Killed after step 6 with its last checkpoint at step 4: the resumed run trains steps 5
    and 6 again, and metrics.jsonl holds one record of each step, the earlier ones kept inside a
    `resumed` record."""
    cfg = config(tmp_path, "train.max_steps=6", "checkpoint.every=2", "checkpoint.keep=3",
                 "train.eval_every=3", "train.rank_logs=true")
    train(cfg, process_group)
    earlier = read_metrics(tmp_path)
    import shutil
    shutil.rmtree(tmp_path / "checkpoints" / "step_6")  # as if killed before writing it
    train(cfg, process_group)
    events = read_metrics(tmp_path)
    assert [e["step"] for e in events if "loss" in e] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in events if "val_auc" in e] == [3, 6]
    (resumed,) = [e for e in events if e.get("resumed")]
    assert resumed["step"] == 4
    assert resumed["superseded"] == [e for e in earlier if e["step"] > 4]
    assert events[:events.index(resumed)] == [e for e in earlier if e["step"] <= 4]
    rank_steps = [json.loads(line).get("step") for line in
                  (tmp_path / "rank_0.jsonl").read_text().splitlines()]
    assert [s for s in rank_steps if s is not None] == [1, 2, 3, 4, 4, 5, 6]  # 4: `resumed`
