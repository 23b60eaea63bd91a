"""CPU embedding tables: the SGD lookup and C update give fbgemm's results (up to rounding),
refuse ids outside their table, leave other table batches to fbgemm, and train the same on
2 ranks with 1 or 2 threads each; huge pages keep the values."""

import copy
from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

from conftest import ROOT, read_metrics
from shared_runs import equivalence_run
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.source import open_dataset
from dlrm_hybrid.parallel import cpu_lookup
from dlrm_hybrid.parallel.cpu_lookup import CpuSgdTBE, _all_modules, speed_up_cpu_tables
from dlrm_hybrid.parallel.host_memory import use_huge_pages
from dlrm_hybrid.train.loop import build_sharded_model


ROWS, DIM, BATCH = [50, 7, 300, 20, 1000], 8, 32


def table_batch(optimizer=OptimType.EXACT_SGD, weights_precision=SparseType.FP32):
    specs = [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in ROWS]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=optimizer, learning_rate=0.1,
                                                eps=0.01, weights_precision=weights_precision)
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
    torch.set_num_threads(2)  # the C update's tables on two OpenMP threads
    yield
    torch.set_num_threads(threads)


def test_the_c_update_is_built():
    assert cpu_lookup._library() is not None  # the install (setup.py) compiled csrc/cpu_lookup.c


@pytest.mark.parametrize("gradient_rows", ["contiguous", "strided"])
def test_sgd_lookup_and_update_match_fbgemm(gradient_rows, two_threads):
    def strided(grad):  # the same values, in rows of a wider buffer
        wide = torch.zeros(grad.shape[0], grad.shape[1] + 24)
        wide[:, 8:8 + grad.shape[1]] = grad
        return wide[:, 8:8 + grad.shape[1]]

    fbgemm = table_batch()
    ours = copy.deepcopy(fbgemm)
    assert speed_up_cpu_tables(ours) == 1 and type(ours) is CpuSgdTBE
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids, offsets = lookups(generator)
        expected, got = fbgemm(ids, offsets), ours(ids, offsets)
        # fbgemm sums a repeated row's gradients before its update; the C update applies them
        # in turn: the two round differently, by about an ulp per step
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        grad = torch.randn(expected.shape, generator=generator)
        expected.backward(grad)
        got.backward(strided(grad) if gradient_rows == "strided" else grad)
    assert not torch.equal(ours.weights_host, table_batch().weights_host)  # it did train
    torch.testing.assert_close(ours.weights_host, fbgemm.weights_host, rtol=0, atol=1e-5)


def test_id_outside_its_table_is_refused_and_changes_nothing():
    tbe = table_batch()
    speed_up_cpu_tables(tbe)
    before = tbe.weights_host.clone()
    ids, offsets = lookups(torch.Generator().manual_seed(1))
    ids[offsets[BATCH]] = ROWS[1]  # the first id of feature 1, one past its 7 rows
    with pytest.raises(IndexError, match=r"id 7 is outside table 1 \(7 rows\)"):
        tbe(ids, offsets)
    assert torch.equal(tbe.weights_host, before)


def test_other_table_batches_and_inputs_stay_with_fbgemm(monkeypatch):
    assert speed_up_cpu_tables(table_batch(OptimType.EXACT_ROWWISE_ADAGRAD)) == 0
    assert speed_up_cpu_tables(table_batch(weights_precision=SparseType.FP16)) == 0
    tbe = table_batch()
    speed_up_cpu_tables(tbe)
    ids, offsets = lookups(torch.Generator().manual_seed(2))
    weighted = tbe(ids, offsets, per_sample_weights=torch.ones(ids.numel()))  # fbgemm's path
    torch.testing.assert_close(weighted, tbe(ids, offsets))
    monkeypatch.setattr(cpu_lookup, "_library", lambda: None)  # installed without a compiler
    assert speed_up_cpu_tables(table_batch()) == 0


def test_sharded_cpu_model_uses_the_c_update(tmp_path, process_group):
    cfg = load_config(str(ROOT / "configs/demo.yaml"),
                      [f"train.run_dir={tmp_path}", "optim.embedding=sgd"])
    dmp, _ = build_sharded_model(cfg, open_dataset(cfg.data).spec, process_group, lambda _: None)
    assert any(type(m) is CpuSgdTBE for m in _all_modules(dmp))


def test_one_or_two_threads_train_the_same(tmp_path, one_rank_sgd):
    """One thread: the session's 1-rank SGD run (shared_runs.py), whose 8 tables are all the
    rank's own, on the C update. Two threads split them between them."""
    one_thread, _, one_thread_dir = one_rank_sgd
    two_threads, _ = equivalence_run(tmp_path / "2", 1, "sgd", {"OMP_NUM_THREADS": "2"})
    assert [read_metrics(run)[0]["threads"] for run in (one_thread_dir, tmp_path / "2")] == [1, 2]
    # Each table is updated whole by one thread, so the tables agree bit for bit; the MLP
    # GEMMs may round differently on 2 threads.
    assert len(two_threads) == 20 and two_threads == pytest.approx(one_thread, rel=1e-5)


def test_huge_pages_keep_the_values():
    table = torch.randn(3 << 20)  # 12 MiB: at least five whole 2 MiB pages inside
    before = table.clone()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    expected = thp.exists() and "[never]" not in thp.read_text()
    assert use_huge_pages(table) == expected
    assert torch.equal(table, before)
    assert not use_huge_pages(torch.randn(1000))  # no whole huge page inside
