"""Real multi-process runs under torchrun with gloo: what `make demo` and users rely on."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, done_fields, exported_val_scores, failure, read_metrics, run_cli
from shared_runs import equivalence_run



def train_losses(tmp_path, nproc, optimizer, request):
    """(per-step losses, `done:` fields, run directory) of shared_runs.equivalence_run; the
    SGD ones are the session's (test_cpu_lookup.py compares with the 1-rank one too)."""
    if optimizer == "sgd":
        shared_run = {1: "one_rank_sgd", 2: "two_rank_sgd"}[nproc]
        losses, result, run_dir = request.getfixturevalue(shared_run)
    else:
        run_dir = tmp_path / f"{optimizer}-{nproc}"
        losses, result = equivalence_run(run_dir, nproc, optimizer)
    return losses, done_fields(result.stdout), run_dir


def validation_logits(run_dir, exported):
    """The final checkpoint's click logits on the validation split, in one unsharded model
    (exported to `exported`: the run may be a shared one, not to be written into)."""
    from dlrm_hybrid.train.inference import export_checkpoint

    checkpoint = run_dir / "checkpoints" / "step_20"
    export_checkpoint(str(checkpoint), str(exported))
    return exported_val_scores(checkpoint, exported)[0]


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_one_and_two_ranks_give_the_same_losses(tmp_path, optimizer, request):
    """The same model, not merely similar numbers: per-step losses, and the final model's
    predictions on the validation split (the AUC of a 20-step model sits on near-ties, so it
    amplifies the rounding of another reduction order: it is not compared)."""
    import torch

    one, done_one, run_one = train_losses(tmp_path, 1, optimizer, request)
    two, done_two, run_two = train_losses(tmp_path, 2, optimizer, request)
    assert len(one) == len(two) == 20
    for step, (a, b) in enumerate(zip(one, two), start=1):
        assert abs(a - b) / abs(a) < 1e-4, f"step {step}: 1 rank {a}, 2 ranks {b}"
    assert one[-1] < one[0]
    torch.testing.assert_close(validation_logits(run_two, tmp_path / "two.pt"),
                               validation_logits(run_one, tmp_path / "one.pt"),
                               rtol=1e-5, atol=1e-5)
    assert abs(done_one["val_logloss"] - done_two["val_logloss"]) < 1e-4


def test_demo_config_on_two_ranks_approaches_the_oracle(tmp_path):
    """`make demo` in a third of its steps (its 3000 take ~90 s on 2 cores): 2 gloo ranks, the
    shipped config with its decay compressed into steps 500..1000, which lands ~0.018 AUC
    from the planted teacher (the full demo: ~0.01)."""
    result = run_cli(["train", "--config", "configs/demo.yaml", *[a for o in [
        f"train.run_dir={tmp_path}", "train.max_steps=1000", "train.eval_every=500",
        "optim.decay_start_step=500", "optim.decay_steps=500"] for a in ("--set", o)]], nproc=2)
    assert result.returncode == 0, failure(result)
    done = done_fields(result.stdout)
    assert done["steps"] == 1000 and done["samples_per_s"] > 0
    assert done["oracle_auc"] - done["val_auc"] < 0.025, result.stdout[-1000:]
    assert "plan (greedy): 8 tables, " in result.stdout  # rank 0's placement
    assert "replicated on every rank (data_parallel" in result.stdout  # the small tables
    events = read_metrics(tmp_path)
    assert [e["step"] for e in events if "val_auc" in e] == [500, 1000]
    assert len([e for e in events if "loss" in e]) == 1000 // 50
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["max_steps"] == 1000


def checkpointed_shards(checkpoint):
    """{table: [(rank, first column, columns, rows)]} of the embedding weight chunks a checkpoint
    holds, by first column; the rank is the writer of the chunk's file (`__<rank>_<n>.distcp`)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from dlrm_hybrid.train.checkpoint_reader import checkpoint_reader

    metadata = checkpoint_reader(checkpoint).read_metadata()
    shards = {}
    for fqn, tensor in metadata.state_dict_metadata.items():
        if fqn.startswith("model.") and ".embedding_bags." in fqn:
            for chunk in tensor.chunks:
                path = metadata.storage_data[MetadataIndex(fqn, chunk.offsets)].relative_path
                assert chunk.offsets[0] == 0, (fqn, chunk)  # column shards only
                shards.setdefault(fqn.split(".")[-2], []).append(
                    (int(path.split("_")[2]), chunk.offsets[1], chunk.sizes[1], chunk.sizes[0]))
    return {table: sorted(chunks, key=lambda c: c[1]) for table, chunks in shards.items()}


PLAN_RUN = ["data.cardinalities=[4000,100,100]", "data.hotness=[1]", "optim.embedding=sgd",
            "data.global_batch_size=256", "data.val_samples=2048", "train.max_steps=5",
            "train.log_every=2", "train.progress_bar=false"]


@pytest.fixture(scope="module")
def plan_file_run(tmp_path_factory):
    """`plan --out` for 2 ranks, then a 2-rank `train --set parallel.plan=...` (rank logs on):
    (plan file, run directory, the train command's result)."""
    tmp_path = tmp_path_factory.mktemp("plan_file_run")
    args = [arg for s in PLAN_RUN for arg in ("--set", s)]
    plan_path, run_dir = tmp_path / "plan.json", tmp_path / "run"
    made = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2",
                    "--gpu-memory", "8GiB", "--out", str(plan_path), *args])
    assert made.returncode == 0, made.stderr
    plan = json.loads(plan_path.read_text())  # every sharding type, set by hand
    plan["tables"]["t_cat_0"].update(sharding="column_wise", ranks=[1, 0], columns=[8, 8])
    plan["tables"]["t_cat_1"].update(sharding="table_wise", ranks=[1], columns=[16])
    plan["tables"]["t_cat_2"].update(sharding="data_parallel", ranks=[], columns=[])
    plan_path.write_text(json.dumps(plan))
    result = run_cli(["train", "--config", "configs/demo.yaml", *args, "--set",
                      f"parallel.plan={plan_path}", "--set", f"train.run_dir={run_dir}",
                      "--set", "train.rank_logs=true"], nproc=2)
    assert result.returncode == 0, failure(result)
    return plan_path, run_dir, result


