"""The planted-teacher dataset: deterministic, sliceable by rank, skewed like click logs."""

import hashlib
import itertools

import numpy as np
import pytest
import torch
from torchmetrics.functional.classification import binary_auroc

from conftest import done_fields, failure, run_cli
from dlrm_hybrid.config import DataConfig
from dlrm_hybrid.data.loader import rank_batches
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data import synthetic
from dlrm_hybrid.data.synthetic import SyntheticClicks

CFG = DataConfig(cardinalities=[1000, 50, 7], hotness=[1, 4, 2], train_samples=4096,
                 val_samples=1000, teacher_scale=1.5)
UNIFORM = DataConfig(**{**CFG.__dict__, "hotness": [10, 1, 3], "hotness_distribution": "uniform"})


def test_same_seed_same_data_other_seed_other_data():
    a = SyntheticClicks(CFG).batch("train", 100, 64)
    b = SyntheticClicks(CFG).batch("train", 100, 64)
    c = SyntheticClicks(DataConfig(**{**CFG.__dict__, "seed": 7})).batch("train", 100, 64)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.labels, b.labels)
    assert not torch.equal(a.dense, c.dense)


@pytest.mark.parametrize("cfg", [CFG, UNIFORM], ids=["fixed", "uniform"])
def test_rank_slices_rebuild_the_global_batch_for_any_world_size(cfg):
    data = SyntheticClicks(cfg)
    whole = next(rank_batches(data, "train", 512, 0, 1))
    for world in (2, 4):
        parts = [next(rank_batches(data, "train", 512, r, world)) for r in range(world)]
        assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
        assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
        for key in whole.sparse.keys():
            for part in ("values", "lengths"):
                joined = torch.cat([getattr(p.sparse[key], part)() for p in parts])
                assert torch.equal(joined, getattr(whole.sparse[key], part)())
        assert torch.equal(torch.cat([p.true_prob for p in parts]), whole.true_prob)


def test_multi_hot_lengths_and_id_ranges():
    batch = SyntheticClicks(CFG).batch("train", 0, 256)
    for key, rows, hot in zip(batch.sparse.keys(), CFG.cardinalities, CFG.hotness):
        jagged = batch.sparse[key]
        assert torch.all(jagged.lengths() == hot)
        assert jagged.values().min() >= 0 and jagged.values().max() < rows


def test_uniform_hotness_lengths_are_1_to_h_and_the_kjt_holds_the_used_ids():
    data = SyntheticClicks(UNIFORM)
    columns = data.columns("train", 0, 4096)
    batch = data.batch("train", 0, 4096)
    for key, ids, lengths, hot in zip(batch.sparse.keys(), columns.ids, columns.lengths,
                                      UNIFORM.hotness):
        assert lengths.min() == 1 and lengths.max() == hot
        assert abs(lengths.mean() - (hot + 1) / 2) < 0.1 * hot  # 4096 draws: sd ~0.05 * hot
        if hot > 1:
            assert (np.bincount(lengths)[1:] > 0.5 * len(lengths) / hot).all()  # every size occurs
        jagged = batch.sparse[key]
        assert jagged.lengths().tolist() == lengths.tolist()
        assert jagged.values().tolist() == [i for row, n in zip(ids, lengths) for i in row[:n]]
    assert data.spec.mean_hotness == [5.5, 1.0, 2.0] and DataSpec.from_config(CFG).mean_hotness == [1, 4, 2]


def test_uniform_hotness_teacher_pools_only_the_used_ids():
    """The ids are the fixed-hotness ones; a sample using all of them gets the fixed-hotness
    probability, the others another one (their unused ids left out of the teacher's pooling)."""
    fixed_cfg = DataConfig(**{**UNIFORM.__dict__, "hotness_distribution": "fixed"})
    a = SyntheticClicks(fixed_cfg).columns("train", 0, 512)
    b = SyntheticClicks(UNIFORM).columns("train", 0, 512)
    assert all(np.array_equal(ids_a, ids_b) for ids_a, ids_b in zip(a.ids, b.ids))
    full = np.logical_and.reduce([n == h for n, h in zip(b.lengths, UNIFORM.hotness)])
    assert 0 < full.sum() < 512
    assert np.allclose(a.true_prob[full], b.true_prob[full], rtol=1e-6, atol=0)
    assert not np.isclose(a.true_prob[~full], b.true_prob[~full]).any()


def test_category_frequencies_are_zipf_skewed():
    ids = SyntheticClicks(CFG).batch("train", 0, 4096).sparse["cat_0"].values().numpy()
    counts = np.bincount(ids, minlength=1000)
    assert counts[0] > 10 * counts[100] > 0  # id 0 most frequent, a long tail behind it
    assert counts[:10].sum() > 0.3 * len(ids)


