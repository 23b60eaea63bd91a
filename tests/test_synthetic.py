"""The planted-teacher dataset: deterministic, sliceable by rank, skewed like click logs."""

import numpy as np
import torch
from torchmetrics.functional.classification import binary_auroc

from dlrm_hybrid.config import DataConfig
from dlrm_hybrid.data.loader import rank_batches
from dlrm_hybrid.data.synthetic import SyntheticClicks

CFG = DataConfig(cardinalities=[1000, 50, 7], hotness=[1, 4, 2], train_samples=4096,
                 val_samples=1000, teacher_scale=1.5)


def test_same_seed_same_data_other_seed_other_data():
    a = SyntheticClicks(CFG).batch("train", 100, 64)
    b = SyntheticClicks(CFG).batch("train", 100, 64)
    c = SyntheticClicks(DataConfig(**{**CFG.__dict__, "seed": 7})).batch("train", 100, 64)
    assert torch.equal(a.dense, b.dense) and torch.equal(a.sparse.values(), b.sparse.values())
    assert torch.equal(a.labels, b.labels)
    assert not torch.equal(a.dense, c.dense)


def test_rank_slices_rebuild_the_global_batch_for_any_world_size():
    data = SyntheticClicks(CFG)
    whole = next(rank_batches(data, "train", 512, 0, 1))
    for world in (2, 4):
        parts = [next(rank_batches(data, "train", 512, r, world)) for r in range(world)]
        assert torch.equal(torch.cat([p.dense for p in parts]), whole.dense)
        assert torch.equal(torch.cat([p.labels for p in parts]), whole.labels)
        for key in whole.sparse.keys():
            joined = torch.cat([p.sparse[key].values() for p in parts])
            assert torch.equal(joined, whole.sparse[key].values())


def test_multi_hot_lengths_and_id_ranges():
    batch = SyntheticClicks(CFG).batch("train", 0, 256)
    for key, rows, hot in zip(batch.sparse.keys(), CFG.cardinalities, CFG.hotness):
        jagged = batch.sparse[key]
        assert torch.all(jagged.lengths() == hot)
        assert jagged.values().min() >= 0 and jagged.values().max() < rows


def test_category_frequencies_are_zipf_skewed():
    ids = SyntheticClicks(CFG).batch("train", 0, 4096).sparse["cat_0"].values().numpy()
    counts = np.bincount(ids, minlength=1000)
    assert counts[0] > 10 * counts[100] > 0  # id 0 most frequent, a long tail behind it
    assert counts[:10].sum() > 0.3 * len(ids)


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
