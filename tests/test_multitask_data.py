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
    from dlrm_hybrid.config_loading import load_config
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


# user, item, rating, timestamp: every user engages with 4 of the 8 items i1..i8 (one of them
# twice), so 2 negatives per engagement can always be drawn; x9 is engaged once (--min-count 2).
LOG = [(u, f"i{(3 * k + 2 * n) % 8 + 1}", 1 + (k * 7 + n * 3) % 5, 100 * n + k)
       for n, u in enumerate(("ann", "bob", "cy", "dee")) for k in range(4)]
LOG += [("ann", "i1", 5, 50), ("bob", "x9", 3, 7)]


@pytest.fixture(scope="module")
def ranking(tmp_path_factory):
    """`preprocess interactions --labels` of LOG (a BOM, a header, CRLF, one bad line)."""
    root = tmp_path_factory.mktemp("ranking")
    lines = ["user,item,rating,timestamp", *[",".join(map(str, row)) for row in LOG]]
    lines.insert(5, "bob,i3,4")  # a field short
    (root / "log.csv").write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    result = run_cli(["preprocess", "interactions", "--input", str(root / "log.csv"),
                      "--columns", "user,item,rating,timestamp", "--min-count", "2",
                      "--labels", "watched,liked:rating>=4,disliked:rating<=2",
                      "--ranking-negatives", "2", "--skip-bad-rows", "--output",
                      str(root / "out")])
    assert result.returncode == 0, failure(result)
    return root / "out", result.stdout


def test_ranking_dataset_labels_negatives_requests_and_rows(ranking):
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    out, stdout = ranking
    meta = yaml.safe_load((out / "feature_spec.yaml").read_text())["metadata"]
    assert meta["ranking_negatives"] == 2 and meta["request_feature"] == "user_id"
    assert meta["labels"] == {"watched": "every engagement", "liked": "rating >= 4",
                              "disliked": "rating <= 2"}
    assert meta["categorical_features"][:2] == ["user_id", "item_id"]
    users = (out / "users.txt").read_text().split()
    items = (out / "items.txt").read_text().split()
    data = SplitBinaryDataset(str(out))
    assert data.label_names == ("watched", "liked", "disliked")
    data.use_tasks(list(data.label_names), str(out))
    engaged = {(u, i) for u, i, _, _ in LOG if i != "x9"}
    seen, labelled = {}, []
    for split in ("train", "val", "test"):
        c = data.columns(split, 0, data.num_samples(split))
        pairs = [(users[u], items[i]) for u, i in zip(c.ids[0][:, 0], c.ids[1][:, 0])]
        positive = c.labels[:, 0] == 1
        if split == "train":  # what train's negatives never draw: its own engagements
            trained = {p for p, pos in zip(pairs, positive) if pos}
        for (user, item), labels, pos in zip(pairs, c.labels, positive):
            if pos:
                labelled.append((user, item, *labels.tolist()))
            else:  # a negative: every label 0, never engaged (train's: in train)
                assert (user, item) not in (trained if split == "train" else engaged)
                assert labels.tolist() == [0, 0, 0]
        for user in set(users):
            rows = [k for k, (u, _) in enumerate(pairs) if u == user]
            assert len(rows) == 3 * sum(positive[rows])  # 2 negatives per engagement
            if split != "train" and rows:  # a request: the user's rows are consecutive
                assert rows == list(range(rows[0], rows[0] + len(rows)))
        seen[split] = [p for p, pos in zip(pairs, positive) if pos]
        train_count = {u: sum(1 for v, _ in seen["train"] if v == u) for u in users}
        np.testing.assert_allclose(c.dense[:, 0], [np.log1p(train_count[u]) for u, _ in pairs],
                                   rtol=1e-3)  # train engagements only (no leakage)
    latest = {u: max(t for v, i, _, t in LOG if v == u and i != "x9") for u in users}
    assert len(seen["test"]) == 4 and all(  # each user's last engagement
        max(t for v, j, _, t in LOG if (v, j) == (u, i)) == latest[u] for u, i in seen["test"])
    assert sorted(labelled) == sorted((u, i, 1, r >= 4, r <= 2) for u, i, r, _ in LOG
                                      if i != "x9")  # each engagement once, labels by the rules
    done = done_fields(stdout)  # every row read is kept, skipped or below --min-count
    assert (done["rows"], done["kept"], done["skipped"], done["below_min_count"]) == (19, 17, 1, 1)


@pytest.mark.parametrize("args, says", [
    (["--labels", "watched,liked:rating>>4"], "--labels: 'liked:rating>>4' is not a label"),
    (["--ranking-negatives", "3"], "--ranking-negatives: for a ranking dataset; give --labels")])
def test_bad_ranking_request_is_one_line(tmp_path, args, says):
    log = tmp_path / "u.data"
    log.write_text("".join(f"{u}\t{i}\t4\t{u * i}\n" for u in range(3) for i in range(4)))
    result = run_cli(["preprocess", "interactions", "--input", str(log), *args,
                      "--output", str(tmp_path / "out")])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {says}") and not (tmp_path / "out").exists()
