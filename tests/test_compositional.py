"""Compositional embeddings and the hashing trick: exact semantics against a dense reference,
which tables a config makes, their initial scale, and training with them (every CPU-capable
fused optimizer, the train pipeline, 1 vs 2 ranks, resharded resume, eval and export)."""

import json

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from conftest import ROOT, assert_one_two_and_resumed_alike, failure, read_metrics, run_cli
from dlrm_hybrid.config import CompositionalRule, ConfigError
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.model.composed_lookup import LookupIds
from dlrm_hybrid.model.compositional import feature_lookups
from dlrm_hybrid.model.dlrm import DLRM
from dlrm_hybrid.train.loop import train

# One demo table per technique: cat_0 one-hot mult, cat_1 concat, cat_2 (3 ids) mult over id
# slots, cat_3 hashed, cat_4 (2 ids) add; the rest full.
DEMO_RULES = ("model.compositional=[{features: [cat_0, cat_2], collisions: 8}, "
              "{features: [cat_1], operation: concat}, {features: [cat_4], operation: add}, "
              "{technique: hash, features: [cat_3], buckets: 30}]")


def rule(**kwargs):
    return CompositionalRule(**kwargs)


def reference_bags(model: DLRM, sparse: KeyedJaggedTensor) -> torch.Tensor:
    """[B, F, D] by the definition, one id at a time: sum over a bag's ids of
    combine(Q[id // c], R[id % c]) (hash: T[id % m]; full: T[id])."""
    weights = {name.split(".")[-2]: w for name, w in model.embedding_bags.state_dict().items()}
    features = sparse.to_dict()
    out = []
    for lookup in model.lookups:
        jagged = features[lookup.feature]
        bags = []
        for ids in jagged.values().split(jagged.lengths().tolist()):
            total = torch.zeros(lookup.dim)
            for i in ids.tolist():
                if lookup.technique == "full":
                    total += weights[f"t_{lookup.feature}"][i]
                elif lookup.technique == "hash":
                    total += weights[f"t_{lookup.feature}_h"][i % lookup.modulus]
                else:
                    q = weights[f"t_{lookup.feature}_q"][i // lookup.modulus]
                    r = weights[f"t_{lookup.feature}_r"][i % lookup.modulus]
                    total += {"mult": q * r, "add": q + r, "concat": torch.cat([q, r])}[
                        lookup.operation]
            bags.append(total)
        out.append(torch.stack(bags))
    return torch.stack(out, 1)


@pytest.mark.parametrize("hotness", [1, 4])
def test_bags_match_the_dense_reference_for_every_operation(hotness):
    """One-hot and multi-hot bags (1..4 ids, some shorter than others): the model's pooled
    vectors equal the definition's, mult included (not (sum Q) * (sum R))."""
    torch.manual_seed(0)
    rows = [1000, 997, 640, 500, 77]
    names = [f"cat_{i}" for i in range(len(rows))]
    rules = [rule(features=["cat_0"], collisions=7, operation="mult"),
             rule(features=["cat_1"], collisions=10, operation="add"),
             rule(features=["cat_2"], collisions=4, operation="concat"),
             rule(technique="hash", features=["cat_3"], buckets=61)]
    lookups = feature_lookups(names, rows, [hotness] * len(rows), 8, rules)
    model = DLRM(3, lookups, [8, 8], [4, 1], embedding_device=torch.device("cpu"))
    with torch.no_grad():
        for weight in model.embedding_bags.parameters():
            weight.uniform_(-1, 1)
    batch = 32
    lengths = torch.randint(1, hotness + 1, (len(rows), batch))
    values = torch.cat([torch.randint(0, n, (int(count.sum()),)) for n, count in zip(rows, lengths)])
    sparse = KeyedJaggedTensor.from_lengths_sync(names, values, lengths.reshape(-1).int())
    got = model.pooled_embeddings(sparse)
    assert got.shape == (batch, len(rows), 8)
    torch.testing.assert_close(got, reference_bags(model, sparse), rtol=1e-5, atol=1e-5)
    if hotness > 1:  # the pooled-then-combined vector really differs for mult
        q = model.embedding_bags.embedding_bags["t_cat_0_q"].weight
        r = model.embedding_bags.embedding_bags["t_cat_0_r"].weight
        bag = int(torch.nonzero(lengths[0] > 1)[0])  # a bag of cat_0 with several ids
        start = int(lengths[0, :bag].sum())
        ids = sparse["cat_0"].values()[start:start + int(lengths[0, bag])]
        wrong = q[ids // 7].sum(0) * r[ids % 7].sum(0)
        assert not torch.allclose(got[bag, 0], wrong, atol=1e-3)


def test_the_quotient_is_integer_division_at_forty_million_rows():
    """id 39,999,999 of a 40M-row table with c = 4 is quotient row 9,999,999, the last of its
    ceil(n / c) rows (float division rounds it one past the end)."""
    (lookup,) = feature_lookups(["cat_0"], [40_000_000], [1], 16, [rule(collisions=4)])
    assert [p.rows for p in lookup.parts] == [10_000_000, 4]
    ids = torch.tensor([0, 3, 4, 39_999_999])
    out = LookupIds([lookup])(KeyedJaggedTensor.from_lengths_sync(
        ["cat_0"], ids, torch.ones(4, dtype=torch.int32))).to_dict()
    assert out["cat_0_q"].values().tolist() == [0, 0, 1, 9_999_999]
    assert out["cat_0_r"].values().tolist() == [0, 3, 0, 3]
    assert torch.tensor(39_999_999, dtype=torch.float32) / 4 == 10_000_000  # the float mistake


def test_rules_pick_tables_by_name_or_size_first_rule_first():
    names, rows = ["cat_0", "cat_1", "cat_2", "cat_3"], [10_000, 5_000, 300, 40]
    rules = [rule(technique="full", features=["cat_1"]),
             rule(technique="hash", rows_above=1_000, buckets=2_000),
             rule(rows_above=100, collisions=4, operation="add")]
    lookups = feature_lookups(names, rows, [1, 1, 1, 1], 16, rules)
    assert [(l.technique, [p.table for p in l.parts], [p.rows for p in l.parts])
            for l in lookups] == [
        ("hash", ["t_cat_0_h"], [2_000]), ("full", ["t_cat_1"], [5_000]),
        ("qr", ["t_cat_2_q", "t_cat_2_r"], [75, 4]), ("full", ["t_cat_3"], [40])]
    # Selected by size, a table the technique would not shrink stays full...
    (kept,) = feature_lookups(["cat_0"], [50], [1], 16, [rule(technique="hash", buckets=64)])
    assert kept.technique == "full"
    # ...named, it is an error; so is a feature the data does not have.
    with pytest.raises(ConfigError, match=r"model\.compositional\[0\]: hash would not make "
                                          r"cat_0's table of 50 rows smaller"):
        feature_lookups(["cat_0"], [50], [1], 16, [rule(technique="hash", features=["cat_0"],
                                                        buckets=64)])
    with pytest.raises(ConfigError, match=r"features: cat_9 is not a categorical feature"):
        feature_lookups(names, rows, [1] * 4, 16, [rule(features=["cat_9"])])


@pytest.mark.parametrize("override, message", [
    ("[{technique: qr, operation: concat}]", r"concat gives each part half of "
                                             r"model.embedding_dim \(20\)"),
    ("[{technique: hash}]", r"\[0\]\.buckets: the hashed table's rows, must be positive"),
    ("[{collisions: 1}]", r"\[0\]\.collisions: the remainder table's rows c, must be at least 2"),
    ("[{features: [cat_0], rows_above: 5}]", r"give features or rows_above, not both"),
    ("[{operation: dot}]", r"\[0\]\.operation: 'dot' is not one of mult, add, concat"),
])
def test_bad_rules_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(str(ROOT / "configs/demo.yaml"), [
            f"model.compositional={override}", "model.embedding_dim=20",
            "model.bottom_mlp=[64,20]"])


def config(run_dir, *overrides):
    return load_config(str(ROOT / "configs/demo.yaml"), [
        DEMO_RULES, "data.val_samples=4096", "train.progress_bar=false", "train.log_every=10",
        "checkpoint.resume=none", f"train.run_dir={run_dir}", *overrides])


def test_initial_vectors_have_the_full_tables_scale(tmp_path, process_group):
    """Each technique's looked-up vectors start with the spread of the full table's
    U(-1/sqrt(n), 1/sqrt(n)) init, n being the feature's rows (compositional.init_bound)."""
    from dlrm_hybrid.data.synthetic import SyntheticClicks
    from dlrm_hybrid.train.loop import build_sharded_model

    rules = ("model.compositional=[{features: [cat_0], collisions: 100}, "
             "{features: [cat_1], operation: add, collisions: 100}, "
             "{features: [cat_2], operation: concat, collisions: 100}, "
             "{technique: hash, features: [cat_3], buckets: 3000}]")
    cfg = config(tmp_path, rules, "data.cardinalities=[10000, 10000, 10000, 10000, 10000]",
                 "data.hotness=[1]", "model.embedding_dim=32", "model.bottom_mlp=[64,32]")
    data = SyntheticClicks(cfg.data)
    dmp, _ = build_sharded_model(cfg, data.spec, process_group, lambda text: None)
    ids = torch.arange(10_000)
    sparse = KeyedJaggedTensor.from_lengths_sync(
        data.spec.feature_names, ids.repeat(5), torch.ones(50_000, dtype=torch.int32))
    with torch.no_grad():
        vectors = dmp.module.pooled_embeddings(sparse)  # [10000, 5, 32]
    expected = 10_000 ** -0.5 / 3 ** 0.5  # std of U(-a, a)
    stds = vectors.std(dim=(0, 2)) / expected
    assert torch.all((stds > 0.9) & (stds < 1.1)), stds  # the full bound: add 1.41, mult ~0.006
    assert torch.all(vectors.mean(dim=(0, 2)).abs() < 0.2 * expected)  # U(0, a) would be 0.87


@pytest.fixture(scope="module")
def one_step_state(tmp_path_factory, process_group):
    """The exported weights of the compositional demo after 1 step: what every optimizer's
    40 steps below must move each part further from."""
    from dlrm_hybrid.train.inference import export_checkpoint

    run_dir = tmp_path_factory.mktemp("one_step")
    train(config(run_dir, "train.max_steps=1"), process_group)
    export_checkpoint(str(run_dir / "checkpoints" / "step_1"), str(run_dir / "f.pt"))
    return torch.load(run_dir / "f.pt", weights_only=True)


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad"])
def test_every_cpu_fused_optimizer_trains_the_parts(tmp_path, process_group, optimizer,
                                                    one_step_state):
    """Each part learns (its weights move) and the loss falls; with row-wise Adagrad the
    pipelined step (the id transform run ahead by torchrec) gives exactly the plain losses."""
    modes = ("disabled", "enabled") if optimizer == "rowwise_adagrad" else ("disabled",)
    runs = {}
    for mode in modes:
        cfg = config(tmp_path / mode, f"optim.embedding={optimizer}", "train.max_steps=40",
                     f"train.pipeline={mode}", "checkpoint.every=1000")
        result = train(cfg, process_group)
        runs[mode] = result.losses
        assert result.losses[-1] < result.losses[0] - 0.05, result.losses
        drivers = [e["step_driver"] for e in read_metrics(tmp_path / mode) if "step_driver" in e]
        assert drivers == ["torchrec pipeline" if mode == "enabled" else "plain"]
    if len(runs) == 2:
        assert runs["enabled"] == runs["disabled"]
    from dlrm_hybrid.train.inference import export_checkpoint

    export_checkpoint(str(tmp_path / "disabled" / "checkpoints" / "step_40"), str(tmp_path / "m.pt"))
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    parts = [k for k in state if k.endswith(("_q.weight", "_r.weight", "_h.weight"))]
    assert len(parts) == 9  # four QR features, one hashed
    for key in parts:  # trained 40 steps vs 1 step: every part moved further
        assert not torch.allclose(state[key], one_step_state[key]), key


def test_plan_shows_the_parts_and_the_bytes_saved():
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2",
                      "--set", DEMO_RULES])
    assert result.returncode == 0, failure(result)
    out = result.stdout
    assert "12 tables" in out and "t_cat_0_q" in out and "t_cat_3_h" in out
    assert ("cat_2 (250 rows): qr mult c=8 -> t_cat_2_q 32x16 + t_cat_2_r 8x16, 3 id slots"
            in out)
    assert "cat_3 (100 rows): hash m=30 -> t_cat_3_h 30x16" in out
    assert "5 features: " in out and "saved" in out


