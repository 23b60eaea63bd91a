"""Split-binary datasets and the two loaders: same batches, slices, shuffling, bad files."""

import itertools
import math
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, read_metrics, train_with_each_loader
from dlrm_hybrid.config import ConfigError, DataConfig
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.batch import Batch, ClickDataset, Columns
from dlrm_hybrid.data.dali_loader import DaliLoader
from dlrm_hybrid.data.loader import PrefetchLoader, rank_batches, rank_columns
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.synth_dataset import write_synthetic
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.train.loop import train

CPU = torch.device("cpu")
DATA = DataConfig(cardinalities=[300, 40, 7], hotness=[1, 3, 2], train_samples=5000,
                  val_samples=1000, teacher_scale=1.5)
UNIFORM = DataConfig(**{**DATA.__dict__, "hotness": [2, 5, 1], "hotness_distribution": "uniform"})


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "synth"
    write_synthetic(DATA, str(path))
    return path


def loaders_used(run_root):
    """{run: the loader each start of the run in run_root/<torch|dali> recorded}."""
    return {run: [e["loader"] for e in read_metrics(run_root / run) if "loader" in e]
            for run in ("torch", "dali")}


def same_batch(a, b):
    assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.valid, b.valid) and torch.equal(a.true_prob, b.true_prob)
    assert a.sparse.keys() == b.sparse.keys()
    for key in a.sparse.keys():
        assert torch.equal(a.sparse[key].values(), b.sparse[key].values())
        assert torch.equal(a.sparse[key].lengths(), b.sparse[key].lengths())


def test_split_binary_reads_back_what_synth_wrote(dataset_dir):
    disk, planted = SplitBinaryDataset(str(dataset_dir)), SyntheticClicks(DATA)
    assert disk.spec == planted.spec
    assert disk.sizes == {"train": 5000, "val": 1000, "test": 1000}
    a, b = disk.batch("val", 900, 200), planted.batch("val", 900, 200)
    keep = a.valid
    assert keep.sum() == 100 and torch.equal(keep, b.valid)
    assert torch.equal(a.labels[keep], b.labels[keep])
    assert torch.allclose(a.dense[keep], b.dense[keep], atol=2e-3)  # stored as float16
    assert torch.equal(a.sparse.values().reshape(-1)[:100], b.sparse.values().reshape(-1)[:100])


@pytest.mark.parametrize("split, shuffle", [("train", True), ("train", False), ("val", False)])
def test_torch_and_dali_loaders_yield_identical_batches(dataset_dir, split, shuffle):
    data = SplitBinaryDataset(str(dataset_dir))
    args = (data, split, 512, 1, 2, shuffle, 3)
    torch_loader = PrefetchLoader(rank_batches(*args), CPU, depth=3)
    dali_loader = DaliLoader(rank_columns(*args), data.spec.feature_names, CPU, depth=3)
    steps = 25 if split == "train" else None  # more than one epoch of training batches
    torch_batches = [b for _, b in zip(range(steps or 10**9), torch_loader)]
    dali_batches = [b for _, b in zip(range(steps or 10**9), dali_loader)]
    torch_loader.close(), dali_loader.close()
    assert len(torch_batches) == len(dali_batches) == (steps or 2)
    for a, b in zip(torch_batches, dali_batches):
        same_batch(a, b)


def test_torch_and_dali_loaders_agree_on_uniform_hotness():
    data = SyntheticClicks(UNIFORM)
    args = (data, "train", 512, 1, 2, True, 3)
    torch_loader = PrefetchLoader(rank_batches(*args), CPU, depth=3)
    dali_loader = DaliLoader(rank_columns(*args), data.spec.feature_names, CPU, depth=3)
    pairs = [pair for _, pair in zip(range(12), zip(torch_loader, dali_loader))]
    torch_loader.close(), dali_loader.close()
    assert len(pairs) == 12
    assert not torch.all(pairs[0][0].sparse["cat_1"].lengths() == 5)  # jagged, not full
    for a, b in pairs:
        same_batch(a, b)


