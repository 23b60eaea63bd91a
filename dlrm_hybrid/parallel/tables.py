"""What an embedding table (or a column shard of one) costs the rank that owns it.

Memory: weights at their precision plus the fused optimizer's state, which fbgemm keeps in fp32
(SGD none, row-wise Adagrad one value per row of each shard, Adagrad one per weight, Adam two).
Traffic per training step at global batch B, forward and backward: the ids of the whole batch
come in (int64 ids + int32 lengths), the pooled fp32 vectors go out, their gradients come back.
Lookup: the weight bytes read by the forward and touched again by the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.data.interactions.interaction_meta import ACTION
from dlrm_hybrid.model.compositional import FeatureLookup, lookups_of

BYTES_PER_WEIGHT = {"fp32": 4, "fp16": 2}
OPTIMIZER_STATE_PER_ROW = {  # fp32 values per row of a shard with `cols` columns
    "sgd": lambda cols: 0,
    "rowwise_adagrad": lambda cols: 1,
    "adagrad": lambda cols: cols,
    "adam": lambda cols: 2 * cols,
}
ID_BYTES, LENGTH_BYTES, POOLED_BYTES = 8, 4, 4
# Optimizers whose update of a replicated table (dense, all-reduced gradient) is the fused sparse
# one's: a row no sample touched stays as it is. Adam's moments would decay on every row.
REPLICABLE_OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")
# Optimizers with state per row of each shard: a column split changes the update.
PER_SHARD_ROW_STATE = ("rowwise_adagrad",)


class _kept:
    """`functools.cached_property` without its lock (Python 3.11 takes one on each first read:
    10,000 tables' first `bytes` 15 -> 4 ms). A pure function of frozen fields: two threads
    racing both compute the same value."""

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func, self.__doc__ = func, func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        value = obj.__dict__[self.name] = self.func(obj)
        return value


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    precision: str = "fp32"
    optimizer: str = "sgd"
    hotness: float = 1.0  # mean ids per sample
    bags: int = 1  # pooled vectors per sample: the id slots of a multi-hot `mult` QR part, else 1

    @_kept
    def bytes(self) -> int:
        """Kept once read (the frozen fields cannot change): the placer reads it ~200,000 times
        for 10,000 tables, 0.3 s of a 1.5 s plan."""
        return self.shard_bytes(self.dim)

    def shard_bytes(self, cols: int) -> int:
        """Weights and optimizer state of a shard holding `cols` of the columns, all rows."""
        weights = self.rows * cols * BYTES_PER_WEIGHT[self.precision]
        return weights + self.rows * OPTIMIZER_STATE_PER_ROW[self.optimizer](cols) * 4

    @property
    def id_bytes(self) -> float:
        """Bytes per sample a shard takes in: the ids and the bags' lengths."""
        return ID_BYTES * self.hotness + self.bags * LENGTH_BYTES

    def pooled_bytes(self, cols: int) -> float:
        """Bytes per sample of a `cols` shard's pooled vectors (and of their gradients)."""
        return self.bags * POOLED_BYTES * cols

    def shard_a2a_bytes(self, cols: int, batch: int) -> float:
        """All-to-all bytes per step (ids in, pooled out, gradients back) of a `cols` shard."""
        return batch * (self.id_bytes + 2 * self.pooled_bytes(cols))

    def shard_lookup_bytes(self, cols: int, batch: int) -> float:
        """Weight bytes read in the forward and updated in the backward per step."""
        return 2 * batch * self.hotness * cols * BYTES_PER_WEIGHT[self.precision]


class TableColumns:
    """Tables of one precision and optimizer (or a table per shard) as numpy arrays of their
    fields, with TableSpec's formulas: its own methods, run on the arrays. Each element is the
    table's own value bit for bit (numpy's float64 operations are Python's; hotness is made float
    where Python would keep an integer, equal below 2**53): for 10,000 tables a few numpy calls
    instead of ~8,000 instructions a table and method call."""

    shard_bytes = TableSpec.shard_bytes
    bytes = property(TableSpec.bytes.func)  # type: ignore[attr-defined]
    id_bytes = TableSpec.id_bytes
    pooled_bytes = TableSpec.pooled_bytes
    shard_a2a_bytes = TableSpec.shard_a2a_bytes
    shard_lookup_bytes = TableSpec.shard_lookup_bytes

    def __init__(self, tables: Sequence[TableSpec]) -> None:
        self.precision, self.optimizer = tables[0].precision, tables[0].optimizer
        self.rows = np.array([t.rows for t in tables], np.int64)
        self.dim = np.array([t.dim for t in tables], np.int64)
        self.bags = np.array([t.bags for t in tables], np.int64)
        self.hotness = np.array([t.hotness for t in tables], np.float64)


def table_columns(tables: Sequence[TableSpec]) -> List[Tuple[np.ndarray, TableColumns]]:
    """`tables` by precision and optimizer: each kind's positions in `tables` and columns."""
    if len({(t.precision, t.optimizer) for t in tables}) == 1:  # the usual: one kind
        return [(np.arange(len(tables)), TableColumns(tables))]
    kinds: Dict[Tuple[str, str], List[int]] = {}
    for i, t in enumerate(tables):
        kinds.setdefault((t.precision, t.optimizer), []).append(i)
    return [(np.array(index), TableColumns([tables[i] for i in index]))
            for index in kinds.values()]


def shard_columns(tables: Mapping[str, TableSpec], shards: Sequence[Any]
                  ) -> List[Tuple[np.ndarray, TableColumns, np.ndarray]]:
    """Each shard's (`.table`, `.cols`) table as columns (`table_columns`), and the widths."""
    cols = np.array([s.cols for s in shards], np.int64)
    return [(index, columns, cols[index])
            for index, columns in table_columns([tables[s.table] for s in shards])]


def table_specs(cfg, spec, lookups: Optional[Sequence[FeatureLookup]] = None) -> List[TableSpec]:
    """The tables a config's model has over a dataset's features (`spec`: a DataSpec): one per
    feature, or its parts (model/compositional.py), each part seeing all of its feature's ids.
    `lookups`: `lookups_of(cfg.model, spec)` where the caller has them."""
    m = cfg.model
    hotness = dict(zip(spec.feature_names, spec.mean_hotness))
    hotness.setdefault(ACTION, 1)  # the sequence feature's action table: its slots' one id each
    return [TableSpec(part.table, part.rows, part.dim, m.embedding_precision, cfg.optim.embedding,
                      hotness[lookup.feature], lookup.slots)
            for lookup in (lookups_of(m, spec) if lookups is None else lookups)
            for part in lookup.tables]
