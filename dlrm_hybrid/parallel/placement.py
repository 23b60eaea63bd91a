"""Which rank owns which embedding table: a largest-first, memory-aware greedy placer.

This is NVIDIA DLRM's heuristic as its README states it (sort tables largest first, cap each
rank at ceil(T/G) tables, give the next table to the rank with the most free memory), with the
memory check its code leaves out: a table that does not fit is an error naming it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence

# Optimizer state per embedding row, in fp32 values, as fbgemm's fused optimizers keep it.
OPTIMIZER_STATE_VALUES = {
    "sgd": lambda dim: 0,
    "rowwise_adagrad": lambda dim: 1,
    "adagrad": lambda dim: dim,
    "adam": lambda dim: 2 * dim,
}
BYTES_PER_WEIGHT = {"fp32": 4, "fp16": 2}


class PlacementError(ValueError):
    """The tables cannot be placed within the per-rank memory budget."""


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    precision: str = "fp32"
    optimizer: str = "sgd"

    @staticmethod
    def of(table, precision: str, optimizer: str) -> "TableSpec":
        """From a torchrec EmbeddingBagConfig."""
        return TableSpec(table.name, table.num_embeddings, table.embedding_dim, precision, optimizer)

    @property
    def weight_bytes(self) -> int:
        return self.rows * self.dim * BYTES_PER_WEIGHT[self.precision]

    @property
    def optimizer_bytes(self) -> int:
        return self.rows * OPTIMIZER_STATE_VALUES[self.optimizer](self.dim) * 4

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.optimizer_bytes


@dataclass
class Placement:
    world_size: int
    budget_bytes: int
    rank_of: Dict[str, int]  # table name -> owning rank
    tables: Dict[str, TableSpec]

    def tables_on(self, rank: int) -> List[str]:
        return [name for name, r in self.rank_of.items() if r == rank]

    def bytes_on(self, rank: int) -> int:
        return sum(self.tables[name].bytes for name in self.tables_on(rank))

    def describe(self) -> str:
        """A per-rank table for the log."""
        lines = [f"placement: {len(self.tables)} tables on {self.world_size} ranks, "
                 f"budget {format_bytes(self.budget_bytes)} per rank"]
        for rank in range(self.world_size):
            names = self.tables_on(rank)
            used = self.bytes_on(rank)
            rows = sum(self.tables[n].rows for n in names)
            lines.append(f"  rank {rank}: {len(names):3d} tables {rows:>12,d} rows "
                         f"{format_bytes(used):>10s} ({100 * used / self.budget_bytes:5.1f}%)  "
                         f"{', '.join(names)}")
        return "\n".join(lines)


def place_tables(tables: Sequence[TableSpec], world_size: int, budget_bytes: int) -> Placement:
    """Largest table first, each to the rank with most free memory among those under the cap."""
    cap = math.ceil(len(tables) / world_size)
    free = [budget_bytes] * world_size
    count = [0] * world_size
    rank_of: Dict[str, int] = {}
    for table in sorted(tables, key=lambda t: (-t.bytes, t.name)):
        open_ranks = [r for r in range(world_size) if count[r] < cap]
        rank = max(open_ranks, key=lambda r: (free[r], -r))
        if table.bytes > free[rank]:
            raise PlacementError(
                f"table {table.name} ({format_bytes(table.bytes)}: {table.rows:,} rows x {table.dim}, "
                f"{table.precision}, {table.optimizer} state) does not fit: the most free memory on "
                f"any rank is {format_bytes(free[rank])} (rank {rank}, budget "
                f"{format_bytes(budget_bytes)}); raise parallel.memory_per_rank or add ranks")
        rank_of[table.name] = rank
        free[rank] -= table.bytes
        count[rank] += 1
    ordered = {t.name: rank_of[t.name] for t in tables}
    return Placement(world_size, budget_bytes, ordered, {t.name: t for t in tables})


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}TiB"
