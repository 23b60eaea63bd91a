"""`preprocess yambda --history-store timelines`: each row keeps only its place in its user's
timeline, and the reader gathers the history slots from timelines.npz at load time, the very
columns the slot files hold, in a fraction of the bytes; the ranker trains on it alike."""

import zipfile

import numpy as np
import pytest

from conftest import failure, generated_yambda, read_metrics, run_cli
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.timeline_history import mapped_member
from dlrm_hybrid.errors import DataError

SLOTS = 24


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("timelines")
    generated_yambda(root, "slots", ["20000", "--users", "200", "--items", "400", "--days", "10",
                                     "--seed", "4"], history=SLOTS)
    for name, extra in (("timelines", []), ("timelines_spilled", ["--partitions", "3"])):
        result = run_cli(["preprocess", "yambda", "--input", str(root / "log"), "--output",
                          str(root / name), "--history", str(SLOTS), "--history-store",
                          "timelines", *extra])
        assert result.returncode == 0, failure(result)
    return root


def _bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_the_slots_read_from_the_timelines_are_the_slot_files_columns(stores):
    slots = SplitBinaryDataset(str(stores / "slots"))
    for name in ("timelines", "timelines_spilled"):
        data = SplitBinaryDataset(str(stores / name))
        assert data.spec.feature_names == slots.spec.feature_names
        assert data.spec.cardinalities == slots.spec.cardinalities
        for split in ("train", "val", "test"):
            n = slots.num_samples(split)
            assert data.num_samples(split) == n
            for first, count in ((0, n + 5), (n // 3, 700)):  # the last batch padded, a middle one
                a, b = slots.columns(split, first, count), data.columns(split, first, count)
                assert len(b.ids) == 2 + 2 * SLOTS
                for k, (x, y) in enumerate(zip(a.ids, b.ids)):
                    assert x.shape == y.shape and np.array_equal(x, y), (name, split, k)
                assert np.array_equal(a.labels, b.labels) and np.array_equal(a.valid, b.valid)
    assert _bytes(stores / "timelines") < 0.5 * _bytes(stores / "slots")


def test_a_sequence_ranker_trains_on_either_store_alike(stores, tmp_path):
    losses = {}
    for name in ("slots", "timelines"):
        result = run_cli(["train", "--config", "configs/multitask_demo.yaml", *[a for s in [
            f"data.path={stores / name}", "model.sequence=hstu", "model.embedding_dim=8",
            "model.bottom_mlp=[16, 8]", "model.top_mlp=[16, 1]", "model.tasks=[{name: click}]",
            "value_model={}", "data.label_missing=0", "data.global_batch_size=128",
            "train.max_steps=8", "train.log_every=1", "train.eval_every=0",
            "train.progress_bar=false", f"train.run_dir={tmp_path / name}"]
            for a in ("--set", s)]])
        assert result.returncode == 0, failure(result)
        losses[name] = [e["loss"] for e in read_metrics(tmp_path / name) if "loss" in e]
    assert len(losses["slots"]) == 8 and losses["slots"] == losses["timelines"]


def test_timelines_that_cannot_be_mapped_are_refused_in_one_line(stores, tmp_path):
    with pytest.raises(DataError, match=r"timelines.npz: cannot map its items array"):
        mapped_member(tmp_path / "timelines.npz", "items")
    packed = tmp_path / "packed.npz"
    np.savez_compressed(packed, items=np.arange(100))
    with pytest.raises(DataError, match=r"^\S+packed.npz: its items array is compressed"):
        mapped_member(packed, "items")
    with zipfile.ZipFile(stores / "timelines" / "timelines.npz") as archive:
        assert {i.compress_type for i in archive.infolist()} == {zipfile.ZIP_STORED}


def test_the_datasets_identity_covers_the_offsets_and_the_timelines(stores, tmp_path):
    """A checkpoint's resume compares datasets by identity: other offsets or timelines are
    another dataset."""
    import shutil

    from dlrm_hybrid.train.dataset_identity import dataset_identity

    same = dataset_identity(str(stores / "timelines"))
    offsets, timelines = tmp_path / "offsets", tmp_path / "timelines"
    for copy in (offsets, timelines):
        shutil.copytree(stores / "timelines", copy)
    changed = np.fromfile(offsets / "train" / "timeline_offset.bin", np.uint32)
    changed[0] += 1
    changed.tofile(offsets / "train" / "timeline_offset.bin")
    with np.load(stores / "timelines" / "timelines.npz") as f:
        arrays = {key: f[key] for key in f.files}
    arrays["items"] = arrays["items"][::-1].copy()
    np.savez(timelines / "timelines.npz", **arrays)
    assert dataset_identity(str(stores / "timelines")) == same
    assert dataset_identity(str(offsets)) != same and dataset_identity(str(timelines)) != same
