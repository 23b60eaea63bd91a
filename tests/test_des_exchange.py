"""`parallel.exchange: des`: the owners send partial sums instead of pooled vectors, and the
model is exactly the same (parallel/exchange.py)."""

import json
import os
import subprocess

import pytest
import torch

from conftest import ROOT, TORCHRUN, assert_eval_and_export_reproduce, read_metrics, run_cli

DIM, TABLES, BATCH = 16, 8, 1024  # configs/demo.yaml


def run_job(tmp_path, nproc: int, *flags: str) -> dict:
    out = tmp_path / f"job{nproc}"
    out.mkdir()
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "tests/des_job.py"), str(out), *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**env, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "losses.json").read_text())


def assert_same(a, b, label):
    assert len(a) == len(b) > 0, label
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-5 * abs(x), f"{label}: step {step}: {x} vs {y}"


def rank_bytes(run_dir, rank):
    """(forward, backward) exchange bytes of step 2 in a rank's log."""
    events = [json.loads(l) for l in (run_dir / f"rank_{rank}.jsonl").read_text().splitlines()]
    step = next(e for e in events if e.get("step") == 2)
    return step["exchange_fwd_bytes"], step["exchange_bwd_bytes"]


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_des_and_pooled_give_the_same_losses(tmp_path, nproc):
    """cat and fm, SGD and row-wise Adagrad tables, on 1, 2 and 4 gloo ranks (4 splits a
    table column-wise): per-step losses within 1e-5. On 2 ranks, each path's checkpoint resumes
    in the other with the first path's own losses (dense Adagrad: its state for the W_t columns
    travels too); QR concat and hashed features, and torchrec's train pipeline, keep the
    losses; the bytes each rank logs are those the exchange sends."""
    losses = run_job(tmp_path, nproc, *(["--more"] if nproc == 2 else []))
    for interaction in ("cat", "fm"):
        for optimizer in ("sgd", "rowwise_adagrad"):
            name = f"{interaction}-{optimizer}"
            assert_same(losses[f"{name}-pooled"], losses[f"{name}-des"], f"{name} on {nproc}")
    if nproc == 4:  # a column-wise split took part
        shards = [s for r in range(4) for s in json.loads(
            (tmp_path / f"job4/fm-sgd-des/rank_{r}.jsonl").read_text().splitlines()[0])["shards"]]
        assert any(s.startswith("t_") and not s.endswith(f"[0:{DIM}]") for s in shards), shards
    if nproc != 2:
        return
    for first, then in (("des", "pooled"), ("pooled", "des")):
        assert_same(losses[f"resume-{first}"][3:], losses[f"resume-{first}-then-{then}"],
                    f"{first} checkpoint resumed with {then}")
    for interaction in ("cat", "fm"):  # QR concat (cat) and hashed features take part
        assert_same(losses[f"parts-{interaction}-pooled"], losses[f"parts-{interaction}-des"],
                    f"{interaction} with compositional features")
    assert_same(losses["cat-sgd-pooled"], losses["cat-sgd-des-pipelined"], "des pipelined")
    job, local = tmp_path / "job2", BATCH // 2
    # fm des: a reduce-scatter of [2B, D + 2] and its all-gather back: B (D + 2) fp32 each way.
    for rank in (0, 1):
        assert rank_bytes(job / "fm-sgd-des", rank) == (local * (DIM + 2) * 4,) * 2
    # pooled: each rank sends its own columns of the other rank's samples, and gets back the
    # gradients of the others' columns; over both ranks, every table's D (fm: + 4) columns.
    sent = [rank_bytes(job / "fm-sgd-pooled", r) for r in (0, 1)]
    assert sum(f for f, _ in sent) == sum(b for _, b in sent) == local * TABLES * (DIM + 4) * 4
    assert sent[0][0] == sent[1][1] and sent[0][1] == sent[1][0]


