"""`parallel.dense`: ddp, fsdp and hsdp (FSDP2) train the same model, really shard it, and
write checkpoints that load under another mode on another world size (real gloo ranks)."""

import json

import pytest

from conftest import (ROOT, assert_eval_and_export_reproduce, done_fields, failure, read_metrics,
                      run_cli)

MODES = ("ddp", "fsdp", "hsdp")
NEXT = {"ddp": "fsdp", "fsdp": "hsdp", "hsdp": "ddp"}  # dense_sharding_job.py's resume cycle


def run_job(out, nproc: int, *flags: str) -> dict:
    out.mkdir()
    result = run_cli([str(out), *flags], nproc=nproc, script=ROOT / "tests/dense_sharding_job.py")
    assert result.returncode == 0, failure(result)
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{world size: the job's result}: 4 ranks train each mode with Adagrad and checkpoint it
    at step 2; 2 ranks train each with SGD and resume those checkpoints in the next mode; 1
    rank (no torchrun) trains each with both."""
    root = tmp_path_factory.mktemp("dense")
    four = run_job(root / "4", 4, "--save")
    return {4: four, 2: run_job(root / "2", 2, "--resume", str(root / "4")),
            1: run_job(root / "1", 0)}


def assert_same(a, b, label):
    assert len(a) == len(b) > 0, label
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-5 * abs(x), f"{label}: step {step}: {x} vs {y}"


def test_every_mode_trains_the_same_model_on_every_world_size(jobs):
    """Per-step losses of ddp, fsdp and hsdp (2x2 on 4 ranks, 1x2 on 2, 1x1 on 1) within 1e-5
    of one another and of the other world sizes': dense Adagrad on 4 and 1 ranks, SGD on 2 and
    1."""
    for optimizer, worlds in (("adagrad", (4, 1)), ("sgd", (2, 1))):
        reference = jobs[worlds[0]]["losses"][f"ddp-{optimizer}"]
        for world in worlds:
            for mode in MODES:
                assert_same(reference, jobs[world]["losses"][f"{mode}-{optimizer}"],
                            f"{mode}-{optimizer} on {world} ranks")


def test_a_checkpoint_resumes_in_another_mode_on_another_world_size(jobs):
    """Each mode's 4-rank checkpoint at step 2 (dense Adagrad), resumed on 2 ranks in the next
    mode, trains steps 3-4 as the 4-rank run did: the model and Adagrad's sharded state load,
    resharded; torchrec's train pipeline drives fsdp to the same losses; fp16's loss scaler
    (its overflow check over the gradients' shards) gives fsdp ddp's fp16 losses."""
    for mode, then in NEXT.items():
        assert_same(jobs[4]["losses"][f"{mode}-adagrad"][2:],
                    jobs[2]["losses"][f"{mode}-adagrad-then-{then}"], f"{mode} resumed in {then}")
    assert_same(jobs[4]["losses"]["ddp-adagrad"], jobs[2]["losses"]["fsdp-adagrad-pipelined"],
                "fsdp pipelined")
    assert_same(jobs[2]["losses"]["ddp-fp16"], jobs[2]["losses"]["fsdp-fp16"], "fsdp fp16")


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(jobs):
    """fsdp, 2 ranks: rank 1's embedding gradient overflows at the first step; no rank's
    shards change and both back the scale off from 2^16 (rank 1's shard of the first dense
    gradient is empty: the skip must show in another); the second step is taken."""
    assert jobs[2]["fp16_skip"] == [[[False, 2.0**15], [True, 2.0**15]]] * 2


def test_parameters_and_optimizer_state_are_sharded(jobs):
    """On 4 ranks, each DHEN layer is a group of its own (and so are the mixed-dimension
    tables' projections) and DDP leaves the dense modules to
    FSDP2 (every table is sharded: DDP wraps nothing); rank 0 holds all dense bytes under ddp, about 1/4 under fsdp and 1/2 under hsdp
    2x2; Adagrad's sum is a DTensor shard (replicated across hsdp's groups)."""
    held = jobs[4]["held"]
    assert held["ddp"]["groups"] == [] and held["ddp"]["ddp"]
    assert not held["fsdp"]["ddp"] and not held["hsdp"]["ddp"]
    assert held["fsdp"]["groups"] == held["hsdp"]["groups"] == [
        "dense_arch", "widen_parts", "interaction.layers.0", "interaction.layers.1", "over_arch"]
    full = held["ddp"]["full_bytes"]
    assert held["ddp"]["dense_bytes"] == full and held["ddp"]["sum_type"] == "Tensor"
    for mode, shards, placements in (("fsdp", 4, ["S(0)"]), ("hsdp", 2, ["R", "S(0)"])):
        assert full / shards <= held[mode]["dense_bytes"] <= 1.05 * full / shards, mode
        assert held[mode]["sum_type"] == "DTensor", mode
        assert held[mode]["sum_placements"] == placements, mode
        assert held[mode]["sum_local_rows"] * shards == held[mode]["sum_rows"], mode


TINY = ["--config", "configs/demo.yaml", *(f"--set={o}" for o in [
    "train.max_steps=4", "train.log_every=1", "train.eval_every=0", "train.progress_bar=false",
    "data.global_batch_size=256", "data.train_samples=8192", "data.val_samples=1024",
    "model.interaction=cat", "model.top_mlp=[32,16,1]", "parallel.replicate=false",
    "optim.dense_lr=0.01"])]


def sets(*overrides: str) -> list:
    return [f"--set={o}" for o in overrides]


def test_cli_fsdp_run_resumes_under_ddp_and_its_checkpoint_evaluates_and_exports(tmp_path):
    """`train` on 2 ranks with fsdp (recorded as such; `cat`, whose automatic exchange would
    be des under ddp, exchanges pooled vectors), resumed in one process with ddp from its step
    4 to step 6; `eval` and `export` of the fsdp checkpoint reproduce its AUC."""
    run_dir = tmp_path / "run"
    first = run_cli(["train", *TINY, *sets("parallel.dense=fsdp", f"train.run_dir={run_dir}")],
                    nproc=2)
    assert first.returncode == 0, failure(first)
    assert "embedding exchange: pooled (des reads the top MLP that parallel.dense=fsdp shards)" \
        in first.stdout
    record = next(e for e in read_metrics(run_dir) if "dense" in e)
    assert (record["dense"], record["dense_replicas_shards"]) == ("fsdp", [1, 2])
    step_4 = run_dir / "checkpoints" / "step_4"
    assert_eval_and_export_reproduce(step_4, done_fields(first.stdout)["val_auc"],
                                     tmp_path / "model.pt")
    then = run_cli(["train", *TINY, *sets("parallel.dense=ddp", f"train.run_dir={run_dir}",
                                          "train.max_steps=6", "checkpoint.resume=auto")])
    assert then.returncode == 0, failure(then)
    assert f"resumed from {step_4} (step 4)" in then.stdout
    losses = [e for e in read_metrics(run_dir) if "loss" in e]
    assert [e["step"] for e in losses] == [1, 2, 3, 4, 5, 6]
    assert losses[-1]["loss"] < losses[0]["loss"]


@pytest.mark.parametrize("overrides, says", [
    (["parallel.dense=fsdp", "train.cuda_graphs=true"],
     "train.cuda_graphs: parallel.dense=fsdp all-gathers"),
    (["parallel.dense=hsdp", "parallel.exchange=des", "model.interaction=cat"],
     "parallel.exchange: des reads the top MLP's first weight"),
    (["parallel.dense=fsdp", "parallel.hsdp_shard_size=1"],
     "parallel.hsdp_shard_size: 1 applies to parallel.dense=hsdp only"),
    (["parallel.dense=hsdp", "parallel.hsdp_shard_size=2"],
     "parallel.hsdp_shard_size: groups of 2 ranks do not divide the world size 1"),
])
def test_settings_fsdp_cannot_run_with_are_refused(tmp_path, overrides, says):
    result = run_cli(["train", *TINY, *sets(f"train.run_dir={tmp_path}", *overrides)])
    assert result.returncode == 2, failure(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr[-2000:]
