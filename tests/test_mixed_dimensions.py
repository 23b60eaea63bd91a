"""Mixed-dimension embeddings (model.mixed_dimensions): the widths rule against
facebookresearch/dlrm's on the same counts, which tables it narrows, the projected lookup
against its definition, bad settings, `plan`'s bytes, and training with it (1 vs 2 ranks with a
narrow table split column-wise, resharded resume, eval and export)."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, assert_one_two_and_resumed_alike, failure, run_cli
from dlrm_hybrid.config import ConfigError, MixedDimensionsConfig
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.model.compositional import feature_lookups
from dlrm_hybrid.model.dlrm import build_model
from dlrm_hybrid.model.mixed_dimensions import md_solver_widths, mixed_widths


def reference_md_solver(n, alpha, d0=None, B=None, round_dim=True, k=None):
    """facebookresearch/dlrm, tricks/md_embedding_bag.py (MIT licence): md_solver with
    alpha_power_rule and pow_2_round, verbatim but for layout."""
    n, indices = torch.sort(n)
    k = k[indices] if k is not None else torch.ones(len(n))
    d = alpha_power_rule(n.type(torch.float) / k, alpha, d0=d0, B=B)
    if round_dim:
        d = 2 ** torch.round(torch.log2(d.type(torch.float)))
    undo_sort = [0] * len(indices)
    for i, v in enumerate(indices):
        undo_sort[v] = i
    return d[undo_sort]


def alpha_power_rule(n, alpha, d0=None, B=None):
    if d0 is not None:
        lamb = d0 * (n[0].type(torch.float) ** alpha)
    elif B is not None:
        lamb = B / torch.sum(n.type(torch.float) ** (1 - alpha))
    else:
        raise ValueError("Must specify either d0 or B")
    d = torch.ones(len(n)) * lamb * (n.type(torch.float) ** (-alpha))
    for i in range(len(d)):
        if i == 0 and d0 is not None:
            d[i] = d0
        else:
            d[i] = 1 if d[i] < 1 else d[i]
    return torch.round(d).type(torch.long)


FL15 = [7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828, 11,
        2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97, 35]


@pytest.mark.parametrize("alpha", [0.1, 0.2, 0.3, 0.5])
@pytest.mark.parametrize("round_dims", [True, False])
def test_widths_are_facebookresearch_dlrms_at_criteo_fl15(alpha, round_dims):
    want = reference_md_solver(torch.tensor(FL15), alpha, d0=128, round_dim=round_dims)
    assert md_solver_widths(FL15, alpha, 128, round_dims) == [int(w) for w in want]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(1, 50_000_000), min_size=1, max_size=30, unique=True),
       alpha=st.sampled_from([0.05, 0.1, 0.25, 0.3, 0.4, 0.6, 1.0]),
       d0=st.sampled_from([4, 16, 64, 128, 256]), round_dims=st.booleans())
def test_widths_are_facebookresearch_dlrms_on_any_counts(rows, alpha, d0, round_dims):
    """Distinct counts: torch.sort's order among equal counts is unspecified, and the widths
    of equal counts are equal anyway."""
    want = reference_md_solver(torch.tensor(rows), alpha, d0=d0, round_dim=round_dims)
    assert md_solver_widths(rows, alpha, d0, round_dims) == [int(w) for w in want]


def lookups(rows, dim=16, rules=(), **mixed):
    names = [f"cat_{i}" for i in range(len(rows))]
    return mixed_widths(feature_lookups(names, rows, [1] * len(rows), dim, list(rules)),
                        MixedDimensionsConfig(**mixed))


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(1, 10_000_000), min_size=1, max_size=20),
       alpha=st.floats(0.01, 1.0), dim=st.sampled_from([16, 32, 128]),
       round_dims=st.booleans(), threshold=st.sampled_from([0, 200, 10_000]))
def test_every_table_fbgemm_can_hold_no_wider_than_full_and_small_ones_kept(
        rows, alpha, dim, round_dims, threshold):
    got = lookups(rows, dim, temperature=alpha, round_dims=round_dims, threshold=threshold)
    solver = md_solver_widths(rows, alpha, dim, round_dims)
    for lookup, solved in zip(got, solver):
        (part,) = lookup.parts
        assert part.dim % 4 == 0 and 4 <= part.dim <= dim
        held = max(4, solved if round_dims else 4 * round(solved / 4))  # fbgemm: 4, 8, 12, ..
        want = dim if part.rows <= threshold else min(dim, held)
        assert (part.dim, part.projected) == (want, dim if want < dim else 0)
    narrowed = sorted((lk.rows, lk.parts[0].dim) for lk in got if lk.rows > threshold)
    widths = [w for _, w in narrowed]
    assert widths == sorted(widths, reverse=True)  # more rows, never a wider table


def test_temperature_zero_changes_nothing_and_qr_parts_are_narrowed_each_to_its_width():
    plain = feature_lookups(["cat_0", "cat_1"], [100_000, 10], [1, 1], 16, [])
    assert lookups([100_000, 10], temperature=0.0) == plain
    from dlrm_hybrid.config import CompositionalRule

    concat = lookups([100_000, 10], rules=[CompositionalRule(features=["cat_0"], collisions=10,
                                                             operation="concat")],
                     temperature=0.3, threshold=20)
    q, r = concat[0].parts
    assert (q.rows, q.projected) == (10_000, 8) and q.dim == 4  # half width each, projected back
    assert (r.rows, r.dim, r.projected) == (10, 8, 0)  # 10 rows: under the threshold


def test_the_lookup_is_each_narrow_tables_vectors_projected_to_full_width():
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        "model.mixed_dimensions.temperature=0.3", "model.interaction=cat",
        "model.compositional=[{technique: hash, features: [cat_1], buckets: 300}]"])
    data = SyntheticClicks(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.spec, embedding_device=torch.device("cpu"))
    widths = {p.table: (p.dim, p.projected) for lk in model.lookups for p in lk.parts}
    assert widths["t_cat_0"] == (4, 16) and widths["t_cat_1_h"] == (4, 16)
    assert widths["t_cat_3"] == (16, 0)
    batch = data.batch("val", 0, 64)
    with torch.no_grad():
        got = model.pooled_embeddings(batch.sparse)
    tables = {n.split(".")[-2]: w for n, w in model.embedding_bags.state_dict().items()}
    projections = iter(model.widen_parts.projections)
    features = batch.sparse.to_dict()
    for f, lookup in enumerate(model.lookups):
        (part,) = lookup.parts
        jagged = features[lookup.feature]
        ids = jagged.values() % (part.rows if lookup.technique == "hash" else lookup.rows)
        bags = torch.stack([tables[part.table][b].sum(0) for b in ids.split(
            jagged.lengths().tolist())])
        if part.projected:
            bags = bags @ next(projections).weight.T
        assert torch.allclose(got[:, f], bags, atol=1e-6), lookup.feature


@pytest.mark.parametrize("override, message", [
    ("model.mixed_dimensions.temperature=-0.1", r"model\.mixed_dimensions\.temperature: must be >= 0"),
    ("model.mixed_dimensions.base_width=6", r"model\.mixed_dimensions\.base_width: 6 must be a multiple of 4"),
    ("model.mixed_dimensions.base_width=32", r"base_width: 32 must be .* up to model\.embedding_dim \(16\)"),
    ("model.mixed_dimensions.threshold=-1", r"model\.mixed_dimensions\.threshold: must be >= 0"),
    ("model.interaction=fm", r"model\.interaction: 'fm' does not run with model\.mixed_dimensions"),
    ("parallel.exchange=des", r"parallel\.exchange: 'des' does not run with model\.mixed_dimensions"),
])
def test_bad_settings_are_one_line_config_errors(override, message):
    extra = (["model.interaction=cat"] if "des" in override else [])
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(str(ROOT / "configs/demo.yaml"),
                    ["model.mixed_dimensions.temperature=0.3", *extra, override])
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("config, message", [
    ("configs/two_tower_demo.yaml", "model.kind: 'two_tower' does not run with model.mixed_dim"),
    ("configs/demo.yaml", "model.sequence: 'hstu' does not run with model.mixed_dimensions")])
def test_retrieval_models_and_the_sequence_feature_refuse_mixed_dimensions(config, message):
    extra = ["model.sequence=hstu", "data.path=x"] if config == "configs/demo.yaml" else []
    with pytest.raises(ConfigError, match=message):
        load_config(str(ROOT / config), ["model.mixed_dimensions.temperature=0.3", *extra])


def test_plan_at_fl15_shows_the_narrow_tables_and_places_them_by_their_bytes(tmp_path):
    args = ["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "8",
            "--gpu-memory", "80GiB"]
    full = run_cli([*args, "--out", str(tmp_path / "full.json")])
    mixed = run_cli([*args, "--out", str(tmp_path / "mixed.json"),
                     "--set", "model.mixed_dimensions.temperature=0.3"])
    assert full.returncode == 0 and mixed.returncode == 0, failure(mixed)
    assert "cat_0 (7,912,889 rows): mixed dimension -> t_cat_0 7,912,889x" in mixed.stdout
    assert "mixed-dimension embeddings" in mixed.stdout and "saved" in mixed.stdout
    plans = {k: json.loads((tmp_path / f"{k}.json").read_text()) for k in ("full", "mixed")}
    tables = {k: sum(t["bytes"] for t in p["tables"].values()) for k, p in plans.items()}
    assert tables["mixed"] < tables["full"] / 4
    assert plans["mixed"]["tables"]["t_cat_0"]["dim"] < plans["full"]["tables"]["t_cat_0"]["dim"]
    assert set(plans["mixed"]["tables"]) == set(plans["full"]["tables"])


def sets(*overrides):
    return [arg for o in overrides for arg in ("--set", o)]


def test_one_and_two_ranks_reshard_resume_eval_and_export_alike(tmp_path):
    """A narrow table split column-wise over both ranks, others table-wise: 1 and 2 ranks give
    the same per-step losses, a 2-rank checkpoint resumes on 1 rank with the 2-rank run's
    losses, and eval and the export reproduce the run's AUC."""
    common = ["model.mixed_dimensions.temperature=0.2", "train.max_steps=12",
              "train.log_every=1", "checkpoint.every=6", "data.val_samples=4096",
              "train.progress_bar=false", "optim.dense=sgd", "optim.dense_lr=0.5",
              "checkpoint.resume=auto", "optim.embedding=adagrad"]
    result = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", "2",
                      "--out", str(tmp_path / "plan.json"), *sets(common[0])])
    assert result.returncode == 0, failure(result)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [plan["tables"][t]["dim"] for t in ("t_cat_0", "t_cat_1", "t_cat_3")] == [4, 8, 16]
    plan["tables"]["t_cat_1"].update(sharding="column_wise", ranks=[1, 0], columns=[4, 4])
    plan["tables"]["t_cat_0"].update(sharding="table_wise", ranks=[1], columns=[4])
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert_one_two_and_resumed_alike(tmp_path, common, tmp_path / "plan.json")
    other = run_cli(["train", "--config", "configs/demo.yaml",
                     *sets(*common[1:], "model.mixed_dimensions.temperature=0.3",
                           f"train.run_dir={tmp_path / 'two'}", "train.max_steps=14")])
    assert other.returncode == 2
    assert "model.mixed_dimensions.temperature (0.2 there, 0.3 here)" in other.stderr


