"""NVIDIA DLRM's placement heuristic as its README states it, made memory-aware: largest table
first, each to the rank with the most free memory, at most ceil(T/G) per rank (`parallel.strategy
nvidia`; uncapped, greedy_search.py's fallback and its check that the tables fit).
"""

from __future__ import annotations

import math
from typing import Dict, List

import numpy as np

from dlrm_hybrid.parallel.column_split import _no_room, _Piece
from dlrm_hybrid.parallel.plan import Shard


def _place_nvidia(pieces: List[_Piece], world: int, budget: int,
                  capped: bool = True) -> List[Shard]:
    """Largest table first, each piece to the rank with the most free memory (below the cap
    of ceil(pieces / ranks) unless `capped` is False)."""
    cap = math.ceil(len(pieces) / world) if capped else len(pieces)
    free = np.full(world, float(budget))
    open_free = free.copy()  # free memory of the ranks below the cap, -inf at it
    count = np.zeros(world, dtype=int)
    holders: Dict[str, List[int]] = {}
    shards = []
    for piece in pieces:  # already largest table first
        size = piece.table.shard_bytes(piece.cols)
        taken = holders.setdefault(piece.table.name, [])
        allowed = open_free
        if taken:
            allowed = open_free.copy()
            allowed[taken] = -np.inf
        rank = int(allowed.argmax())  # the most free memory, the lower rank on a tie
        if allowed[rank] == -np.inf or size > free[rank]:
            raise _no_room(piece, budget - free, budget, pieces)
        free[rank] -= size
        count[rank] += 1
        open_free[rank] = free[rank] if count[rank] < cap else -np.inf
        taken.append(rank)
        shards.append(Shard(piece.table.name, rank, piece.col_offset, piece.cols))
    return shards