def test_two_rank_training_uses_a_plan_file_exactly(plan_file_run, tmp_path):
    """`plan --out` then `train --set parallel.plan=...`: torchrec applies that very placement."""
    plan_path, run_dir, result = plan_file_run
    args = [arg for s in PLAN_RUN for arg in ("--set", s)]
    planned = {name: (t["sharding"], t["ranks"] or [0, 1])  # a replicated one: on every rank
               for name, t in json.loads(plan_path.read_text())["tables"].items()}
    assert planned["t_cat_2"] == ("data_parallel", [0, 1])
    assert planned["t_cat_0"] == ("column_wise", [1, 0]) and planned["t_cat_1"] == ("table_wise", [1])
    applied = json.loads((run_dir / "sharding.json").read_text())
    assert {name: (a["sharding"], a["ranks"]) for name, a in applied.items()} == planned
    done_fields(result.stdout)
    # the shards torchrec built, as each rank wrote its local shards into the final checkpoint
    # (a replicated table once, whole, by whichever rank DCP picks)
    plan_tables = json.loads(plan_path.read_text())["tables"]
    shards = checkpointed_shards(run_dir / "checkpoints/step_5")
    assert shards == {
        name: [(rank, sum(t["columns"][:k]), cols, t["rows"])
               for k, (rank, cols) in enumerate(zip(t["ranks"], t["columns"]))]
        or [(shards[name][0][0], 0, t["dim"], t["rows"])]
        for name, t in plan_tables.items()}
    for rank in (0, 1):  # each rank's own log names the shards the plan gave it
        first, *steps = [json.loads(line) for line in (run_dir / f"rank_{rank}.jsonl").open()]
        owned = {s.split("[")[0] for s in first["shards"]}
        assert owned == {name for name, (how, ranks) in planned.items()
                         if rank in ranks and how != "data_parallel"}
        assert first["replicated"] == sorted(
            name for name, (how, _) in planned.items() if how == "data_parallel")
        assert [e["step"] for e in steps] == [2, 4, 5]
        assert all(0 < e["local_loss"] < 2 and e["train_seconds"] > 0 for e in steps)

    wrong = run_cli(["train", "--config", "configs/demo.yaml", *args, "--set",
                     f"parallel.plan={plan_path}", "--set", f"train.run_dir={tmp_path / 'x'}"])
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (f"error: parallel.plan: {plan_path} is for 2 ranks, this job "
                                    f"has 1; make one with `plan --world-size 1`")


def eval_fields(result) -> dict:
    assert result.returncode == 0, failure(result)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("eval: "), result.stdout[-2000:]
    return dict(item.split("=", 1) for item in last.split()[1:])


def test_eval_on_two_ranks_scores_as_one_rank_and_the_run_did(plan_file_run):
    """`eval` under torchrun: the checkpoint sharded on 2 ranks scores every validation sample
    once, as one process does and as the run's own final evaluation did."""
    _, run_dir, _ = plan_file_run
    args = ["eval", "--checkpoint", str(run_dir / "checkpoints/step_5"), "--split", "val"]
    two, one = eval_fields(run_cli(args, nproc=2)), eval_fields(run_cli(args))
    assert two["samples"] == one["samples"] == "2048" and two["step"] == "5"
    final = read_metrics(run_dir)[-1]
    for key in ("val_auc", "val_logloss"):
        assert abs(float(two[key]) - float(one[key])) <= 1e-5, (key, two, one)
        assert abs(float(two[key]) - final[key]) <= 1e-5, (key, two, final)


def test_two_hosts_join_through_c10d_rendezvous(tmp_path):
    """Two torchrun agents on 127.0.0.1 (one process each), as launch/multi_node.sh starts them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NNODES": "2", "NPROC": "1", "ENDPOINT": f"127.0.0.1:{port}",
           "JOB_ID": "two-hosts", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    cmd = ["bash", "launch/multi_node.sh", "configs/demo.yaml", "--set", "train.max_steps=20",
           "--set", "data.val_samples=2048",  # the final evaluation: 2048 rows, not the demo's 65536
           "--set", "train.progress_bar=false", "--set", f"train.run_dir={tmp_path}"]
    hosts = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [host.communicate(timeout=300) for host in hosts]
    assert [host.returncode for host in hosts] == [0, 0], [err[-2000:] for _, err in outputs]
    printed = "".join(out for out, _ in outputs)
    assert "on 2 ranks, 2 hosts x 1" in printed  # one job of two ranks, planned per host
    assert printed.count("done: steps=20") == 1  # rank 0 alone reports
