"""Checkpoints: exact resume after a killed rank (torchrun restarts it), resharding onto other
world sizes, atomic publication, the NaN guard and corrupt checkpoints."""

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import (ROOT, TORCHRUN, assert_eval_and_export_reproduce, done_fields, failure,
                      read_metrics, run_cli)
from shared_runs import DEMO_RUN, DEMO_STEPS, copy_of
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.synth_dataset import write_synthetic
from dlrm_hybrid.errors import DataError, TrainingDiverged
from dlrm_hybrid.train.loop import train

COMMON = ["checkpoint.resume=auto", "data.global_batch_size=768", "data.val_samples=2048",
          "train.log_every=1",
          "train.progress_bar=false", "optim.embedding=adagrad", "optim.embedding_lr=0.1"]


def sets(*overrides):
    return [arg for o in (*COMMON, *overrides) for arg in ("--set", o)]


def step_losses(run_dir):
    """{step: loss}, the last record of each step winning (a resumed run appends)."""
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if "loss" in e}


def assert_same_losses(got, expected, steps):
    for step in steps:
        assert abs(got[step] - expected[step]) <= 1e-4 * abs(expected[step]), step


def two_rank_args(run_dir, steps, every, embedding="adagrad"):
    return ["train", "--config", "configs/demo.yaml", *sets(
        f"optim.embedding={embedding}", f"train.max_steps={steps}", f"checkpoint.every={every}",
        f"train.run_dir={run_dir}")]


def two_rank_run(run_dir, steps, every, embedding="adagrad"):
    """An uninterrupted 2-rank run of `steps` steps, checkpointed every `every`: (its run
    directory, steps, every, its `done:` line's fields less samples_per_s)."""
    result = run_cli(two_rank_args(run_dir, steps, every, embedding), nproc=2)
    assert result.returncode == 0, failure(result)
    return run_dir, steps, every, finished(result.stdout)


def finished(stdout):
    """The `done:` line's fields, less the one that depends on the machine's speed."""
    done = done_fields(stdout)
    del done["samples_per_s"]
    return done


# The killed run's length: its kill lands after the first checkpoint with 80 steps to spare.
KILLED_STEPS, KILLED_EVERY = 100, 20


@pytest.fixture(scope="module")
def two_rank_adagrad(tmp_path_factory):
    """The uninterrupted 2-rank Adagrad run that the resharded resumes and the killed and
    restarted run must both reproduce (launches are the slow part: one serves both)."""
    return two_rank_run(tmp_path_factory.mktemp("two_rank") / "full", KILLED_STEPS, KILLED_EVERY)


@pytest.mark.parametrize("embedding", ["adagrad", "sgd"])
def test_a_two_rank_checkpoint_resumes_on_one_and_on_three_ranks(tmp_path, embedding, request):
    full, steps, every, _ = (request.getfixturevalue("two_rank_adagrad") if embedding == "adagrad"
                          else two_rank_run(tmp_path / "full", 12, 6, embedding))
    middle = full / "checkpoints" / f"step_{steps - every}"
    assert {p.name for p in (full / "checkpoints").iterdir()} == {middle.name, f"step_{steps}"}
    expected = step_losses(full)
    # Adagrad reshards onto 1 and 3 ranks; SGD (whose fused state has empty entries) onto 3.
    for nproc in (1, 3) if embedding == "adagrad" else (3,):
        run_dir = tmp_path / f"on{nproc}"
        result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
            f"optim.embedding={embedding}", f"train.max_steps={steps}",
            f"checkpoint.resume={middle}", f"train.run_dir={run_dir}")],
            nproc=nproc if nproc > 1 else 0)  # one rank: the plain process
        assert result.returncode == 0, failure(result)
        assert f"resumed from {middle} (step {steps - every})" in result.stdout
        assert sorted(step_losses(run_dir)) == list(range(steps - every + 1, steps + 1))
        assert_same_losses(step_losses(run_dir), expected, range(steps - every + 1, steps + 1))


