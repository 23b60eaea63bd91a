"""`parallel.exchange: des`: the owners send partial sums instead of pooled vectors, and the
model is exactly the same (parallel/exchange.py)."""

import json

import pytest
import torch

from conftest import ROOT, assert_eval_and_export_reproduce, read_metrics, run_cli

DIM, TABLES, BATCH = 16, 8, 1024  # configs/demo.yaml
TOP = 48  # the first top layer's width in des_job.py: cat's partial sums per sample
FIRST_ORDER = 4  # fm: each feature's first-order weight table is 4 columns wide


def run_job(tmp_path, nproc: int, *flags: str) -> dict:
    out = tmp_path / f"job{nproc}"
    out.mkdir()
    result = run_cli([str(out), *flags], nproc=nproc, script=ROOT / "tests/des_job.py")
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "losses.json").read_text())


def assert_same(a, b, label):
    assert len(a) == len(b) > 0, label
    for step, (x, y) in enumerate(zip(a, b), 1):
        assert abs(x - y) <= 1e-5 * abs(x), f"{label}: step {step}: {x} vs {y}"


def rank_events(run_dir, rank):
    return [json.loads(l) for l in (run_dir / f"rank_{rank}.jsonl").read_text().splitlines()]


def last_step(run_dir, rank):
    """(exchange installed, forward bytes, backward bytes) of the last step in a rank's log."""
    step = [e for e in rank_events(run_dir, rank) if "exchange" in e][-1]
    return step["exchange"], step["exchange_fwd_bytes"], step["exchange_bwd_bytes"]


def owned_columns(run_dir, rank):
    """Pooled columns per sample a rank's shards hold: "t_cat_0[0:16]" holds 16."""
    shards = rank_events(run_dir, rank)[0]["shards"]
    return sum(int(b) - int(a) for a, b in (s[s.index("[") + 1:-1].split(":") for s in shards))


def assert_des_bytes(run_dir, nproc, width):
    """des on every rank: a reduce-scatter of [P B, K] partial sums, and its all-gather back:
    (P - 1) B K fp32 values each way (B the local batch, K = H for cat, D + 2 for fm)."""
    sent = (nproc - 1) * (BATCH // nproc) * width * 4
    assert [last_step(run_dir, r) for r in range(nproc)] == [("des", sent, sent)] * nproc, run_dir


def assert_pooled_bytes(run_dir, nproc, columns):
    """pooled: a rank owning C_r of the C columns sends them for the other ranks' samples,
    (P - 1) B C_r, and the gradients of its own samples' columns owned elsewhere, B (C - C_r)."""
    local, owned = BATCH // nproc, [owned_columns(run_dir, r) for r in range(nproc)]
    assert sum(owned) == columns
    assert [last_step(run_dir, r) for r in range(nproc)] == [
        ("pooled", (nproc - 1) * local * c * 4, local * (columns - c) * 4) for c in owned], run_dir


def total_bytes(run_dir, nproc):
    return sum(f + b for _, f, b in (last_step(run_dir, r) for r in range(nproc)))


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_des_and_pooled_give_the_same_losses(tmp_path, nproc):
    """cat and fm, SGD and row-wise Adagrad tables, on 1, 2 and 4 gloo ranks (4 splits a
    table column-wise): per-step losses within 1e-5, and each rank's log names the exchange
    that ran and counts the bytes its formula gives (on 2 and 4 ranks des's differ from
    pooled's). On 2 ranks, each path's checkpoint resumes in the other with the first path's
    own losses (dense Adagrad: its state for the W_t columns travels too); QR concat and hashed
    features, and torchrec's train pipeline, keep the losses."""
    losses = run_job(tmp_path, nproc, *(["--more"] if nproc == 2 else []))
    job = tmp_path / f"job{nproc}"
    for interaction, width, columns in (("cat", TOP, TABLES * DIM),
                                        ("fm", DIM + 2, TABLES * (DIM + FIRST_ORDER))):
        for optimizer in ("sgd", "rowwise_adagrad"):
            name = f"{interaction}-{optimizer}"
            assert_same(losses[f"{name}-pooled"], losses[f"{name}-des"], f"{name} on {nproc}")
            assert_des_bytes(job / f"{name}-des", nproc, width)
            assert_pooled_bytes(job / f"{name}-pooled", nproc, columns)
            if nproc > 1:
                assert total_bytes(job / f"{name}-des", nproc) != total_bytes(
                    job / f"{name}-pooled", nproc), name
    if nproc == 4:  # a column-wise split took part
        shards = [s for r in range(4) for s in rank_events(job / "fm-sgd-des", r)[0]["shards"]]
        assert any(s.startswith("t_") and not s.endswith(f"[0:{DIM}]") for s in shards), shards
    if nproc != 2:
        return
    for first, then in (("des", "pooled"), ("pooled", "des")):
        assert_same(losses[f"resume-{first}"][3:], losses[f"resume-{first}-then-{then}"],
                    f"{first} checkpoint resumed with {then}")
        assert_des_bytes(job / ("resume-des" if first == "des" else "resume-pooled-then-des"),
                         nproc, TOP)
    for interaction, width in (("cat", TOP), ("fm", DIM + 2)):  # QR concat (cat), hashed
        assert_same(losses[f"parts-{interaction}-pooled"], losses[f"parts-{interaction}-des"],
                    f"{interaction} with compositional features")
        assert_des_bytes(job / f"parts-{interaction}-des", nproc, width)
    assert_same(losses["cat-sgd-pooled"], losses["cat-sgd-des-pipelined"], "des pipelined")
    assert_des_bytes(job / "pipelined", nproc, TOP)
    drivers = {run: [e["step_driver"] for e in read_metrics(job / run) if "step_driver" in e]
               for run in ("cat-sgd-pooled", "pipelined")}
    assert drivers == {"cat-sgd-pooled": ["plain"], "pipelined": ["torchrec pipeline"]}


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
    """MLPerf's shape with cat (T = 26, D = 128, H = 1024, 8 ranks, every table sharded): des
    sends H P / (T D) = 2.46x the bytes, so auto keeps pooled; 64 tables of 64 with H = 64: des
    wins. A plan that replicates tables keeps pooled: des runs with sharded tables only."""
    assert ("training uses pooled (des does not run with replicated tables"
            in plan_output("model.interaction=cat"))
    out = plan_output("model.interaction=cat", "parallel.replicate=false")
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