def test_fm_des_checkpoint_evaluates_and_exports(tmp_path):
    """A 2-rank fm run with des: `eval` of its checkpoint (which places tables for itself)
    reproduces the run's AUC, and the exported file scores it in one unsharded model."""
    run_dir = tmp_path / "fm"
    sets = ["model.interaction=fm", "parallel.exchange=des", "train.max_steps=30",
            "train.eval_every=0", "train.progress_bar=false", "data.train_samples=40000",
            "data.val_samples=8192", f"train.run_dir={run_dir}"]
    result = run_cli(["train", "--config", "configs/demo.yaml",
                      *[a for s in sets for a in ("--set", s)]], nproc=2)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "embedding exchange: des (parallel.exchange=des)" in result.stdout
    auc = [e for e in read_metrics(run_dir) if "val_auc" in e][-1]["val_auc"]
    assert auc > 0.55  # it learns (a 30-step fm is far from the oracle)
    assert_eval_and_export_reproduce(run_dir / "checkpoints/step_30", auc, tmp_path / "fm.pt")


def test_fm_terms_are_the_factorization_machine():
    """The sums path gives sum_t w_t and sum_{s<t} e_s . e_t, computed here pair by pair."""
    from dlrm_hybrid.model.interactions import FactorizationMachine

    torch.manual_seed(0)
    batch, features, dim = 5, 6, 8
    vectors, weights = torch.randn(batch, features, dim), torch.randn(batch, features, 4)
    dense = torch.randn(batch, 3)
    out = FactorizationMachine(features, dim)(dense, torch.cat(
        (vectors.flatten(1), weights.flatten(1)), dim=1))
    pairs = sum((vectors[:, s] * vectors[:, t]).sum(1)
                for s in range(features) for t in range(s + 1, features))
    assert torch.equal(out[:, :3], dense)
    assert torch.allclose(out[:, 3], weights[:, :, 0].sum(1), atol=1e-6)
    assert torch.allclose(out[:, 4], pairs, atol=1e-5)


def plan_output(*sets: str, world: int = 8) -> str:
    result = run_cli(["plan", "--config", "configs/mlperf_dcnv2.yaml", "--world-size", str(world),
                      *[a for s in sets for a in ("--set", s)]])
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_plan_prints_both_exchanges_and_auto_picks_the_smaller():
    """MLPerf's shape with cat (T = 26, D = 128, H = 1024, 8 ranks): des sends H P / (T D) =
    2.46x the bytes, so auto keeps pooled; 64 tables of 64 with H = 64: des wins."""
    out = plan_output("model.interaction=cat")
    assert "pooled 76.8MiB + 76.8MiB per rank" in out
    assert "des    189.0MiB + 189.0MiB per rank" in out
    assert "training uses pooled (auto: des would send 2.46x the bytes)" in out
    many = plan_output("model.interaction=cat", "model.embedding_dim=64",
                       "model.top_mlp=[64,1]", f"data.cardinalities={[100000] * 64}",
                       "data.hotness=[1]", "data.global_batch_size=4096")
    assert "training uses des (auto: 8.00x fewer bytes than pooled)" in many
    assert "training uses pooled (interaction dcn needs the pooled vectors)" in plan_output()


@pytest.mark.parametrize("sets, message", [
    (["model.interaction=dot"], "des needs an interaction whose first operation"),
    (["model.interaction=dcn"], "des needs an interaction whose first operation"),
    (["model.interaction=cat", "train.cuda_graphs=true"], "des runs neither under"),
    (["model.interaction=cat", "train.precision=fp16"], "des runs neither under"),
    (["model.interaction=cat",
      "model.compositional=[{technique: qr, features: [cat_0], operation: add}]"],
     "qr mult and add parts"),
])
def test_des_where_it_does_not_apply_is_a_config_error(sets, message):
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2", "--set",
                      "parallel.exchange=des", *[a for s in sets for a in ("--set", s)]])
    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_fm_with_qr_is_a_config_error():
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--set", "model.interaction=fm",
                      "--set", "model.compositional=[{technique: qr, features: [cat_0]}]"])
    assert result.returncode != 0 and "interaction fm needs one vector" in result.stderr