def test_rowwise_adagrad_column_shards_that_cannot_reshard_say_why(tmp_path):
    """Row-wise Adagrad keeps a statistic per row of each column shard: a checkpoint whose table
    was split otherwise cannot load, and the error says so and how to resume (not "other
    model settings", which would send the user hunting for a config change)."""
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2",
                      "--out", str(tmp_path / "plan.json")])
    assert result.returncode == 0, failure(result)
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["tables"]["t_cat_0"].update(sharding="column_wise", ranks=[0, 1], columns=[8, 8])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    split = sets("optim.embedding=rowwise_adagrad", "train.max_steps=2",
                 f"train.run_dir={tmp_path / 'two'}", f"parallel.plan={tmp_path / 'plan.json'}")
    assert run_cli(["train", "--config", "configs/demo.yaml", *split], nproc=2).returncode == 0
    step_2 = tmp_path / "two" / "checkpoints" / "step_2"
    result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
        "optim.embedding=rowwise_adagrad", "train.max_steps=4", f"checkpoint.resume={step_2}",
        f"train.run_dir={tmp_path / 'one'}")])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {step_2}: table t_cat_0 is split into other column shards here than in the run "
        f"that wrote it, and row-wise Adagrad keeps one statistic per row of each shard, which "
        f"cannot be resharded; resume on that run's world size with its plan "
        f"(parallel.plan=<its run_dir>/plan.json)")


def test_a_killed_rank_restarts_and_resumes_with_identical_losses(tmp_path, two_rank_adagrad):
    """torchrun restarts both ranks and they resume from the last complete checkpoint. The
    uninterrupted reference is forked from the CLI zygote (tests/cli_zygote.py) as every run of
    the suite: up to the checkpoint it resumed from, this run is torchrun's own first attempt, so
    its losses equal the reference's exactly there, which is what shows that a 2-rank run forked
    from the zygote is the one torchrun starts."""
    clean, _, _, clean_done = two_rank_adagrad
    killed = tmp_path / "killed"
    job = subprocess.Popen(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m",
         "dlrm_hybrid", *two_rank_args(killed, KILLED_STEPS, KILLED_EVERY)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # torchrun's rendezvous store, shared with the workers by default, keeps the previous
        # attempt's gloo addresses: restarted workers then cannot connect (pytorch#135712).
        env={**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    deadline = time.time() + 120
    while not (killed / "checkpoints" / f"step_{KILLED_EVERY}").exists() and time.time() < deadline:
        time.sleep(0.05)
    workers = subprocess.run(["ps", "-o", "pid=", "--ppid", str(job.pid)], capture_output=True,
                             text=True).stdout.split()
    assert workers, "no worker processes to kill"
    subprocess.run(["kill", "-9", workers[-1]])
    out, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert "resumed from" in out
    done = finished(out)  # the last line printed, as the forked run's
    assert done == pytest.approx(clean_done, rel=1e-4) and done["steps"] == KILLED_STEPS
    resumed_at = int(out.split("resumed from")[1].split("(step ")[1].split(")")[0])
    assert resumed_at >= KILLED_EVERY
    got, want = step_losses(killed), step_losses(clean)
    first_attempt = range(1, resumed_at + 1)
    assert [got[s] for s in first_attempt] == [want[s] for s in first_attempt]
    assert_same_losses(got, want, range(resumed_at + 1, KILLED_STEPS + 1))


def test_a_run_interrupted_while_writing_a_checkpoint_resumes_from_the_one_before(
        tmp_path, process_group, monkeypatch):
    import dlrm_hybrid.train.checkpoint as checkpoint

    def run(steps):
        cfg = load_config(str(ROOT / "configs/demo.yaml"), [
            *COMMON, f"train.max_steps={steps}", "checkpoint.every=2", f"train.run_dir={tmp_path}"])
        return train(cfg, process_group)

    clean = run(6).losses
    shutil.rmtree(tmp_path)
    real_save = checkpoint.dcp.save

    def dies_writing_step_4(state, checkpoint_id):
        written = real_save(state, checkpoint_id=checkpoint_id)  # on disk, not yet published
        if checkpoint_id.name == ".step_4.partial":
            raise KeyboardInterrupt("killed while writing")
        return written

    monkeypatch.setattr(checkpoint.dcp, "save", dies_writing_step_4)
    with pytest.raises(KeyboardInterrupt):
        run(6)
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".step_4.partial", "step_2"]
    resumed = run(6)  # resume=auto: the newest complete checkpoint, step 2
    assert resumed.losses == clean[2:]


def as_earlier_version(checkpoint):
    """`checkpoint` as an earlier version wrote it: meta.json without run, digests or dataset."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    for key in ("run", "sha256", "dataset"):
        meta.pop(key, None)
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def damage(file):
    """64 bytes in the middle of `file` overwritten: same size, other content."""
    data = bytearray(file.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - b for b in data[middle:middle + 64])
    file.write_bytes(bytes(data))


def test_a_truncated_checkpoint_without_digests_is_a_one_line_error_naming_it(
        tmp_path, process_group, capsys, demo_run):
    """An earlier version's checkpoint cannot be checked before it loads: used with a notice,
    and a truncated shard is still the load's one-line error."""
    run_dir = copy_of(demo_run, tmp_path / "run")
    step = run_dir / "checkpoints" / f"step_{DEMO_STEPS}"
    as_earlier_version(step)
    for shard in step.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        *DEMO_RUN, "checkpoint.resume=auto", f"train.max_steps={DEMO_STEPS + 1}",
        f"train.run_dir={run_dir}"])
    capsys.readouterr()
    with pytest.raises(DataError, match=f"{step}: cannot load checkpoint"):
        train(cfg, process_group)
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"note: {step} was written by an earlier version, without file digests, so its files "
        f"cannot be checked; checkpoints written from now on carry them")


