"""Column splits: the pieces a table is placed as, each a column shard of it, split only as
torchrec builds it; the fewest that fit a rank's budget, and one more split where packing fails.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from dlrm_hybrid.parallel.plan import PlacementError, format_bytes
from dlrm_hybrid.parallel.tables import TableSpec


class _Piece(NamedTuple):
    """A column shard being placed. A named tuple (hashed, compared and made in C): as a frozen
    dataclass, making and hashing 10,000 of them took ~0.05 s of the plan."""
    table: TableSpec
    col_offset: int
    cols: int
    shard_count: int


def _split(ordered: Sequence[TableSpec], counts: Dict[str, int], world: int,
           made: Dict[str, Tuple[int, List[_Piece]]]) -> List[_Piece]:
    """Each table as `counts[name]` equal column shards (as near as the dim allows, at most one
    per rank); `made` keeps each table's pieces for the next round, where most counts stay."""
    pieces = []
    for t in ordered:
        count, mine = made.get(t.name, (0, []))
        if count != counts[t.name]:
            widths = _column_widths(t.dim, counts[t.name], world)
            mine = [_Piece(t, i * widths[0], w, len(widths)) for i, w in enumerate(widths)]
            made[t.name] = (counts[t.name], mine)
        pieces += mine
    return pieces


def _shards_to_fit(table: TableSpec, budget: int) -> int:
    """The fewest column shards whose widest fits in `budget` (or as many as the dim allows)."""
    if 0 < budget and table.bytes <= budget:  # what the loop finds, 10,000 tables 40 -> 5 ms
        return 1
    count = max(1, math.ceil(table.bytes / budget))
    while count < table.dim and table.shard_bytes(max(_column_widths(table.dim, count))) > budget:
        count += 1
    return count


def column_split_counts(dim: int) -> Tuple[int, ...]:
    """The shard counts n into which torchrec's `column_wise(ranks=[...n ranks])` really splits a
    table of `dim` columns: n must divide dim into widths divisible by 4 (fbgemm's row alignment,
    CPU and CUDA). Any other n raises there, or silently gives fewer, wider shards on the first
    ranks (`_find_base_dim`). Mirrored, not imported: torchrec's import would take `plan` from
    0.25 s to 4.3 s; tests/test_placement.py checks the mirror against torchrec itself."""
    return (1,) + tuple(n for n in range(2, dim // 4 + 1) if dim % n == 0 and (dim // n) % 4 == 0)


@lru_cache(maxsize=None)
def _column_widths(dim: int, count: int, max_count: int = 1 << 30) -> Tuple[int, ...]:
    """Equal widths summing to `dim`, at least `count` of them where the dim and `max_count`
    allow, split only as torchrec builds it (`column_split_counts`)."""
    counts = [c for c in column_split_counts(dim) if c <= max_count]
    chosen = next((c for c in counts if c >= count), counts[-1])
    return (dim // chosen,) * chosen


def _split_largest(ordered: Sequence[TableSpec], counts: Dict[str, int], world: int) -> bool:
    """Cut the table with the largest shards into more of them. False when none can be."""
    splittable = [(t.bytes / counts[t.name], t.name, more) for t in ordered
                  if (more := len(_column_widths(t.dim, counts[t.name] + 1, world))) > counts[t.name]]
    if not splittable:
        return False
    _, name, more = max(splittable)
    counts[name] = more
    return True


def _no_room(piece: _Piece, used: np.ndarray, budget: int, pieces: List[_Piece]) -> PlacementError:
    t = piece.table
    shard = f", shard of {piece.cols}/{t.dim} columns" if piece.shard_count > 1 else ""
    need = sum(p.table.shard_bytes(p.cols) for p in pieces)
    return PlacementError(
        f"table {t.name} ({format_bytes(t.bytes)}: {t.rows:,} rows x {t.dim}, {t.precision}, "
        f"{t.optimizer} state{shard}) does not fit: {len(used)} rank(s) of "
        f"{format_bytes(budget)} have {format_bytes(len(used) * budget - used.sum())} free in "
        f"total for tables needing {format_bytes(need)}")
