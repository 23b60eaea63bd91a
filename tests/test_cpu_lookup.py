"""The threaded CPU lookup: fbgemm's results (bit for bit where fbgemm's update runs, up to
rounding with the C SGD update), table groups on every intra-op thread, a clear error for ids
outside their table, huge pages, and 2-rank training unchanged by threads."""

import copy
from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

from conftest import ROOT, failure, read_metrics, run_cli
from dlrm_hybrid.config import load_config
from dlrm_hybrid.data.source import open_dataset
from dlrm_hybrid.parallel import cpu_lookup
from dlrm_hybrid.parallel.cpu_lookup import (ThreadedCpuTBE, _all_modules, _feature_groups,
                                             use_threaded_cpu_lookups)
from dlrm_hybrid.parallel.host_memory import use_huge_pages
from dlrm_hybrid.train.loop import build_sharded_model

ROWS, DIM, BATCH = [50, 7, 300, 20, 1000], 8, 32


def table_batch(optimizer, weights_precision=None):
    specs = [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in ROWS]
    extra = {} if weights_precision is None else {"weights_precision": weights_precision}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=optimizer, learning_rate=0.1,
                                                eps=0.01, **extra)
    tbe.init_embedding_weights_uniform(-1.0, 1.0)
    return tbe


def lookups(generator, max_ids=6):
    """Feature-major bags (bag f * BATCH + b) with 0..max_ids ids each, in range."""
    lengths = torch.randint(0, max_ids + 1, (len(ROWS) * BATCH,), generator=generator)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    ids = [torch.randint(0, rows, (int(lengths[f * BATCH:(f + 1) * BATCH].sum()),),
                         generator=generator) for f, rows in enumerate(ROWS)]
    return torch.cat(ids), offsets


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two groups of tables, updated on two threads
    yield
    torch.set_num_threads(threads)


def train_both(optimizer, atol=0.0, steps=4, grad_of=lambda grad: grad):
    """fbgemm's table batch and a threaded copy, trained side by side on the same lookups;
    their lookups agree within `atol`, and so do their tables after training."""
    fbgemm = table_batch(optimizer)
    threaded = copy.deepcopy(fbgemm)
    assert use_threaded_cpu_lookups(threaded) == 1 and type(threaded) is ThreadedCpuTBE
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids, offsets = lookups(generator)
        assert len(_feature_groups(offsets, len(ROWS))) == 2
        expected, got = fbgemm(ids, offsets), threaded(ids, offsets)
        torch.testing.assert_close(got, expected, rtol=0, atol=atol)
        grad = torch.randn(expected.shape, generator=generator)
        expected.backward(grad)
        got.backward(grad_of(grad))
    assert not torch.equal(threaded.weights_host, table_batch(optimizer).weights_host)
    torch.testing.assert_close(threaded.weights_host, fbgemm.weights_host, rtol=0, atol=atol)
    return fbgemm, threaded


@pytest.mark.parametrize("optimizer", [OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.EXACT_ADAGRAD])
def test_adagrad_updates_are_fbgemms_bit_for_bit(optimizer, two_threads):
    fbgemm, threaded = train_both(optimizer)
    assert torch.equal(threaded.momentum1_host, fbgemm.momentum1_host)


def test_the_c_sgd_update_is_built_and_matches_fbgemm(two_threads):
    assert cpu_lookup._sgd_rows() is not None  # the install (setup.py) built csrc/sgd_rows.c
    # fbgemm sums a repeated row's gradients before the update, the C update applies them in turn
    train_both(OptimType.EXACT_SGD, atol=1e-5)


def test_the_c_sgd_update_reads_gradient_rows_of_any_stride(two_threads):
    def strided(grad):  # the same values, in rows of a wider buffer
        wide = torch.zeros(grad.shape[0], grad.shape[1] + 24)
        wide[:, 8:8 + grad.shape[1]] = grad
        return wide[:, 8:8 + grad.shape[1]]

    train_both(OptimType.EXACT_SGD, atol=1e-5, grad_of=strided)