def test_a_damaged_checkpoint_is_refused_naming_the_file_and_auto_resumes_the_one_before(
        tmp_path, process_group, capsys):
    from dlrm_hybrid.serve.export import export_model
    from dlrm_hybrid.train.inference import export_checkpoint

    def run(*overrides):
        return train(load_config(str(ROOT / "configs/demo.yaml"), [
            *COMMON, "checkpoint.every=2", f"train.run_dir={tmp_path}", *overrides]),
            process_group)

    clean = run("train.max_steps=4").losses
    root = tmp_path / "checkpoints"
    step_2, step_4 = root / "step_2", root / "step_4"
    (shard,) = step_4.glob("*.distcp")
    size = shard.stat().st_size
    damage(shard)
    damaged_bytes = shard.read_bytes()
    assert len(damaged_bytes) == size
    refused = (f"{shard} is damaged: its SHA-256 is not the one recorded when the checkpoint was "
               f"written")

    result = run_cli(["eval", "--checkpoint", str(step_4), "--split", "val"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {refused}; use another checkpoint"]
    for export in (lambda: export_checkpoint(str(step_4), str(tmp_path / "m.pt")),
                   lambda: export_model(str(step_4), str(tmp_path / "m.pt"))):
        with pytest.raises(DataError) as error:
            export()
        assert str(error.value) == f"{refused}; use another checkpoint"
    assert not (tmp_path / "m.pt").exists()
    with pytest.raises(DataError) as error:
        run("train.max_steps=6", f"checkpoint.resume={step_4}")
    assert str(error.value) == (f"checkpoint.resume: {refused}; resume from an older "
                                f"checkpoint")

    capsys.readouterr()
    resumed = run("train.max_steps=4")  # auto: the newest intact checkpoint
    out = capsys.readouterr().out.splitlines()
    assert f"checkpoint.resume: {refused}; renamed step_4 to step_4.damaged, trying the " \
           f"checkpoint before it" in out
    assert f"resumed from {step_2} (step 2)" in out
    assert resumed.losses == clean[2:]
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4", "step_4.damaged"]
    assert (root / "step_4.damaged" / shard.name).read_bytes() == damaged_bytes  # kept as found


def test_auto_passes_over_a_checkpoint_whose_meta_json_is_unreadable(tmp_path, process_group):
    from dlrm_hybrid.train.checkpoint import intact_checkpoint_to_resume

    cfg = load_config(str(ROOT / "configs/demo.yaml"), [*COMMON, f"train.run_dir={tmp_path}"])
    step_3 = tmp_path / "checkpoints" / "step_3"
    step_3.mkdir(parents=True)
    (step_3 / "meta.json").write_text('{"step": 3, "sha2')
    said = []
    assert intact_checkpoint_to_resume(cfg, said.append) is None
    assert said == [f"checkpoint.resume: {step_3 / 'meta.json'}: unreadable (JSONDecodeError); "
                    f"renamed step_3 to step_3.damaged, trying the checkpoint before it"]
    assert [p.name for p in step_3.parent.iterdir()] == ["step_3.damaged"]


def nan_from_batch(tmp_path, monkeypatch, batch, size=768):
    """A split-binary copy of the synthetic data whose training batches read NaN dense features
    from the `batch`-th global batch on (1-based): a loss that diverges at a known step. The NaN
    is put in after the reader, which refuses a file holding one."""
    data = tmp_path / "data"
    write_synthetic(load_config(None, ["data.train_samples=20000", "data.val_samples=1000"]).data,
                    str(data))
    read = SplitBinaryDataset.columns

    def columns(self, split, first, count):
        out = read(self, split, first, count)
        if split == "train":
            out.dense[np.arange(first, first + count) >= size * (batch - 1)] = np.nan
        return out

    monkeypatch.setattr(SplitBinaryDataset, "columns", columns)
    return data


def test_a_diverging_loss_stops_the_run_naming_the_last_good_checkpoint(tmp_path, process_group,
                                                                       monkeypatch):
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        *COMMON, f"data.path={nan_from_batch(tmp_path, monkeypatch, 5)}", "train.max_steps=10",
        "checkpoint.every=2", "train.log_every=2", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(TrainingDiverged) as info:
        train(cfg, process_group)
    assert str(info.value) == (
        f"the loss became nan between steps 5 and 6; the last good checkpoint is "
        f"{tmp_path / 'run' / 'checkpoints' / 'step_4'}: lower the learning rates and resume from it")


def all_finite(checkpoint) -> bool:
    import torch

    from dlrm_hybrid.train.inference import export_checkpoint

    export_checkpoint(str(checkpoint), str(checkpoint.parent.parent / "exported.pt"))
    state = torch.load(checkpoint.parent.parent / "exported.pt", weights_only=True)
    return all(torch.isfinite(t).all() for t in state.values())


def test_a_diverged_model_is_never_checkpointed_and_the_good_one_is_kept(tmp_path, process_group,
                                                                        monkeypatch):
    """Losses are checked every 10 steps, checkpoints written every 3 and only the newest kept:
    the NaN from step 5 on must not reach step_6, and step_3 must survive as the good one."""
    run = tmp_path / "run"
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        *COMMON, f"data.path={nan_from_batch(tmp_path, monkeypatch, 5)}", "train.max_steps=20",
        "checkpoint.every=3", "checkpoint.keep=1", "train.log_every=10", f"train.run_dir={run}"])
    with pytest.raises(TrainingDiverged) as info:
        train(cfg, process_group)
    assert str(info.value) == (
        f"the loss or the weights became non-finite between steps 4 and 6; the last good "
        f"checkpoint is {run / 'checkpoints' / 'step_3'}: lower the learning rates and resume "
        f"from it")
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_3"]
    assert all_finite(run / "checkpoints" / "step_3")


