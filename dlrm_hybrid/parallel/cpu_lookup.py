"""Embedding tables on CPU: on huge pages, and for SGD a lookup and update that use every core.

fbgemm_gpu's CPU library is built without OpenMP (its .so files link no OpenMP runtime), so
`at::parallel_for` inside its kernels runs on one thread; and its fused SGD backward sorts the
ids, then reads and writes each row without prefetching, waiting on memory for every one.

So every sharded CPU table batch goes onto huge pages (host_memory.py), and one trained with SGD checks
its ids against their tables and updates its rows with the small C library built with this
package (csrc/cpu_lookup.c: no sort, prefetching, on torch's OpenMP threads), and looks its rows
up with torch's `embedding_bag` (fbgemm's kernel inside torch, built with OpenMP). Where that
library was not built (an install without a C compiler), fbgemm does it all.

`benchmarks/cpu_lookup.py --steps 96`, configs/bench_cpu.yaml (26 tables x 100,000 rows, 2,048 x
~5.5 ids each), 2 cores, ms per step:

    | way                              | lookup | SGD update |
    | fbgemm                           |    7.3 |       17.2 |
    | fbgemm, huge pages               |    7.0 |       15.6 |
    | csrc/cpu_lookup.c                |    6.9 |        4.6 |
    | csrc/cpu_lookup.c, huge pages    |    6.3 |        4.1 |

Replicated (data_parallel) tables are torchrec's dense table batches, trained by a torch
optimizer after DDP's all-reduce (train/optim.py): none of this applies to them, and
`speed_up_cpu_tables` leaves them as they are.

Tried and left out: a C lookup (7.2 ms against `embedding_bag`'s 6.5 ms); and fbgemm's backward
split by tables over Python threads (row-wise Adagrad has no C update): each thread starts its
own OpenMP team, whose idle threads spin and hold the cores (the demo model trained 2.4x slower).
"""

from __future__ import annotations

import bisect
import ctypes
from functools import lru_cache
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import Iterator, Optional

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen)
from torch.nn.functional import embedding_bag

from dlrm_hybrid.parallel.host_memory import use_huge_pages


def speed_up_cpu_tables(model: torch.nn.Module) -> int:
    """Huge pages for each CPU table batch of `model`, and the C SGD path for those that
    qualify; how many took that path."""
    count = 0
    for module in _all_modules(model):
        if type(module) is SplitTableBatchedEmbeddingBagsCodegen and module.weights_host.numel():
            use_huge_pages(module.weights_host)
            use_huge_pages(module.momentum1_host)  # Adagrad's is as large as the weights
            if _qualifies(module) and _library() is not None:
                module.__class__ = CpuSgdTBE  # same state, another forward
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
    """SGD on fp32 rows of one width, sum pooling, and no table shared by two features (two
    threads must not update the same rows)."""
    dims = (tbe.D_offsets[1:] - tbe.D_offsets[:-1]).tolist()
    return (tbe.optimizer == OptimType.EXACT_SGD and tbe.weights_host.dtype == torch.float32
            and tbe.pooling_mode == PoolingMode.SUM
            and len(set(dims)) == 1 and all(o % dims[0] == 0 for o in tbe.weights_offsets.tolist())
            and len(set(tbe.feature_table_map)) == len(tbe.feature_table_map))


class CpuSgdTBE(SplitTableBatchedEmbeddingBagsCodegen):
    """A CPU table batch trained with SGD whose lookup and update use every core (module
    docstring). Instances come from `speed_up_cpu_tables`; what they do not cover (per-sample
    weights, variable batch sizes) goes to fbgemm."""

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None, *args, **kwargs) -> torch.Tensor:
        if (per_sample_weights is not None or args or any(v is not None for v in kwargs.values())
                or offsets.numel() <= 1):
            return super().forward(indices, offsets, per_sample_weights, *args, **kwargs)
        indices, offsets = indices.long().contiguous(), offsets.long().contiguous()
        _check_ids(self, indices, offsets)
        return _SgdLookup.apply(self.placeholder_autograd_tensor, self, indices, offsets)


def _check_ids(tbe: CpuSgdTBE, indices: torch.Tensor, offsets: torch.Tensor) -> None:
    """Ids outside their table would read and update another table's rows here: refuse them."""
    features = len(tbe.feature_table_map)
    batch = _batch_size(offsets, features)
    bad = _library().first_bad_id(indices.data_ptr(), offsets.data_ptr(),
                                  tbe.rows_per_table.data_ptr(), batch, features)
    if bad >= 0:
        feature = bisect.bisect_right(offsets[::batch].tolist(), bad) - 1
        table = tbe.feature_table_map[feature]
        name = tbe.table_names[table] if tbe.table_names else table
        raise IndexError(f"embedding lookup: id {int(indices[bad])} is outside table {name} "
                         f"({int(tbe.rows_per_table[feature])} rows); check the data's "
                         f"categorical ids against data.cardinalities")


def _batch_size(offsets: torch.Tensor, features: int) -> int:
    return (offsets.numel() - 1) // features


def _ids_per_feature(offsets: torch.Tensor, features: int) -> torch.Tensor:
    bounds = offsets[::_batch_size(offsets, features)]
    return bounds[1:] - bounds[:-1]


class _SgdLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, tbe: CpuSgdTBE, indices: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        ctx.tbe = tbe
        ctx.save_for_backward(indices, offsets)
        return _pooled(tbe, indices, offsets)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        indices, offsets = ctx.saved_tensors
        if grad.stride(1) != 1:  # rows of any stride will do, each row contiguous
            grad = grad.contiguous()
        tbe = ctx.tbe
        dim, features = tbe.max_D, len(tbe.feature_table_map)
        first_row = tbe.weights_offsets // dim
        _library().sgd_rows(tbe.weights_host.data_ptr(), indices.data_ptr(), offsets.data_ptr(),
                            first_row.data_ptr(), grad.data_ptr(), _batch_size(offsets, features),
                            grad.stride(0), dim, features, float(tbe.learning_rate_tensor))
        return None, None, None, None


def _pooled(tbe: CpuSgdTBE, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, F * D] as fbgemm returns it, from bags in feature-major order (bag f * B + b).
    Transposing the pooled output costs less than reordering the ids (0.5 vs 1.7 ms here)."""
    features, dim = len(tbe.feature_table_map), tbe.max_D
    batch = _batch_size(offsets, features)
    rows = indices + torch.repeat_interleave(tbe.weights_offsets // dim,
                                             _ids_per_feature(offsets, features),
                                             output_size=indices.numel())
    weights = tbe.weights_host.detach().view(-1, dim)
    pooled = embedding_bag(rows, weights, offsets, mode="sum", include_last_offset=True)
    return pooled.view(features, batch, dim).transpose(0, 1).reshape(batch, features * dim)


@lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """csrc/cpu_lookup.c as setup.py built it next to this package; None where it was not."""
    package = Path(__file__).resolve().parents[1]
    built = [package / f"_cpu_lookup{suffix}" for suffix in EXTENSION_SUFFIXES]
    path = next((p for p in built if p.exists()), None)
    if path is None:
        return None
    library = ctypes.CDLL(str(path))
    pointer, integer = ctypes.c_void_p, ctypes.c_int64
    library.first_bad_id.argtypes = [pointer] * 3 + [integer] * 2
    library.first_bad_id.restype = integer
    library.sgd_rows.argtypes = [pointer] * 5 + [integer] * 4 + [ctypes.c_float]
    library.sgd_rows.restype = None
    return library