def test_mlperf_dcnv2_qr_fits_one_80gib_gpu(tmp_path):
    result = run_cli(["plan", "--config", "configs/mlperf_dcnv2_qr.yaml", "--world-size", "1",
                      "--gpu-memory", "80GiB", "--out", str(tmp_path / "plan.json")])
    assert result.returncode == 0, failure(result)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["ranks"][0]["bytes"] <= plan["budget_bytes"]
    assert {"t_cat_0_q", "t_cat_0_r", "t_cat_20_q"} <= set(plan["tables"])
    full = run_cli(["plan", "--config", "configs/mlperf_dcnv2.yaml", "--world-size", "1",
                    "--gpu-memory", "80GiB"])
    assert full.returncode == 2 and "ranks of 76.0GiB would hold them" in full.stderr


def test_one_and_two_ranks_reshard_resume_eval_and_export_alike(tmp_path):
    """With every technique on, parts split column-wise too: 1 and 2 ranks give the same
    per-step losses; a 2-rank checkpoint
    resumes on 1 rank with the 2-rank run's losses; `eval` of the final checkpoint reproduces
    the run's evaluation, and its export, in one unsharded model, scores the same."""
    common = [DEMO_RULES, "train.max_steps=12", "train.log_every=1", "checkpoint.every=6",
              "data.val_samples=4096", "train.progress_bar=false", "optim.dense=sgd",
              "optim.dense_lr=0.5", "checkpoint.resume=auto",
              "optim.embedding=adagrad"]  # row-wise Adagrad's column shards keep their own row statistic
    # On 2 ranks, a quotient table and a half-width concat part are split column-wise.
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2",
                      "--out", str(tmp_path / "plan.json"), "--set", DEMO_RULES])
    assert result.returncode == 0, failure(result)
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["tables"]["t_cat_0_q"].update(sharding="column_wise", ranks=[0, 1], columns=[8, 8])
    plan["tables"]["t_cat_1_q"].update(sharding="column_wise", ranks=[1, 0], columns=[4, 4])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert_one_two_and_resumed_alike(tmp_path, common, tmp_path / "plan.json")
