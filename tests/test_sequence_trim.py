"""What a history of thousands of slots (DLRMv4's 4,095) needs on CPU, each exact: the sequence
feature reads only the batch's longest history (the same outputs and gradients as over every
slot), gathers the action ids in one indexing, and the dataset's thousands of column files are
written and read within the process's file descriptors."""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dlrm_hybrid.model.sequence_feature import SequenceFeature, action_ids

SLOTS = 48
DIM = 8
HISTORY = [f"user_history{j}" for j in range(SLOTS)]
ACTIONS = [f"user_action{j}" for j in range(SLOTS)]
# the lookup's output order as a sharded collection may give it: not the features' order
KEYS = ["item_id", *HISTORY, "user_id", *ACTIONS]


def feature(seed: int = 0, dropout: float = 0.0) -> SequenceFeature:
    torch.manual_seed(seed)
    cfg = SimpleNamespace(layers=2, heads=2, attention_dim=4, linear_dim=4, dropout=dropout,
                          attention_chunk=0, checkpoint_layers=False)
    module = SequenceFeature(KEYS, ["user_id", "item_id", ACTIONS[0]], "item_id", HISTORY,
                             ACTIONS, DIM, cfg)
    with torch.no_grad():  # trained-like weights
        module.candidate.normal_()
        for layer in module.hstu.layers:
            layer.uvqk.normal_(0.0, 0.5)
            layer.rab.position.normal_()
    return module


def untrimmed(module: SequenceFeature, slots: torch.Tensor, actions: torch.Tensor):
    """The sequence feature over all SLOTS + 1 positions, as it was computed before the cut."""
    b = slots.shape[0]
    counts = (actions != 0).sum(1)
    history = (slots.index_select(1, module.history_slots)
               + slots.index_select(1, module.action_slots))
    candidate = (slots[:, KEYS.index("item_id")] + module.candidate)[:, None]
    at = counts.view(b, 1, 1).expand(b, 1, DIM)
    sequence = torch.cat([history, candidate], 1).scatter(1, at, candidate)
    vector = module.hstu(sequence, counts + 1).gather(1, at)
    features = slots.index_select(1, module.feature_slots)
    return torch.cat([features[:, :module.position], vector, features[:, module.position:]], 1)