def test_fp16_loss_scaling_trains_the_projections_as_fp32_does(tmp_path):
    """fp16's scaler cuts the backward at the lookup's output: the projections are part of the
    dense step whose gradients it unscales once (cut after them, they would get an unscaled
    gradient unscaled again: steps 1/65,536 of fp32's)."""
    from dlrm_hybrid.train.inference import read_model_state

    moved = {}
    for precision in ("fp32", "fp16"):
        run_dir = tmp_path / precision
        result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
            "model.mixed_dimensions.temperature=0.3", "train.max_steps=3", "train.eval_every=0",
            "train.progress_bar=false", "optim.dense=sgd", "optim.dense_lr=0.5",
            "optim.warmup_steps=0", f"train.precision={precision}", "checkpoint.every=1",
            "checkpoint.keep=3", "train.precision_fallback=false", "checkpoint.resume=none",
            f"train.run_dir={run_dir}")])
        assert result.returncode == 0, failure(result)
        first, last = (read_model_state(run_dir / "checkpoints" / f"step_{n}") for n in (1, 3))
        names = [k for k in last if k.startswith("widen_parts.")]
        moved[precision] = torch.cat([(last[k] - first[k]).flatten() for k in names])
    assert moved["fp32"].norm() > 0
    error = (moved["fp16"] - moved["fp32"]).norm() / moved["fp32"].norm()
    assert error < 0.1, error
