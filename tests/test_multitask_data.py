"""Datasets with several named labels (split-binary, `synth --output` with model.tasks) and the
ranking datasets `preprocess interactions --labels` makes from an interaction log."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from conftest import done_fields, failure, run_cli

TASKS = ("model.tasks=[{name: click}, {name: like, head: [8]}]", "data.label_missing=0.4")
TINY = ("data.train_samples=2048", "data.val_samples=1024", "data.global_batch_size=256",
        "data.cardinalities=[50,20]", "model.embedding_dim=8", "model.bottom_mlp=[16,8]",
        "model.top_mlp=[16,1]")


def sets(*overrides: str) -> list:
    return [arg for o in overrides for arg in ("--set", o)]


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mann-Whitney AUC (no ties among float scores)."""
    ranks = np.argsort(np.argsort(scores)) + 1
    pos = labels == 1
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """`synth --output` of the tiny planted data: one label, and two tasks (like 40% missing)."""
    root = tmp_path_factory.mktemp("planted")
    for name, extra in (("one", ()), ("tasks", TASKS)):
        result = run_cli(["synth", "--output", str(root / name), *sets(*TINY, *extra)])
        assert result.returncode == 0, failure(result)
    return root


def test_one_label_dataset_reads_as_click_unchanged(planted):
    from dlrm_hybrid.config import load_config
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset
    from dlrm_hybrid.data.synthetic import SyntheticClicks

    spec = yaml.safe_load((planted / "one" / "feature_spec.yaml").read_text())
    assert spec["channel_spec"]["label"] == ["label"]  # NVIDIA's layout, as before
    assert spec["feature_spec"]["label"] == {"dtype": "bool"}
    assert "true_prob_labels" not in spec["metadata"]
    assert (planted / "one" / "train" / "label.bin").stat().st_size == 2048
    data = SplitBinaryDataset(str(planted / "one"))
    data.use_tasks([], "one")
    assert data.label_names == ("click",)
    got = data.columns("val", 0, 300)
    want = SyntheticClicks(load_config(None, list(TINY)).data).columns("val", 0, 300)
    assert got.labels.shape == (300,) and got.true_prob.shape == (300,)
    np.testing.assert_array_equal(got.labels, want.labels)
    np.testing.assert_array_equal(got.true_prob, want.true_prob)
    data.use_tasks(["click"], "one")  # model.tasks: [{name: click}] on a one-label dataset
    assert data.columns("val", 0, 300).labels.shape == (300, 1)


def test_multi_label_round_trip_with_missing_labels(tmp_path):
    from dlrm_hybrid.data.spec import DataSpec
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset
    from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
    from dlrm_hybrid.train.dataset_identity import dataset_identity, identity_changes

    rng = np.random.default_rng(0)
    n, spec = 40, DataSpec(2, [7], [1])
    labels = rng.integers(0, 2, (n, 3)).astype(np.float32)
    labels[rng.random(n) < 0.3, 2] = np.nan
    prob = rng.random((n, 3)).astype(np.float32)
    dense, ids = rng.random((n, 2)), [rng.integers(0, 7, (n, 1))]

    def write(out, names, rows):
        with SplitBinaryWriter(str(out), spec, labels=names) as writer:
            for split in ("train", "validation", "test"):
                writer.write(split, rows, dense, ids, prob)

    write(tmp_path / "a", ["watched", "liked", "disliked"], labels)
    fspec = yaml.safe_load((tmp_path / "a" / "feature_spec.yaml").read_text())
    assert fspec["feature_spec"]["liked"] == {"dtype": "bool"}
    assert fspec["feature_spec"]["disliked"] == {"dtype": "int8", "missing": -1}
    assert fspec["metadata"]["true_prob_labels"] == ["watched", "liked", "disliked"]
    raw = np.fromfile(tmp_path / "a" / "validation" / "label_disliked.bin", np.int8)
    np.testing.assert_array_equal(raw, np.nan_to_num(labels[:, 2], nan=-1))
    data = SplitBinaryDataset(str(tmp_path / "a"))
    assert data.label_names == ("watched", "liked", "disliked")
    data.use_tasks(["disliked", "watched"], "a")
    got = data.columns("val", 0, n)
    np.testing.assert_array_equal(got.labels, labels[:, [2, 0]])  # NaN where missing
    np.testing.assert_array_equal(got.true_prob, prob[:, [2, 0]])
    with pytest.raises(Exception, match="no label 'clicked'"):
        data.use_tasks(["clicked"], "a")

    other = labels.copy()
    other[:, 1] = 1 - other[:, 1]  # only the second label differs
    write(tmp_path / "b", ["watched", "liked", "disliked"], other)
    write(tmp_path / "c", ["watched", "loved", "disliked"], labels)
    here = dataset_identity(str(tmp_path / "a"))
    assert identity_changes(here, dataset_identity(str(tmp_path / "b")))
    assert any("labels" in c for c in identity_changes(here, dataset_identity(str(tmp_path / "c"))))


def test_synth_with_tasks_then_train_reports_each_oracle(planted, tmp_path):
    root = planted / "tasks"
    spec = yaml.safe_load((root / "feature_spec.yaml").read_text())
    assert spec["channel_spec"]["label"] == ["click", "like"]
    like = np.fromfile(root / "validation" / "label_like.bin", np.int8)
    assert 0.3 < (like == -1).mean() < 0.5  # data.label_missing=0.4, stored as missing
    assert set(np.fromfile(root / "validation" / "label_click.bin", np.int8)) <= {0, 1}
    truth = np.fromfile(root / "validation" / "true_prob.bin", np.float32).reshape(-1, 2)
    result = run_cli(["train", *sets(*TINY, *TASKS, f"data.path={root}", "train.max_steps=4",
                                     f"train.run_dir={tmp_path / 'run'}", "checkpoint.resume=none",
                                     "train.progress_bar=false")])
    assert result.returncode == 0, failure(result)
    done = done_fields(result.stdout)
    for t, (task, labels) in enumerate(
            (("click", np.fromfile(root / "validation" / "label_click.bin", np.int8)),
             ("like", like))):
        seen = labels >= 0
        assert done[f"oracle_auc_{task}"] == pytest.approx(auc(truth[seen, t], labels[seen]),
                                                           abs=1e-4)