def batch(lengths, seed: int = 1):
    """slots [B, K, D] and left-aligned actions [B, SLOTS] with these history lengths."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    actions = torch.randint(1, 33, (len(lengths), SLOTS), generator=g)
    actions = actions * (torch.arange(SLOTS)[None] < lengths[:, None])
    return torch.randn(len(lengths), len(KEYS), DIM, generator=g), actions


@pytest.mark.parametrize("lengths", [
    [5, 0, 17, 3, 9, 1], [SLOTS, 2, 0, SLOTS - 1], [0, 0, 0], [1], [12] * 4,
    np.random.default_rng(7).integers(0, 20, 64).tolist()])
def test_the_cut_history_gives_what_every_slot_gives_and_the_same_gradients(lengths):
    module = feature().train()  # dropout 0: training and the untrimmed path draw nothing
    slots, actions = batch(lengths)
    slots.requires_grad_(True)
    cut = module(slots, actions)
    (grad_cut,) = torch.autograd.grad((cut * torch.linspace(-1, 1, DIM)).sum(), slots)
    full = untrimmed(module, slots, actions)
    (grad_full,) = torch.autograd.grad((full * torch.linspace(-1, 1, DIM)).sum(), slots)
    assert cut.shape == full.shape == (len(lengths), 3, DIM)
    torch.testing.assert_close(cut, full, rtol=0, atol=1e-6)
    torch.testing.assert_close(grad_cut, grad_full, rtol=0, atol=1e-6)
    unread = [KEYS.index(k) for k in HISTORY[max(lengths):] + ACTIONS[max(lengths):]]
    assert not grad_cut[:, unread].any()  # the cut slots' embeddings get no update


def test_the_cut_reads_no_slot_past_the_longest_history():
    """Garbage past every row's history (NaN) does not reach the outputs: no slot there is
    read, not even to be masked (NaN x 0 would be NaN)."""
    module = feature().eval()
    slots, actions = batch([3, 7, 0, 5])
    slots[:, [KEYS.index(k) for k in HISTORY[7:] + ACTIONS[7:]]] = float("nan")
    with torch.no_grad():
        out = module(slots, actions)
    assert torch.isfinite(out).all()


def test_the_served_model_scripts_the_cut_and_gets_the_same_outputs():
    module = feature().eval()
    scripted = torch.jit.script(module)
    for lengths in ([4, 0, 11], [0, 0], [SLOTS, 1]):
        slots, actions = batch(lengths, seed=len(lengths))
        with torch.no_grad():
            torch.testing.assert_close(scripted(slots, actions), module(slots, actions),
                                       rtol=0, atol=0)
            torch.testing.assert_close(module(slots, actions), untrimmed(module, slots, actions),
                                       rtol=0, atol=1e-6)


def kjt(keys, batch_size: int, rng) -> KeyedJaggedTensor:
    """One id per row and key (the action keys), more for the others."""
    lengths = [np.full(batch_size, 1 if k.startswith("user_action") else 2) for k in keys]
    values = rng.integers(0, 33, int(sum(x.sum() for x in lengths)))
    return KeyedJaggedTensor(keys=list(keys), values=torch.from_numpy(values),
                             lengths=torch.from_numpy(np.concatenate(lengths)).int())


def test_action_ids_are_each_action_keys_column_in_the_actions_order():
    rng = np.random.default_rng(3)
    keys = ["user_id", *ACTIONS[::-1], "item_id", *HISTORY]  # actions stored in reverse
    sparse = kjt(keys, 5, rng)
    by_key = sparse.to_dict()
    want = torch.stack([by_key[a].values() for a in ACTIONS], 1)
    assert torch.equal(action_ids(sparse, ACTIONS), want)
    with pytest.raises(ValueError, match="^item_id: expected one action id per row$"):
        action_ids(sparse, [ACTIONS[0], "item_id"])


def test_the_writer_keeps_few_files_open_and_writes_every_byte(tmp_path, monkeypatch):
    """A dataset of more columns than MAX_OPEN (here 3) written in chunks: every file holds
    every chunk, in order, and no more than MAX_OPEN files are ever open."""
    import dlrm_hybrid.data.split_binary_writer as writer_module
    from dlrm_hybrid.data.spec import DataSpec
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    monkeypatch.setattr(writer_module, "MAX_OPEN", 3)
    features = 7
    spec = DataSpec(1, [100] * features, [1] * features)
    rng = np.random.default_rng(0)
    chunks = {s: [rng.integers(0, 100, (n, features)) for n in (4, 3, 5)]
              for s in ("train", "validation", "test")}
    with writer_module.SplitBinaryWriter(str(tmp_path / "out"), spec) as w:
        for k in range(3):
            for split, parts in chunks.items():
                ids = parts[k]
                w.write(split, ids[:, 0] % 2, ids[:, :1].astype(np.float32),
                        [ids[:, [j]] for j in range(features)])
                assert len(w._files) <= 3
    data = SplitBinaryDataset(str(tmp_path / "out"))
    for split, ours in (("train", "train"), ("validation", "val"), ("test", "test")):
        want = np.concatenate(chunks[split])
        got = data.columns(ours, 0, len(want))
        assert np.array_equal(np.concatenate(got.ids, 1), want)
        assert np.array_equal(got.labels, want[:, 0] % 2)


def test_small_column_files_are_read_without_holding_a_descriptor(tmp_path):
    """Each memory mapping keeps a descriptor open; a 4,095-slot history has 8,190 column files
    a split, more than a process may hold (20,000 here for three splits)."""
    from dlrm_hybrid.data.spec import DataSpec
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset
    from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter

    features = 300
    spec = DataSpec(1, [50] * features, [1] * features)
    rng = np.random.default_rng(1)
    with SplitBinaryWriter(str(tmp_path / "wide"), spec) as w:
        for split in ("train", "validation", "test"):
            ids = rng.integers(0, 50, (20, features))
            w.write(split, ids[:, 0] % 2, ids[:, :1].astype(np.float32),
                    [ids[:, [j]] for j in range(features)])
    before = len(os.listdir("/proc/self/fd"))
    data = SplitBinaryDataset(str(tmp_path / "wide"))
    assert len(os.listdir("/proc/self/fd")) - before < features  # not one per file
    assert data.columns("train", 0, 20).ids[features - 1].shape == (20, 1)
