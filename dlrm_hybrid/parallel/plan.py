"""A placement: which rank owns which embedding table, or which columns of it, and which tables
every rank holds whole (replicated, torchrec `data_parallel`), with each rank's memory,
all-to-all and lookup load. The searches that make one: greedy_search.py (and
nvidia_heuristic.py); its file: plan_file.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.parallel.cost_model import DEVICES, DeviceConstants, StepTime, a2a_bytes, step_time
from dlrm_hybrid.parallel.tables import TableSpec, shard_columns


class PlacementError(UserError):
    """The tables cannot be placed within the per-rank memory budget."""


@dataclass(frozen=True)
class Shard:
    table: str
    rank: int
    col_offset: int
    cols: int


@dataclass
class Plan:
    world_size: int
    strategy: str
    budget_bytes: int  # for embedding tables, per rank
    batch_size: int  # global batch the traffic figures are for
    tables: Dict[str, TableSpec]
    shards: List[Shard]
    gpus_per_node: Optional[int] = None
    # Tables every rank holds whole (torchrec `data_parallel`): no shards, no all-to-all; their
    # gradients are all-reduced instead.
    replicated: FrozenSet[str] = frozenset()
    device: DeviceConstants = DEVICES["h100"]  # what `step_time` models
    # [3, world]: memory, all-to-all bytes sent (cost_model.a2a_bytes) and lookup bytes
    loads: np.ndarray = field(init=False, repr=False)
    _index: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.replicated = frozenset(self.replicated)
        self.loads = _rank_loads(self.tables, self.shards, self.world_size, self.batch_size)
        for name in sorted(self.replicated):  # every rank: the whole table, its own samples
            t = self.tables[name]
            self.loads[0] += t.bytes
            self.loads[2] += t.shard_lookup_bytes(t.dim, self.batch_size) / self.world_size
        self.loads[1] = sum(a2a_bytes(self))

    def shards_of(self, table: str) -> List[Shard]:
        """The column shards of a table; none for a replicated one."""
        return list(self._indexed()[0].get(table, ()))

    def sharding_type(self, table: str) -> str:
        if table in self.replicated:
            return "data_parallel"
        return "table_wise" if len(self.shards_of(table)) == 1 else "column_wise"

    def shards_on(self, rank: int) -> List[Shard]:
        return list(self._indexed()[1].get(rank, ()))

    def tables_on(self, rank: int) -> List[str]:
        return [s.table for s in self.shards_on(rank)]

    def _indexed(self) -> Tuple[Dict[str, List[Shard]], Dict[int, List[Shard]]]:
        """Shards by table and by rank, in shard order, made on first use (and again if `shards`
        is replaced or grows): scanning all shards per call made writing the plan file of
        10,000 tables take 11 s."""
        made_from, made_len, by_table, by_rank = self._index or (None, 0, {}, {})
        if made_from is not self.shards or made_len != len(self.shards):
            by_table, by_rank = {}, {}
            for s in self.shards:
                by_table.setdefault(s.table, []).append(s)
                by_rank.setdefault(s.rank, []).append(s)
            self._index = (self.shards, len(self.shards), by_table, by_rank)
        return by_table, by_rank

    def unplaced(self) -> Optional[str]:
        """What keeps this plan from training every table whole, or None. A sharded table's
        shards cover its columns once, from column 0, on distinct ranks (whole rows:
        there is no row-wise split); a replicated one has none. The planner, a plan file and the sharding all check it: a job never trains
        without a table."""
        by_table = self._indexed()[0]  # a shard of an unknown table fails in __post_init__
        for name in sorted(self.tables):
            shards = sorted(by_table.get(name, ()), key=lambda s: s.col_offset)
            if name in self.replicated:
                if shards:
                    return f"table {name} is both replicated and sharded"
                continue
            if not shards:
                return f"table {name} is on no rank and not replicated"
            ranks = [s.rank for s in shards]  # ranks outside 0..world-1 fail in __post_init__
            if len(set(ranks)) < len(ranks):
                return f"table {name} has shards on ranks {ranks}, not distinct ranks"
            ends = [s.col_offset + s.cols for s in shards]
            starts = [s.col_offset for s in shards]
            if starts != [0] + ends[:-1] or ends[-1] != self.tables[name].dim or \
                    min(s.cols for s in shards) < 1:
                spans = ", ".join(f"[{s.col_offset}:{s.col_offset + s.cols}]" for s in shards)
                return (f"table {name} has shards {spans}, not its {self.tables[name].dim} "
                        f"columns once each")
        return None

    def host_of(self, rank: int) -> int:
        return rank // self.gpus_per_node if self.gpus_per_node else 0

    def step_time(self) -> StepTime:
        return step_time(self, self.device)

    def imbalance(self) -> Dict[str, float]:
        """max/mean over ranks of memory, all-to-all and lookup load (1.0 is perfect)."""
        names = ("memory", "a2a", "lookup")
        return {n: _max_over_mean(row) for n, row in zip(names, self.loads)}


def _rank_loads(tables: Dict[str, TableSpec], shards: Sequence[Shard], world: int,
                batch: int) -> np.ndarray:
    """[3, world]: each rank's memory, (no) all-to-all and lookup bytes, added up in shard order
    (`np.add.at` adds in index order, one at a time); the shards' bytes by `TableColumns`: a few
    numpy calls for 10,000 shards, not two method calls each."""
    loads = np.zeros((3, world))
    if shards:
        memory, lookup = np.empty(len(shards)), np.empty(len(shards))
        for index, table, cols in shard_columns(tables, shards):
            memory[index] = table.shard_bytes(cols)
            lookup[index] = table.shard_lookup_bytes(cols, batch)
        ranks = np.array([s.rank for s in shards])  # not cast: a rank of 1.5 is an IndexError
        np.add.at(loads[0], ranks, memory)
        np.add.at(loads[2], ranks, lookup)
    return loads


def _max_over_mean(row: np.ndarray) -> float:
    mean = row.mean()
    return float(row.max() / mean) if mean > 0 else 1.0


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}TiB"
