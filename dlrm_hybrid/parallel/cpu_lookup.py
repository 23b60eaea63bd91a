"""Fused embedding lookups on CPU that use every intra-op thread and wait less on memory.

fbgemm_gpu's CPU library is built without OpenMP (its .so files link no OpenMP runtime), so
`at::parallel_for` inside its kernels runs on one thread; and its fused backward sorts the ids,
then reads and writes each row without prefetching, waiting on memory for every one.

So a qualifying CPU table batch looks its rows up with torch's `embedding_bag` (fbgemm's kernel
inside torch, built with OpenMP) after a per-table id check, and updates the rows per run of
tables, the runs on separate threads: SGD with the small C library built with this package
(csrc/sgd_rows.c: no sort, prefetching), row-wise Adagrad and Adagrad (which need a sum per row
before their update) with fbgemm's own fused backward, giving the same result bit for bit. Its
tables go onto huge pages (host_memory.py).

`benchmarks/cpu_lookup.py`, configs/bench_cpu.yaml (26 tables x 100,000 rows, 2,048 x ~5.5 ids
each), 2 cores, ms per step:

    | way                              | lookup | SGD update |
    | fbgemm                           |    7.6 |       30.1 |
    | fbgemm, tables on 2 threads      |    7.5 |       17.8 |
    | csrc/sgd_rows.c                  |    8.1 |        5.2 |
    | csrc/sgd_rows.c, huge pages      |    6.5 |        4.5 |

A C lookup was tried too: 7.2 ms against 6.5 ms for `embedding_bag` on the same tables.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen)
from torch.nn.functional import embedding_bag

from dlrm_hybrid.parallel.host_memory import use_huge_pages

FUSED_BACKWARD = {
    OptimType.EXACT_SGD: torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu,
    OptimType.EXACT_ROWWISE_ADAGRAD:
        torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu,
    OptimType.EXACT_ADAGRAD: torch.ops.fbgemm.split_embedding_backward_codegen_adagrad_cpu,
}


def use_threaded_cpu_lookups(model: torch.nn.Module) -> int:
    """Make each qualifying CPU table batch of `model` use the threaded lookup; how many did."""
    count = 0
    for module in _all_modules(model):
        if type(module) is SplitTableBatchedEmbeddingBagsCodegen and _qualifies(module):
            module.__class__ = ThreadedCpuTBE  # same state, another forward
            use_huge_pages(module.weights_host)
            use_huge_pages(module.momentum1_host)  # Adagrad's: as large as the weights
            count += 1
    return count


def _all_modules(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Every submodule, also the lookups a torchrec sharded collection keeps in a plain list
    (`_lookups`) and leaves out of `modules()`."""
    yield module
    for child in [*module._modules.values(), *getattr(module, "_lookups", [])]:
        if child is not None:
            yield from _all_modules(child)


def _qualifies(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> bool:
    """fp32 rows of one width on the host, sum pooling, an optimizer with a CPU fused backward,
    and no table shared by two features (two threads must not update the same rows)."""
    dims = (tbe.D_offsets[1:] - tbe.D_offsets[:-1]).tolist()
    return (tbe.weights_host.numel() > 0 and tbe.weights_host.dtype == torch.float32
            and tbe.pooling_mode == PoolingMode.SUM and tbe.optimizer in FUSED_BACKWARD
            and len(set(dims)) == 1 and all(o % dims[0] == 0 for o in tbe.weights_offsets.tolist())
            and len(set(tbe.feature_table_map)) == len(tbe.feature_table_map))


class ThreadedCpuTBE(SplitTableBatchedEmbeddingBagsCodegen):
    """A CPU table batch whose lookup and update run on all intra-op threads (module docstring).
    Instances come from `use_threaded_cpu_lookups`; what they do not cover goes to fbgemm."""

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None, *args, **kwargs) -> torch.Tensor:
        if (per_sample_weights is not None or args or any(v is not None for v in kwargs.values())
                or offsets.numel() <= 1):
            return super().forward(indices, offsets, per_sample_weights, *args, **kwargs)
        indices, offsets = indices.long().contiguous(), offsets.long().contiguous()
        _check_ids(self, indices, offsets)
        return _ThreadedLookup.apply(self.placeholder_autograd_tensor, self, indices, offsets)


def _check_ids(tbe: ThreadedCpuTBE, indices: torch.Tensor, offsets: torch.Tensor) -> None:
    """Ids outside their table would read and update another table's rows here: refuse them."""
    counts = _ids_per_feature(offsets, len(tbe.feature_table_map)).tolist()
    ranges = [(f, ids) for f, ids in enumerate(torch.split(indices, counts)) if ids.numel()]
    if not ranges:
        return
    low_high = torch.stack([torch.stack(torch.aminmax(ids)) for _, ids in ranges])
    limits = tbe.rows_per_table[[f for f, _ in ranges]]
    bad = (low_high[:, 0] < 0) | (low_high[:, 1] >= limits)
    if bad.any():
        feature, ids = ranges[int(bad.nonzero()[0])]
        rows = int(tbe.rows_per_table[feature])
        bad_id = int(ids[(ids < 0) | (ids >= rows)][0])
        table = tbe.feature_table_map[feature]
        name = tbe.table_names[table] if tbe.table_names else table
        raise IndexError(f"embedding lookup: id {bad_id} is outside table {name} ({rows} rows); "
                         f"check the data's categorical ids against data.cardinalities")