def test_a_run_diverging_before_its_first_checkpoint_publishes_none(tmp_path):
    run = tmp_path / "run"
    result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
        "optim.dense_lr=1e30", "optim.embedding_lr=1e30", "train.log_every=10",
        "checkpoint.every=3", "train.max_steps=20", f"train.run_dir={run}")])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the loss or the weights became non-finite between steps 1 and 3; no checkpoint "
        "was written: lower the learning rates")
    assert not list((run / "checkpoints").glob("step_*"))


def test_eval_and_export_reproduce_the_training_run(tmp_path, demo_run, demo_checkpoint):
    """`eval` scores a checkpoint like the run's own final evaluation; `export` gives one file
    that an unsharded model on one process loads strictly and scores the same."""
    final = [e for e in read_metrics(demo_run) if "val_auc" in e][-1]
    assert final["step"] == DEMO_STEPS
    assert_eval_and_export_reproduce(demo_checkpoint, final["val_auc"], tmp_path / "model.pt")

    bad = run_cli(["export", "--checkpoint", str(demo_run), "--out", str(tmp_path / "x.pt")])
    assert bad.returncode == 2 and "is not a complete checkpoint" in bad.stderr
    assert not (tmp_path / "x.pt").exists()


def test_a_checkpoint_that_does_not_exist_is_named_with_the_steps_that_do(tmp_path):
    """A mistyped step is said to not exist, beside the published steps (not a `.partial`, not
    one without meta.json); a run or checkpoints folder given instead gets its steps too."""
    root = tmp_path / "run" / "checkpoints"
    for name, published in (("step_500", True), ("step_1000", True), ("step_1500", False),
                            (".step_2500.partial", False)):
        (root / name).mkdir(parents=True)
        if published:
            (root / name / "meta.json").write_text("{}")
    steps = f"{root} holds step_500, step_1000: give one of them"
    for given, what in ((root / "step_2000", "does not exist"),
                        (root / "step_1000" / "meta.json", "is a file, not a checkpoint folder"),
                        (root / "step_1500", "is not a complete checkpoint (no meta.json)"),
                        (tmp_path / "run", "is not a complete checkpoint (no meta.json)")):
        result = run_cli(["eval", "--checkpoint", str(given)])
        assert result.returncode == 2 and result.stdout == ""
        assert result.stderr.strip().splitlines() == [f"error: --checkpoint: {given} {what}; "
                                                      + steps]
    result = run_cli(["train", "--set", f"checkpoint.resume={root / 'step_2000'}",
                      "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint.resume: {root / 'step_2000'} does not exist; {steps}, auto or none"]
    result = run_cli(["eval", "--checkpoint", str(tmp_path / "elsewhere" / "step_5")])
    assert result.stderr.strip().splitlines() == [
        f"error: --checkpoint: {tmp_path / 'elsewhere' / 'step_5'} does not exist, and no "
        f"checkpoint is published beside it; give a step_<n> folder of a run "
        f"(train.run_dir/checkpoints)"]