def test_training_on_uniform_hotness_is_the_same_with_either_loader(tmp_path, process_group):
    runs = {}
    for loader in ("torch", "dali"):
        cfg = load_config(str(ROOT / "configs/demo.yaml"), [
            "data.hotness_distribution=uniform", "data.hotness=[4]", f"data.loader={loader}",
            "data.global_batch_size=256", "data.val_samples=1024", "train.max_steps=8",
            "train.log_every=1", "train.progress_bar=false", f"train.run_dir={tmp_path / loader}"])
        runs[loader] = train(cfg, process_group)
    assert loaders_used(tmp_path) == {"torch": ["torch"], "dali": ["dali"]}
    assert runs["torch"].losses == runs["dali"].losses and len(runs["torch"].losses) == 8
    assert runs["torch"].metrics == runs["dali"].metrics
    assert all(math.isfinite(loss) for loss in runs["torch"].losses)


def test_synth_output_refuses_uniform_hotness(tmp_path):
    with pytest.raises(ConfigError, match="data.hotness_distribution: 'uniform' .* fixed"):
        write_synthetic(UNIFORM, str(tmp_path / "out"))
    assert not list(tmp_path.iterdir())


def test_shuffled_order_is_shared_by_ranks_and_new_each_epoch():
    data = SyntheticClicks(DATA)
    per_epoch = 5000 // 500
    firsts = lambda rank: [b.dense[0] for _, b in zip(range(2 * per_epoch),  # noqa: E731
                                                      rank_batches(data, "train", 500, rank, 2, True, 7))]
    whole = [b.dense for _, b in zip(range(2 * per_epoch), rank_batches(data, "train", 500, 0, 1, True, 7))]
    for step, (r0, r1) in enumerate(zip(firsts(0), firsts(1))):
        assert torch.equal(r0, whole[step][0]) and torch.equal(r1, whole[step][250])
    epoch = lambda e: sorted(int(round(float(w[0, 0]) * 1e4)) for w in whole[e * per_epoch:(e + 1) * per_epoch])  # noqa: E731
    assert epoch(0) == epoch(1)  # each epoch holds every batch once ...
    assert [w[0, 0] for w in whole[:per_epoch]] != [w[0, 0] for w in whole[per_epoch:]]  # ... reordered


def test_evaluation_scores_every_sample_exactly_once(dataset_dir):
    data = SplitBinaryDataset(str(dataset_dir))
    labels = []
    for rank in range(3):
        for b in rank_batches(data, "val", 300, rank, 3):
            labels.append((b.true_prob[b.valid]))
    seen = torch.cat(labels)
    assert len(seen) == 1000
    whole = data.batch("val", 0, 1000).true_prob
    assert torch.equal(seen.sort().values, whole.sort().values)


def test_training_with_either_loader_gives_the_same_losses(dataset_dir, tmp_path, process_group):
    runs = train_with_each_loader(dataset_dir, tmp_path, process_group, batch=256, steps=25)
    assert loaders_used(tmp_path) == {"torch": ["torch"], "dali": ["dali"]}
    assert runs["torch"].losses == runs["dali"].losses
    assert runs["torch"].metrics == runs["dali"].metrics
    assert "oracle_auc" in runs["torch"].metrics  # synth keeps the planted probabilities