def test_without_the_c_library_sgd_is_fbgemms_bit_for_bit(monkeypatch, two_threads):
    monkeypatch.setattr(cpu_lookup, "_sgd_rows", lambda: None)
    train_both(OptimType.EXACT_SGD)


def test_feature_groups_balance_ids_over_threads():
    counts = torch.tensor([100, 1, 1, 100, 0, 50])
    offsets = torch.zeros(len(counts) * 2 + 1, dtype=torch.long)
    offsets[1:] = torch.stack([counts, torch.zeros_like(counts)], 1).flatten().cumsum(0)  # B = 2
    assert _feature_groups(offsets, 6, 1) == [(0, 6)]
    assert _feature_groups(offsets, 6, 2) == [(0, 3), (3, 6)]  # 102 and 150 ids
    for threads in (3, 4, 8):
        groups = _feature_groups(offsets, 6, threads)
        assert groups[0][0] == 0 and groups[-1][1] == 6 and len(groups) <= threads
        assert all(f0 < f1 == next_f0 for (f0, f1), (next_f0, _) in zip(groups, groups[1:]))


def test_id_outside_its_table_is_refused_and_changes_nothing():
    tbe = table_batch(OptimType.EXACT_SGD)
    use_threaded_cpu_lookups(tbe)
    before = tbe.weights_host.clone()
    ids, offsets = lookups(torch.Generator().manual_seed(1))
    ids[offsets[BATCH]] = ROWS[1]  # the first id of feature 1, one past its 7 rows
    with pytest.raises(IndexError, match=r"id 7 is outside table 1 \(7 rows\)"):
        tbe(ids, offsets)
    assert torch.equal(tbe.weights_host, before)


def test_other_table_batches_keep_fbgemms_lookup():
    assert use_threaded_cpu_lookups(table_batch(OptimType.EXACT_SGD, SparseType.FP16)) == 0
    tbe = table_batch(OptimType.EXACT_SGD)
    use_threaded_cpu_lookups(tbe)
    ids, offsets = lookups(torch.Generator().manual_seed(2))
    weighted = tbe(ids, offsets, per_sample_weights=torch.ones(ids.numel()))  # fbgemm's path
    torch.testing.assert_close(weighted, tbe(ids, offsets))


def test_sharded_cpu_model_uses_the_threaded_lookup(tmp_path, process_group):
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [f"train.run_dir={tmp_path}"])
    dmp, _ = build_sharded_model(cfg, open_dataset(cfg.data).spec, process_group, lambda _: None)
    assert any(type(m) is ThreadedCpuTBE for m in _all_modules(dmp))


def test_two_ranks_train_the_same_with_one_or_two_threads_each(tmp_path):
    losses = {}
    for threads in ("1", "2"):
        run_dir = tmp_path / threads
        overrides = ["train.max_steps=12", "train.log_every=1", "train.eval_every=0",
                     "train.progress_bar=false", "data.val_samples=2048", f"train.run_dir={run_dir}"]
        result = run_cli(["train", "--config", "configs/demo.yaml",
                          *[a for o in overrides for a in ("--set", o)]],
                         nproc=2, extra_env={"OMP_NUM_THREADS": threads})
        assert result.returncode == 0, failure(result)
        losses[threads] = [e["loss"] for e in read_metrics(run_dir) if "loss" in e]
    # The lookups agree bit for bit (above); the MLP GEMMs may round differently on 2 threads.
    assert len(losses["2"]) == 12 and losses["2"] == pytest.approx(losses["1"], rel=1e-5)


def test_huge_pages_keep_the_values():
    table = torch.randn(3 << 20)  # 12 MiB: at least five whole 2 MiB pages inside
    before = table.clone()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    expected = thp.exists() and "[never]" not in thp.read_text()
    assert use_huge_pages(table) == expected
    assert torch.equal(table, before)
    assert not use_huge_pages(torch.randn(1000))  # no whole huge page inside
