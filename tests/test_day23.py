"""Day 23's halves: datasets split by the earlier rule (first floor(N/2) rows test) are known,
refused in MLPerf mode, and brought to the reference's rule (first ceil(N/2) rows validation)
in place by `preprocess day23`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import ROOT, failure, run_cli
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo.day23 import require_reference_rule, upgrade_day_23
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.criteo.multi_hot import make_multi_hot
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.split_binary_writer import REPORT, SplitBinaryWriter
from dlrm_hybrid.errors import DataError

CARDINALITIES = [50, 300, 7]


def rows(n, rng):
    return (rng.integers(0, 2, n), rng.random((n, 4)).astype(np.float16),
            [rng.integers(0, c, (n, 1)) for c in CARDINALITIES])


def take(columns, lo, hi):
    labels, dense, cats = columns
    return labels[lo:hi], dense[lo:hi], [c[lo:hi] for c in cats]


def old_rule_dataset(path, day_rows, seed=0, test_rows=None):
    """What `preprocess criteo|npy --split days` wrote before: day 23's first floor(N/2) rows
    test and the rest validation, nothing in feature_spec.yaml's metadata, a report saying
    `"split": "days"`. Returns (train rows, day 23 rows)."""
    rng = np.random.default_rng(seed)
    train, day = rows(30, rng), rows(day_rows, rng)
    test_rows = day_rows // 2 if test_rows is None else test_rows
    with SplitBinaryWriter(str(path), DataSpec(4, CARDINALITIES, [1] * 3)) as writer:
        writer.write("train", *train)
        writer.write("test", *take(day, 0, test_rows))
        writer.write("validation", *take(day, test_rows, day_rows))
        written = {"total": 30 + day_rows, **writer.counts}
        writer.add_file(REPORT, json.dumps({"rows_written": written, "split": "days"}))
    return train, day


def assert_split(path, split, expected):
    data = SplitBinaryDataset(str(path))
    ours = {"validation": "val"}.get(split, split)
    n = len(expected[0])
    assert data.num_samples(ours) == n
    got = data.columns(ours, 0, n)
    np.testing.assert_array_equal(got.labels, expected[0])
    np.testing.assert_array_equal(got.dense, expected[1].astype(np.float32))
    for ids, want in zip(got.ids, expected[2]):
        np.testing.assert_array_equal(ids, want)


def assert_reference_halves(path, train, day):
    ceil = len(day[0]) // 2 + len(day[0]) % 2
    assert_split(path, "train", train)
    assert_split(path, "validation", take(day, 0, ceil))
    assert_split(path, "test", take(day, ceil, None))
    assert load_feature_spec(str(path)).notes == {"day_23": "validation_first"}
    assert sorted(p.name for p in Path(path).iterdir() if p.name.startswith(".")) == []


@pytest.mark.parametrize("day_rows", [51, 50])  # odd: one row moves to validation
def test_an_old_rule_dataset_is_refused_in_mlperf_mode_and_upgraded_in_place(tmp_path, day_rows):
    train, day = old_rule_dataset(tmp_path / "data", day_rows)
    if day_rows % 2:  # through the CLI once: the refusal a user meets, in one line, exit 2
        result = run_cli(["train", "--config", str(ROOT / "configs/mlperf_dcnv2.yaml"),
                          "--set", f"data.path={tmp_path / 'data'}",
                          "--set", f"train.run_dir={tmp_path / 'run'}",
                          "--set", f"train.mlperf_log={tmp_path / 'mlperf.log'}"])
        assert result.returncode == 2, failure(result)
        (line,) = result.stderr.strip().splitlines()
        assert line == (f"error: {tmp_path / 'data'}: day 23 was split by an earlier rule (first "
                        f"half test, not validation as in the MLPerf reference); exchange the "
                        f"halves in place with `python -m dlrm_hybrid preprocess day23 --dataset "
                        f"{tmp_path / 'data'}` (no new preprocessing)")
        assert not (tmp_path / "mlperf.log").exists()  # refused before the log is begun
    else:
        with pytest.raises(DataError, match="day 23 was split by an earlier rule"):
            require_reference_rule(str(tmp_path / "data"))
    ceil = (day_rows + 1) // 2
    if day_rows % 2:
        result = run_cli(["preprocess", "day23", "--dataset", str(tmp_path / "data")])
        assert result.returncode == 0, failure(result)
        assert result.stdout.strip().endswith(f"(validation={ceil} test={day_rows - ceil})")
    else:
        assert upgrade_day_23(str(tmp_path / "data")) == {"rule": "test_first",
                                                         "validation": ceil, "test": ceil}
    assert_reference_halves(tmp_path / "data", train, day)
    report = json.loads((tmp_path / "data" / REPORT).read_text())
    assert report["rows_written"] == {"total": 30 + day_rows, "train": 30, "validation": ceil,
                                      "test": day_rows - ceil}
    require_reference_rule(str(tmp_path / "data"))  # MLPerf mode takes it now
    assert upgrade_day_23(str(tmp_path / "data"))["rule"] == "validation_first"  # nothing to do
    assert_reference_halves(tmp_path / "data", train, day)


def test_an_interrupted_upgrade_leaves_the_dataset_or_is_finished_by_running_again(
        tmp_path, monkeypatch):
    train, day = old_rule_dataset(tmp_path / "data", 41)
    before = {p: p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file()}
    real_rename, calls = Path.rename, []

    def rename_then_stop_at(n):
        def rename(self, target):
            calls.append(target)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real_rename(self, target)
        return rename

    monkeypatch.setattr(Path, "rename", rename_then_stop_at(1))  # the new halves, once whole
    with pytest.raises(KeyboardInterrupt):
        upgrade_day_23(str(tmp_path / "data"))
    assert {p: p.read_bytes() for p in (tmp_path / "data").rglob("*") if p.is_file()} == before
    calls.clear()
    monkeypatch.setattr(Path, "rename", rename_then_stop_at(4))  # validation swapped, not test
    with pytest.raises(KeyboardInterrupt):
        upgrade_day_23(str(tmp_path / "data"))
    monkeypatch.setattr(Path, "rename", real_rename)
    with pytest.raises(DataError, match=r"an upgrade of its day-23 split was interrupted; run "
                                        r"`python -m dlrm_hybrid preprocess day23 --dataset "):
        SplitBinaryDataset(str(tmp_path / "data"))
    with pytest.raises(DataError, match="day 23 was split by an earlier rule"):
        require_reference_rule(str(tmp_path / "data"))
    upgrade_day_23(str(tmp_path / "data"))
    assert_reference_halves(tmp_path / "data", train, day)


def test_what_the_upgrade_does_not_recognise_is_refused_and_left_unchanged(tmp_path):
    old_rule_dataset(tmp_path / "hash", 20)
    (tmp_path / "hash" / REPORT).write_text(json.dumps({"split": "hash"}))
    old_rule_dataset(tmp_path / "uneven", 21, test_rows=11)
    old_rule_dataset(tmp_path / "elsewhere", 21)
    spec = yaml.safe_load((tmp_path / "elsewhere" / "feature_spec.yaml").read_text())
    spec["source_spec"]["test"], spec["source_spec"]["validation"] = \
        spec["source_spec"]["validation"], spec["source_spec"]["test"]  # test/ is validation
    (tmp_path / "elsewhere" / "feature_spec.yaml").write_text(yaml.safe_dump(spec))
    for name, message in (
            ("hash", " is not split by days (day_23: none); there are no day-23 halves to "
                     "exchange"),
            ("uneven", " has 11 test and 10 validation rows, not the earlier rule's floor(N/2) "
                       "test rows; left as it is"),
            ("elsewhere", "'s validation files are not laid out as preprocess writes them "
                          "(DIR/validation/...); left as it is")):
        before = {p: p.read_bytes() for p in (tmp_path / name).rglob("*") if p.is_file()}
        with pytest.raises(DataError, match=re.escape(f"--dataset: {tmp_path / name}{message}")):
            upgrade_day_23(str(tmp_path / name))
        assert {p: p.read_bytes() for p in (tmp_path / name).rglob("*") if p.is_file()} == before
    require_reference_rule(str(tmp_path / "hash"))  # not a day split: nothing to refuse
    # a folder that is no dataset (the .npy days, say) is named by its flag, not as data.path
    with pytest.raises(ConfigError, match=re.escape(f"--dataset: cannot read {tmp_path}/")):
        upgrade_day_23(str(tmp_path))
    (tmp_path / "uneven" / REPORT).unlink()  # as an earlier `preprocess multihot` left it
    with pytest.raises(ConfigError, match=re.escape(f"--source: cannot read {tmp_path}/")):
        upgrade_day_23(str(tmp_path / "uneven"), str(tmp_path))


def strip_rule(path):
    """An earlier `preprocess multihot` recorded no rule."""
    spec = yaml.safe_load((path / "feature_spec.yaml").read_text())
    del spec["metadata"]["day_23"]
    (path / "feature_spec.yaml").write_text(yaml.safe_dump(spec))


def test_an_older_multi_hot_dataset_is_upgraded_by_way_of_its_source(tmp_path):
    train, day = old_rule_dataset(tmp_path / "one_hot", 33)
    make_multi_hot(str(tmp_path / "one_hot"), str(tmp_path / "multi"), [3, 1, 2])
    assert load_feature_spec(str(tmp_path / "multi")).notes == {"day_23": "test_first"}
    strip_rule(tmp_path / "multi")
    with pytest.raises(DataError, match=r"how day 23 was split is not recorded \(an earlier "
                                        r"`preprocess multihot` wrote it\); run .* --source "):
        require_reference_rule(str(tmp_path / "multi"))
    with pytest.raises(DataError, match="add --source ONE_HOT_DIR"):
        upgrade_day_23(str(tmp_path / "multi"))
    old_rule_dataset(tmp_path / "other", 33, seed=1)
    with pytest.raises(DataError, match="are not .*other's day 23 in either order"):
        upgrade_day_23(str(tmp_path / "multi"), str(tmp_path / "other"))
    upgrade_day_23(str(tmp_path / "one_hot"))  # the source first: the digest tells either way
    result = run_cli(["preprocess", "day23", "--dataset", str(tmp_path / "multi"),
                      "--source", str(tmp_path / "one_hot")])
    assert result.returncode == 0, failure(result)
    one_hot, multi = SplitBinaryDataset(str(tmp_path / "one_hot")), \
        SplitBinaryDataset(str(tmp_path / "multi"))
    for split in ("val", "test"):
        a, b = one_hot.columns(split, 0, 17), multi.columns(split, 0, 17)
        assert one_hot.num_samples(split) == multi.num_samples(split)
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(a.ids[0][:, 0], b.ids[0][:, 0])  # first id: the one-hot's
    require_reference_rule(str(tmp_path / "multi"))