def test_nvidia_layout_without_validation_or_hotness_loads(tmp_path):
    """A dataset as NVIDIA's tools write it: train/ and test/, cat_i.bin features, no extras."""
    root = tmp_path / "nv"
    spec = {"channel_spec": {"categorical": ["cat_0.bin", "cat_1.bin"], "numerical": ["num_0", "num_1"],
                             "label": ["label"]},
            "feature_spec": {"cat_0.bin": {"dtype": "int8", "cardinality": 10},
                             "cat_1.bin": {"dtype": "int16", "cardinality": 1000},
                             "num_0": {"dtype": "float16"}, "num_1": {"dtype": "float16"},
                             "label": {"dtype": "bool"}},
            "metadata": {}, "source_spec": {}}
    for split, n in (("train", 64), ("test", 16)):
        (root / split).mkdir(parents=True)
        rng = np.random.default_rng(len(split))
        (root / split / "label.bin").write_bytes(rng.integers(0, 2, n).astype(np.bool_).tobytes())
        (root / split / "numerical.bin").write_bytes(rng.random((n, 2)).astype(np.float16).tobytes())
        (root / split / "cat_0.bin").write_bytes(rng.integers(0, 10, n).astype(np.int8).tobytes())
        (root / split / "cat_1.bin").write_bytes(rng.integers(0, 1000, n).astype(np.int16).tobytes())
        spec["source_spec"][split] = [
            {"type": "split_binary", "features": ["num_0", "num_1"], "files": [f"{split}/numerical.bin"]},
            {"type": "split_binary", "features": ["label"], "files": [f"{split}/label.bin"]},
            {"type": "split_binary", "features": ["cat_0.bin"], "files": [f"{split}/cat_0.bin"]},
            {"type": "split_binary", "features": ["cat_1.bin"], "files": [f"{split}/cat_1.bin"]}]
    (root / "feature_spec.yaml").write_text(yaml.safe_dump(spec))
    data = SplitBinaryDataset(str(root))
    assert data.spec.cardinalities == [10, 1000] and data.spec.hotness == [1, 1]
    assert data.sizes == {"train": 64, "val": 16, "test": 16}  # test doubles as validation
    batch = data.batch("train", 0, 8)
    expected = np.frombuffer((root / "train" / "cat_1.bin").read_bytes(), np.int16)[:8]
    assert batch.sparse["cat_1"].values().tolist() == expected.tolist()