def _ids_per_feature(offsets: torch.Tensor, features: int) -> torch.Tensor:
    bounds = offsets[::(offsets.numel() - 1) // features]
    return bounds[1:] - bounds[:-1]


class _ThreadedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, tbe: ThreadedCpuTBE, indices: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        ctx.tbe = tbe
        ctx.save_for_backward(indices, offsets)
        return _pooled(tbe, indices, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        indices, offsets = ctx.saved_tensors
        if grad.stride(1) != 1:  # rows of any stride will do, each row contiguous
            grad = grad.contiguous()
        update = (_sgd_update if ctx.tbe.optimizer == OptimType.EXACT_SGD and _sgd_rows()
                  else _fbgemm_update)
        _on_threads(lambda f0, f1: update(ctx.tbe, grad, indices, offsets, f0, f1),
                    _feature_groups(offsets, len(ctx.tbe.feature_table_map)))
        return None, None, None, None


def _pooled(tbe: ThreadedCpuTBE, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, F * D] as fbgemm returns it, from bags in feature-major order (bag f * B + b).
    Transposing the pooled output costs less than reordering the ids (0.5 vs 1.7 ms here)."""
    features, dim = len(tbe.feature_table_map), tbe.max_D
    batch = (offsets.numel() - 1) // features
    rows = indices + torch.repeat_interleave(tbe.weights_offsets // dim,
                                             _ids_per_feature(offsets, features),
                                             output_size=indices.numel())
    weights = tbe.weights_host.detach().view(-1, dim)
    pooled = embedding_bag(rows, weights, offsets, mode="sum", include_last_offset=True)
    return pooled.view(features, batch, dim).transpose(0, 1).reshape(batch, features * dim)


def _sgd_update(tbe: ThreadedCpuTBE, grad: torch.Tensor, indices: torch.Tensor,
                offsets: torch.Tensor, f0: int, f1: int) -> None:
    """csrc/sgd_rows.c for features [f0, f1)."""
    dim = tbe.max_D
    first_row = tbe.weights_offsets // dim
    _sgd_rows()(tbe.weights_host.data_ptr(), indices.data_ptr(), offsets.data_ptr(),
                first_row.data_ptr(), grad.data_ptr(), (offsets.numel() - 1) // len(first_row),
                grad.stride(0), dim, f0, f1, float(tbe.learning_rate_tensor))


def _fbgemm_update(tbe: ThreadedCpuTBE, grad: torch.Tensor, indices: torch.Tensor,
                   offsets: torch.Tensor, f0: int, f1: int) -> None:
    """fbgemm's fused backward for features [f0, f1): they are the whole table batch it sees."""
    batch = (offsets.numel() - 1) // len(tbe.feature_table_map)
    start, end = int(offsets[f0 * batch]), int(offsets[f1 * batch])
    d0, d1 = int(tbe.D_offsets[f0]), int(tbe.D_offsets[f1])
    args = [grad[:, d0:d1].contiguous(), tbe.weights_host, tbe.weights_placements[f0:f1],
            tbe.weights_offsets[f0:f1], tbe.D_offsets[f0:f1 + 1] - d0, tbe.max_D,
            # the TBE's own linear ids (hash_size_cumsum[f] + id) and their total
            torch.cat((tbe.hash_size_cumsum[f0:f1], tbe.hash_size_cumsum[-1:])),
            tbe.total_hash_size_bits, indices[start:end], offsets[f0 * batch:f1 * batch + 1] - start,
            tbe.pooling_mode, None, tbe.optimizer_args.stochastic_rounding]
    if tbe.optimizer == OptimType.EXACT_SGD:
        args += [tbe.learning_rate_tensor]
    else:
        args += [tbe.momentum1_host, tbe.momentum1_placements[f0:f1],
                 tbe.momentum1_offsets[f0:f1], tbe.learning_rate_tensor, tbe.optimizer_args.eps]
        if tbe.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
            args += [tbe.optimizer_args.weight_decay, tbe.optimizer_args.weight_decay_mode,
                     tbe.optimizer_args.max_norm]
    FUSED_BACKWARD[tbe.optimizer](*args)


def _feature_groups(offsets: torch.Tensor, features: int,
                    threads: Optional[int] = None) -> List[Tuple[int, int]]:
    """Up to `threads` (default: the intra-op threads) runs of consecutive features [f0, f1)
    with about equal numbers of ids: each cut goes where the ids before it come closest to an
    equal share."""
    threads = threads or torch.get_num_threads()
    before = [0] + _ids_per_feature(offsets, features).cumsum(0).tolist()  # ids before feature f
    cuts = [0]
    for k in range(1, min(threads, features)):
        share = before[-1] * k / threads
        cut = min(range(1, features), key=lambda f: abs(before[f] - share))
        if cuts[-1] < cut:
            cuts.append(cut)
    return list(zip(cuts, cuts[1:] + [features]))


def _on_threads(work: Callable[[int, int], None], groups: List[Tuple[int, int]]) -> None:
    """work(f0, f1) for every group, the first on this thread and each other on a worker; the
    C update and fbgemm's ops let go of the GIL, so the groups run in parallel."""
    pending = [_workers(len(groups) - 1).submit(work, *group) for group in groups[1:]]
    work(*groups[0])
    for job in pending:
        job.result()


@lru_cache(maxsize=None)
def _workers(count: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(count, thread_name_prefix="cpu_lookup")


@lru_cache(maxsize=None)
def _sgd_rows() -> Optional[Callable]:
    """csrc/sgd_rows.c as setup.py built it next to this package; None where it was not built
    (an install without a C compiler), and fbgemm's update runs instead."""
    package = Path(__file__).resolve().parents[1]
    built = [package / f"_sgd_rows{suffix}" for suffix in EXTENSION_SUFFIXES]
    path = next((p for p in built if p.exists()), None)
    if path is None:
        return None
    update = ctypes.CDLL(str(path)).sgd_rows
    update.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5 + [ctypes.c_float]
    update.restype = None
    return update