def test_scattered_ids_relabel_the_same_frequencies():
    """data.id_order=scattered: the same values with the same counts, the frequent ones no
    longer neighbours (the quotient of QR embeddings groups neighbours)."""
    scattered = DataConfig(**{**CFG.__dict__, "id_order": "scattered"})
    ordered = SyntheticClicks(CFG).batch("train", 0, 4096).sparse["cat_0"].values().numpy()
    ids = SyntheticClicks(scattered).batch("train", 0, 4096).sparse["cat_0"].values().numpy()
    assert ids.min() >= 0 and ids.max() < 1000
    assert sorted(np.bincount(ids, minlength=1000)) == sorted(np.bincount(ordered, minlength=1000))
    top = np.argsort(-np.bincount(ids, minlength=1000))[:8]
    assert len(set((top // 4).tolist())) == 8  # no two of the 8 most frequent share a quotient row


def test_validation_split_is_covered_once_with_padding_masked():
    data = SyntheticClicks(CFG)
    batches = list(rank_batches(data, "val", 512, 1, 2))  # rank 1 of 2
    assert len(batches) == 2  # ceil(1000 / 512)
    assert batches[0].valid.all() and batches[1].valid.sum() == 1000 - 512 - 256


def test_labels_follow_the_planted_probabilities():
    batch = SyntheticClicks(CFG).batch("val", 0, 1000)
    assert abs(batch.labels.mean() - batch.true_prob.mean()) < 0.05
    assert 0.7 < binary_auroc(batch.true_prob, batch.labels.long()) < 0.9
    train = SyntheticClicks(CFG).batch("train", 0, 1000)
    assert not torch.equal(train.dense, batch.dense)  # splits are disjoint streams


def test_ids_with_hotness_over_64_do_not_repeat_the_neighbouring_sample():
    """Slots once were index * 64 + 0..hot-1: with hotness 100 (MLPerf DCNv2's cat_20), sample
    i's ids 64..99 were sample i+1's ids 0..35."""
    cfg = DataConfig(cardinalities=[1_000_000], hotness=[100], zipf_exponent=0.5,
                     train_samples=4096, val_samples=64)
    ids = SyntheticClicks(cfg).columns("train", 0, 64).ids[0]
    for shift in range(1, 100):
        same = ids[:-1, shift:] == ids[1:, :100 - shift]
        assert same.mean() < 0.05, f"sample i+1 repeats sample i shifted by {shift}"


def test_ids_with_hotness_up_to_64_are_unchanged():
    """Runs and tests recorded on the synthetic data keep their exact ids: hotness <= 64 still
    draws slot index * 64 + k. Pinned values and digests of one batch (any change of a stream,
    seed mixing, slot stride or the Zipf inverse changes them)."""
    cfg = DataConfig(cardinalities=[1000, 50], hotness=[64, 3], train_samples=4096,
                     val_samples=64)
    ids = SyntheticClicks(cfg).columns("val", 10, 32).ids
    assert [a.shape for a in ids] == [(32, 64), (32, 3)]
    assert ids[0][0, :8].tolist() == [376, 1, 258, 38, 5, 4, 51, 8]
    assert ids[1][0].tolist() == [2, 33, 0] and ids[1][-1].tolist() == [8, 3, 6]
    digests = [hashlib.sha256(np.ascontiguousarray(a, dtype=np.int64).tobytes()).hexdigest()[:16]
               for a in ids]
    assert digests == ["001d24d0bb4cb1a3", "11ec5f5031e65d97"]


@pytest.mark.parametrize("cfg, first4, digest", [
    (CFG, [0.29134368896484375, 0.38987991213798523, 0.4630601108074188, 0.25595006346702576],
     "a43962a538d3f395"),
    (UNIFORM, [0.28944918513298035, 0.03343198075890541, 0.4352675974369049, 0.31423327326774597],
     "084c902750d5a7e2")], ids=["fixed", "uniform"])
def test_teacher_order_2_probabilities_are_unchanged(cfg, first4, digest):
    """data.teacher_order 2 (the default) is the teacher runs and tests were recorded on: its
    probabilities, pinned bit for bit from the pairwise-only teacher."""
    prob = SyntheticClicks(cfg).columns("val", 10, 256).true_prob
    assert prob[:4].tolist() == first4
    assert hashlib.sha256(prob.tobytes()).hexdigest()[:16] == digest


@pytest.mark.parametrize("tasks", [(), ("click", "like")], ids=["one label", "two tasks"])
@pytest.mark.parametrize("cfg", [CFG, UNIFORM], ids=["fixed", "uniform"])
def test_latent_vectors_kept_or_drawn_per_lookup_give_the_same_data(cfg, tasks, monkeypatch):
    """Tables small enough keep every row's teacher latent vector, drawn once and looked up;
    larger ones (over synthetic.LATENT_TABLE_ELEMENTS) draw each looked-up one: the same data
    bit for bit either way."""
    cfg = DataConfig(**{**cfg.__dict__, "label_missing": 0.3 if tasks else 0.0})
    def columns():
        data = SyntheticClicks(cfg, tasks)
        kept = data._constants(torch.device("cpu")).latent_rows(-1, cfg.teacher_dim) is not None
        return kept, data.columns("train", 1000, 300)

    kept, a = columns()
    monkeypatch.setattr(synthetic, "LATENT_TABLE_ELEMENTS", 0)
    drawn, b = columns()
    assert kept and not drawn
    assert a.true_prob.tobytes() == b.true_prob.tobytes()
    assert a.labels.tobytes() == b.labels.tobytes()  # NaN where missing, in the same places


@pytest.mark.parametrize("cfg", [CFG, UNIFORM], ids=["fixed", "uniform"])
def test_teacher_order_3_adds_the_three_way_products(cfg):
    """logit3 = b + (logit2 - b) / sqrt 2 + s * T / sqrt(2 C(n,3) / d^2), with T the sum over
    every triple of vectors i<j<k of sum_c z_ic z_jc z_kc, here enumerated triple by triple."""
    order2 = SyntheticClicks(cfg)
    order3 = SyntheticClicks(DataConfig(**{**cfg.__dict__, "teacher_order": 3}))
    cols2, cols3 = order2.columns("val", 0, 64), order3.columns("val", 0, 64)
    lengths = None if cols2.lengths is None else [torch.from_numpy(n) for n in cols2.lengths]
    z = order2._teacher_vectors(torch.from_numpy(cols2.dense).double(),
                                [torch.from_numpy(i) for i in cols2.ids], lengths)
    n, d = z.shape[1], z.shape[2]
    triples = list(itertools.combinations(range(n), 3))
    assert len(triples) == 4  # the dense vector and 3 tables
    brute = sum((z[:, i] * z[:, j] * z[:, k]).sum(dim=1) for i, j, k in triples)
    logit = lambda p: torch.logit(torch.from_numpy(p).double())
    bias, scale = -1.2, cfg.teacher_scale
    expected = bias + (logit(cols2.true_prob) - bias) / 2**0.5 \
        + scale * brute / (2 * len(triples) / d**2) ** 0.5
    assert torch.allclose(logit(cols3.true_prob), expected, atol=2e-5, rtol=0)
    pairwise, three_way = logit(cols2.true_prob) - bias, expected - logit(cols2.true_prob)
    assert 0.3 < three_way.std() / pairwise.std() < 3  # comparable parts, neither negligible


def test_teacher_order_3_in_a_training_run(tmp_path):
    """`--set data.teacher_order=3` reaches the data a run trains and is scored on: the run's
    oracle AUC is the order-3 teacher's, not the default one's."""
    sets = ["data.cardinalities=[1000,50,7]", "data.hotness=[1,4,2]", "data.val_samples=2048",
            "data.teacher_scale=1.5", "data.global_batch_size=256", "train.max_steps=1",
            "train.progress_bar=false", "data.teacher_order=3", f"train.run_dir={tmp_path}"]
    result = run_cli(["train", *[a for s in sets for a in ("--set", s)]])
    assert result.returncode == 0, failure(result)
    cfg = DataConfig(**{**CFG.__dict__, "val_samples": 2048})
    def oracle(order: int) -> float:
        data = SyntheticClicks(DataConfig(**{**cfg.__dict__, "teacher_order": order}))
        cols = data.columns("val", 0, 2048)
        return binary_auroc(torch.from_numpy(cols.true_prob), torch.from_numpy(cols.labels).long()).item()
    assert done_fields(result.stdout)["oracle_auc"] == pytest.approx(oracle(3), abs=1e-5)
    assert abs(oracle(3) - oracle(2)) > 1e-3


@pytest.mark.parametrize("sets, message", [
    (["data.teacher_order=4"], "error: data.teacher_order: 4 is not 2 (pairwise terms) or 3 "
                               "(pairwise and three-way terms); use 2 or 3"),
    (["data.teacher_order=3", "data.cardinalities=[5]"],
     "error: data.teacher_order: 3 needs three latent vectors (the dense one and at least 2 "
     "tables); add a table to data.cardinalities or use 2"),
], ids=["not-2-or-3", "one-table"])
def test_teacher_order_errors_are_one_line(tmp_path, sets, message):
    result = run_cli(["train", *[a for s in sets for a in ("--set", s)],
                      "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert result.returncode == 2 and result.stderr.strip() == message, result.stderr[-2000:]
    assert not (tmp_path / "run").exists()