def test_truncated_or_missing_files_are_one_line_errors(dataset_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(dataset_dir, broken)
    numerical = broken / "train" / "numerical.bin"
    whole = numerical.read_bytes()
    numerical.write_bytes(whole[:-7])
    with pytest.raises(DataError, match=f"{numerical}: .* truncated"):
        SplitBinaryDataset(str(broken))
    with pytest.raises(ConfigError, match="data.path: cannot read .*feature_spec.yaml"):
        SplitBinaryDataset(str(tmp_path / "nothing"))
    (broken / "train" / "cat_2.bin").unlink()
    numerical.write_bytes(whole)
    with pytest.raises(DataError, match="cat_2.bin: missing"):
        SplitBinaryDataset(str(broken))


def test_a_non_finite_dense_value_is_named_with_its_file_and_sample(dataset_dir, tmp_path):
    """A nan or inf in numerical.bin (a float16 overflow, a file made elsewhere) would train as a
    diverged loss whose advice is to lower the learning rates: the reader names it instead, in
    every split and read (a slice, a padded last batch, a streamed window's rows)."""
    broken = tmp_path / "broken"
    shutil.copytree(dataset_dir, broken)
    data = SplitBinaryDataset(str(broken))
    n, width = data.sizes["val"], data.spec.num_dense
    for split, folder, row, value in (("train", "train", 1234, np.inf),
                                      ("val", "validation", n - 1, np.nan)):
        numerical = np.memmap(broken / folder / "numerical.bin", np.float16, "r+")
        numerical[row * width + 2] = value
        numerical.flush()
        data = SplitBinaryDataset(str(broken))
        message = (f"{broken / folder / 'numerical.bin'}: sample {row}'s dense value 2 is "
                   f"{np.float32(value)}, not finite; ")
        first = row - row % 100
        with pytest.raises(DataError, match=f"^{message}"):
            data.columns(split, first, 100)
        assert data.columns(split, first - 100, 100).dense.shape == (100, width)  # before it
        data.add_rows("window", split, row - 5, row + 1)
        with pytest.raises(DataError, match=f"^{message}"):
            data.columns("window", 0, 16)  # padded past the window's last row


def test_a_label_other_than_0_1_or_missing_is_named_with_its_file_and_sample(dataset_dir,
                                                                           tmp_path):
    """A dataset made elsewhere with a label of 2 (a rating class) trained silently, the loss
    pushing that logit without bound; a stray byte of a bool label file trained as a positive.
    Missing labels (-1 in an int8 file) still read as NaN."""
    bool_labels = tmp_path / "bool"
    shutil.copytree(dataset_dir, bool_labels)
    several = tmp_path / "several"
    write_synthetic(DataConfig(**{**DATA.__dict__, "labels": ["click", "like"],
                                  "label_missing": 0.3, "train_samples": 1000}), str(several))
    for root, folder, split, name, value, allowed in (
            (bool_labels, "train", "train", "label.bin", 255, "0 or 1"),
            (several, "validation", "val", "label_like.bin", 2, "0 or 1 (-1: missing)"),
            (several, "train", "train", "label_like.bin", -3, "0 or 1 (-1: missing)")):
        labels = np.memmap(root / folder / name, np.uint8 if value > 127 else np.int8, "r+")
        labels[37] = value
        labels.flush()
        data = SplitBinaryDataset(str(root))
        message = (f"{root / folder / name}: sample 37's label is {value}, not {allowed}; "
                   f"the file is damaged or was made by another tool")
        with pytest.raises(DataError, match=f"^{re.escape(message)}"):
            data.columns(split, 0, 100)
        labels[37] = 1
        labels.flush()
    assert np.isnan(SplitBinaryDataset(str(several)).columns("train", 0, 1000).labels).any()


def test_loader_errors_reach_the_training_loop():
    def failing():
        yield SyntheticClicks(DATA).batch("train", 0, 8)
        raise DataError("disk gone")
    loader = PrefetchLoader(failing(), CPU)
    next(loader)
    with pytest.raises(DataError, match="disk gone"):
        next(loader)


class RowNumbers(ClickDataset):
    """A split of `n` rows whose one dense value is the row's number. It makes a one-run slice
    on a device itself, as the planted synthetic data does (`device_batches`): a loader given a
    device asks it for each such slice and makes a slice of several runs on the host."""

    device_batches = True
    spec = SimpleNamespace(feature_names=["row"])

    def __init__(self, n: int) -> None:
        self.n = n
        self.made_on_device = 0  # batches `batch` made

    def num_samples(self, split: str) -> int:
        return self.n

    def columns(self, split: str, first: int, count: int) -> Columns:
        index = np.arange(first, first + count)
        return Columns(index[:, None].astype(np.float32), np.zeros(count, np.float32),
                       index < self.n, [np.minimum(index, self.n - 1)[:, None]])

    def batch(self, split: str, first: int, count: int, device=None) -> Batch:
        self.made_on_device += 1
        return Batch.from_columns(self.columns(split, first, count),
                                  self.spec.feature_names).to(device or CPU)


def rows_read(data: RowNumbers, batch: int, rank: int, ranks: int, shuffle: bool, steps: int,
              path: str, start_step: int = 0):
    """The rows of each of a rank's first `steps` slices, read as columns ("host") or as batches
    made on a device ("device", here the CPU: `rank_batches(..., device=)`)."""
    args = (data, "train", batch, rank, ranks, shuffle, 5, start_step)
    if path == "host":
        parts = (c.dense[:, 0] for c in rank_columns(*args))
    else:
        parts = (b.dense[:, 0].numpy() for b in rank_batches(*args, device=CPU))
    return [part.astype(int).tolist() for part in itertools.islice(parts, steps)]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("rows, batch, ranks, shuffle", [
    (10, 4, 1, False), (10, 4, 2, True), (23, 6, 3, True), (24, 6, 2, True)])
def test_every_training_row_is_read_once_an_epoch(rows, batch, ranks, shuffle, path):
    """The rows the batches of 3 epochs touch, global batch after global batch: each run of
    `rows` consecutive ones holds every row once (a partial last batch carries over into the
    next epoch); shuffled epochs differ; a resumed reader goes on where the run was. The same
    on the device path, whose slices across an epoch's end are runs of rows made on the host."""
    data, steps = RowNumbers(rows), -(-3 * rows // batch)
    per_rank = [rows_read(data, batch, r, ranks, shuffle, steps, path) for r in range(ranks)]
    read = [row for step in zip(*per_rank) for part in step for row in part]
    epochs = [read[e * rows:(e + 1) * rows] for e in range(3)]
    assert all(sorted(epoch) == list(range(rows)) for epoch in epochs), epochs
    assert (epochs[0] != epochs[1]) == shuffle
    resumed = rows_read(data, batch, ranks - 1, ranks, shuffle, 1, path, start_step=steps - 1)
    assert resumed == per_rank[-1][-1:]
    assert (data.made_on_device > 0) == (path == "device")
