"""Which rank owns which embedding table, or which columns of it.

Two strategies over the same cost model (`tables.py`):

- `nvidia`: NVIDIA DLRM's heuristic as its README states it, made memory-aware: largest table
  first, each to the rank with the most free memory, at most ceil(T/G) per rank.
- `greedy` (default): largest first, each shard to the rank where it raises the higher of its
  normalised memory and all-to-all load (per rank, and per host) the least, within budget;
  lookup load breaks ties. Tables that are large against a rank's mean load are split column-wise (torchrec
  `column_wise`), finer and finer until memory and all-to-all are balanced within 10%.

Both split a table larger than one rank's budget column-wise over as many ranks as it needs.
Everything is deterministic: ties go to the lower rank, equal tables by name.
"""

from __future__ import annotations

import math
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.errors import UserError

from dlrm_hybrid.parallel.tables import TableSpec

STRATEGIES = ("greedy", "nvidia")
BALANCED = 1.08  # greedy refines until memory and all-to-all max/mean are within this (10% promised)
MAX_REFINEMENTS = 16  # greedy's rounds of splitting the largest tables on overloaded ranks


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
    loads: np.ndarray = field(init=False, repr=False)  # [3, world]: memory, a2a, lookup bytes
    _index: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.replicated = frozenset(self.replicated)
        self.loads = _rank_loads(self.tables, self.shards, self.world_size, self.batch_size)
        for name in sorted(self.replicated):  # every rank: the whole table, its own samples
            t = self.tables[name]
            self.loads[0] += t.bytes
            self.loads[2] += t.shard_lookup_bytes(t.dim, self.batch_size) / self.world_size

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

    def host_of(self, rank: int) -> int:
        return rank // self.gpus_per_node if self.gpus_per_node else 0

    def imbalance(self) -> Dict[str, float]:
        """max/mean over ranks of memory, all-to-all and lookup load (1.0 is perfect)."""
        names = ("memory", "a2a", "lookup")
        return {n: _max_over_mean(row) for n, row in zip(names, self.loads)}


def plan_tables(tables: Sequence[TableSpec], world_size: int, budget_bytes: int,
                batch_size: int, strategy: str = "greedy",
                gpus_per_node: Optional[int] = None) -> Plan:
    """Place every table (or its column shards) on ranks; PlacementError if they cannot fit,
    saying how many ranks of this budget would hold them.

    An error is certain where a table's narrowest shard (torchrec's column split over at most
    `world_size` ranks) exceeds the budget or the tables' bytes exceed all ranks' budgets. Packing
    is NP-hard: `nvidia` fails wherever its rule does; `greedy` (falling back to memory alone)
    may miss a packing that exists only where the tables need over 3/4 of all ranks' memory
    (random cases it missed needed 80-99%; tests/test_placement.py checks this contract)."""
    try:
        return _plan(tables, world_size, budget_bytes, batch_size, strategy, gpus_per_node)
    except PlacementError as e:
        narrowest = max(t.shard_bytes(min(_column_widths(t.dim, t.dim))) for t in tables)
        if narrowest > budget_bytes:
            raise PlacementError(f"{e}; even split column-wise as far as it goes, a shard needs "
                                 f"{format_bytes(narrowest)}: raise parallel.memory_per_rank") from None
        world = _ranks_needed(tables, world_size, budget_bytes, batch_size, strategy)
        raise PlacementError(f"{e}; {world} ranks of {format_bytes(budget_bytes)} would hold them "
                             f"(or raise parallel.memory_per_rank)") from None


def _ranks_needed(tables, failed_at: int, budget: int, batch: int, strategy: str) -> int:
    """The fewest ranks (found by doubling, then bisection) on which the tables fit."""
    fits = lambda world: _fits(tables, world, budget, batch, strategy)  # noqa: E731
    low = max(failed_at, math.ceil(sum(t.bytes for t in tables) / budget) - 1)  # does not fit
    high = low + 1
    while not fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def _fits(tables, world, budget, batch, strategy) -> bool:
    try:
        _plan(tables, world, budget, batch, strategy, None, refine=False)
        return True
    except PlacementError:
        return False


def _plan(tables: Sequence[TableSpec], world_size: int, budget_bytes: int, batch_size: int,
          strategy: str, gpus_per_node: Optional[int], refine: bool = True) -> Plan:
    """The plan of `strategy`; with `refine` False, greedy's first plan that fits (all that
    `_fits` asks: later rounds only balance it better)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    ordered = sorted(tables, key=lambda t: (-t.bytes, t.name))
    counts = {t.name: _shards_to_fit(t, budget_bytes) for t in ordered}
    make = lambda shards: Plan(world_size, strategy, budget_bytes, batch_size,  # noqa: E731
                               {t.name: t for t in tables}, shards, gpus_per_node)
    pieces_of: Dict[str, Tuple[int, List[_Piece]]] = {}  # kept from round to round
    if strategy == "nvidia":
        pieces = _split(ordered, counts, world_size, pieces_of)
        return make(_place_nvidia(pieces, world_size, budget_bytes))
    best, error, tried = None, None, []
    for _ in range(MAX_REFINEMENTS):
        pieces = _split(ordered, counts, world_size, pieces_of)
        try:
            plan = make(_place_min_max(pieces, world_size, budget_bytes, batch_size, gpus_per_node))
        except PlacementError as e:
            error = error or e
            tried.append(pieces)
            if best is not None or not _split_largest(ordered, counts, world_size):
                break
            continue  # a tighter packing may need smaller shards
        if not refine:
            return plan
        if best is None or _worst(plan) < _worst(best):
            best = plan
        if _worst(plan) <= BALANCED or not _split_overloaded(plan, counts):
            break
    if best is None:
        return make(_place_by_memory(tried, world_size, budget_bytes, error))
    return best


def _place_by_memory(tried: List[List[_Piece]], world: int, budget: int,
                     error: PlacementError) -> List[Shard]:
    """Where balancing traffic too strands a table, memory alone may still fit them: each
    split tried, largest table first to the most free memory (no cap); else the first error."""
    for pieces in tried:
        try:
            return _place_nvidia(pieces, world, budget, capped=False)
        except PlacementError:
            pass
    raise error


def _worst(plan: Plan) -> float:
    i = plan.imbalance()
    return max(i["memory"], i["a2a"])


def _split_largest(ordered: Sequence[TableSpec], counts: Dict[str, int], world: int) -> bool:
    """Cut the table with the largest shards into more of them. False when none can be."""
    splittable = [(t.bytes / counts[t.name], t.name, more) for t in ordered
                  if (more := len(_column_widths(t.dim, counts[t.name] + 1, world))) > counts[t.name]]
    if not splittable:
        return False
    _, name, more = max(splittable)
    counts[name] = more
    return True


def _split_overloaded(plan: Plan, counts: Dict[str, int]) -> bool:
    """On each rank over the balance target in the worse of memory and all-to-all, cut its
    largest still-divisible table into more column shards. False when none can be."""
    i = plan.imbalance()
    row = 0 if i["memory"] >= i["a2a"] else 1
    overloaded = set(np.flatnonzero(plan.loads[row] > BALANCED * plan.loads[row].mean()).tolist())
    by_rank: Dict[int, List[Shard]] = {}
    for s in plan.shards:
        if s.rank in overloaded:
            by_rank.setdefault(s.rank, []).append(s)
    grown = False
    for rank in sorted(by_rank):
        cost = lambda s: _shard_cost(plan.tables[s.table], s.cols, plan.batch_size)[row]  # noqa: E731
        for s in sorted(by_rank[rank], key=lambda s: (-cost(s), s.table)):
            t = plan.tables[s.table]
            more = len(_column_widths(t.dim, counts[t.name] + 1, plan.world_size))
            if more > counts[t.name]:
                counts[t.name] = more
                grown = True
                break
    return grown


# --- splitting ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
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
            widths = _column_widths(t.dim, counts[t.name], max_count=world)
            mine = [_Piece(t, i * widths[0], w, len(widths)) for i, w in enumerate(widths)]
            made[t.name] = (counts[t.name], mine)
        pieces += mine
    return pieces


def _shards_to_fit(table: TableSpec, budget: int) -> int:
    """The fewest column shards whose widest fits in `budget` (or as many as the dim allows)."""
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


# --- assignment -----------------------------------------------------------------------------

def _shard_cost(table: TableSpec, cols: int, batch: int) -> Tuple[float, float, float]:
    return (float(table.shard_bytes(cols)), float(table.shard_a2a_bytes(cols, batch)),
            float(table.shard_lookup_bytes(cols, batch)))


def _rank_loads(tables: Dict[str, TableSpec], shards: Sequence[Shard], world: int,
                batch: int) -> np.ndarray:
    """[3, world]: each rank's memory, all-to-all and lookup bytes, added up in shard order
    (`np.add.at` adds in index order, one at a time)."""
    costs: Dict[Tuple[str, int], Tuple[float, float, float]] = {}
    for s in shards:
        if (s.table, s.cols) not in costs:
            costs[s.table, s.cols] = _shard_cost(tables[s.table], s.cols, batch)
    loads = np.zeros((3, world))
    if shards:
        each = np.array([costs[s.table, s.cols] for s in shards], dtype=np.float64)
        ranks = np.array([s.rank for s in shards])  # not cast: a rank of 1.5 is an IndexError
        for row, cost in zip(loads, each.T):
            np.add.at(row, ranks, cost)
    return loads


def _place_min_max(pieces: List[_Piece], world: int, budget: int, batch: int,
                   gpus_per_node: Optional[int]) -> List[Shard]:
    costs = np.array([_shard_cost(p.table, p.cols, batch) for p in pieces],
                     dtype=np.float64).reshape(-1, 3)  # [P, 3]
    target = np.maximum(costs.sum(axis=0) / world, 1e-12)  # mean load per rank
    loads = _Loads(costs / target, world, gpus_per_node, budget / target[0])
    order = sorted(range(len(pieces)), key=lambda i: (-max(loads.share[i][:2]),
                                                      pieces[i].table.name, pieces[i].col_offset))
    holders: Dict[str, List[int]] = {}
    rank_of = np.full(len(pieces), -1)
    for i in order:
        taken = holders.setdefault(pieces[i].table.name, [])
        rank = loads.best_rank(i, taken)
        if rank is None:
            raise _no_room(pieces[i], loads.load[0] * target[0], budget, pieces)
        loads.add(i, rank)
        rank_of[i] = rank
        taken.append(rank)
    _polish(pieces, rank_of, loads, holders)
    return [Shard(p.table.name, int(r), p.col_offset, p.cols) for p, r in zip(pieces, rank_of)]


class _Loads:
    """Per-rank (and per-host) loads, each normalised by its mean: 1.0 is a fair share."""

    def __init__(self, shares: np.ndarray, world: int, gpus_per_node: Optional[int],
                 budget: float) -> None:
        self.share = shares.tolist()  # [P][3] each piece's memory, all-to-all, lookup share
        self.load = np.zeros((3, world))
        self.budget = budget  # normalised memory budget
        self.per_host = gpus_per_node
        self.host_load = np.zeros((3, -(-world // gpus_per_node))) if gpus_per_node else None
        # Each rank's memory and all-to-all, then its host's, and each piece's shares of them:
        # one numpy addition makes the four sums a score takes (scoring is most of planning).
        self.sums_of = np.zeros((4 if gpus_per_node else 2, world))
        self.added = shares[:, [0, 1, 0, 1][:len(self.sums_of)], None]  # [P, 2 or 4, 1]
        self.max_memory = 0.0  # no rank's is higher

    def score_if_added(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        """For every rank: the higher of memory and all-to-all (rank, and its host) were piece i
        added there (inf where it would not fit), and those sums."""
        sums = self.sums_of + self.added[i]
        score = np.maximum(sums[0], sums[1])
        if self.per_host:
            hosts = np.maximum(sums[2], sums[3])
            hosts /= float(self.per_host)
            np.maximum(score, hosts, out=score)
        if self.max_memory + self.share[i][0] > self.budget:  # else it fits on every rank
            score[sums[0] > self.budget] = np.inf
        return score, sums

    def best_rank(self, i: int, taken: List[int]) -> Optional[int]:
        """The rank, not one of `taken`, with the lowest score for piece i (within 1e-12); of
        tied ones, the lowest memory + all-to-all + lookup, then the lower rank. None: no room."""
        score, sums = self.score_if_added(i)
        if taken:
            score[taken] = np.inf
        low = np.minimum.reduce(score)
        if low == np.inf:
            return None
        best = (score <= low * (1 + 1e-12)).nonzero()[0]
        if len(best) == 1:
            return int(best[0])
        tiebreak = sums[0, best] + sums[1, best] + self.load[2, best] + self.share[i][2]
        return int(best[np.argmin(tiebreak)])

    def add(self, i: int, rank: int, sign: float = 1.0) -> None:
        for row, share in enumerate(self.share[i]):
            self.load[row, rank] += sign * share
            if self.per_host:
                self.host_load[row, rank // self.per_host] += sign * share
        self.sums_of[:2, rank] = self.load[:2, rank]
        if self.per_host:
            first = rank - rank % self.per_host
            self.sums_of[2:, first:first + self.per_host] = \
                self.host_load[:2, rank // self.per_host, None]
        self.max_memory = max(self.max_memory, float(self.load[0, rank]))

    def worst(self) -> float:
        worst = self.load[:2].max()
        if self.per_host:
            worst = max(worst, self.host_load[:2].max() / self.per_host)
        return float(worst)


def _polish(pieces: List[_Piece], rank_of: np.ndarray, loads: _Loads,
            holders: Dict[str, List[int]]) -> None:
    """Move pieces off the most loaded rank while that lowers the worst load (local search
    after the greedy pass; it fixes the last few percent LPT leaves)."""
    for _ in range(4 * len(pieces)):
        worst = loads.worst()
        busiest = int(np.argmax(loads.load[:2].max(axis=0)))
        best_gain, best_move = 1e-9, None
        for i in np.flatnonzero(rank_of == busiest):
            loads.add(i, busiest, -1.0)
            score, _ = loads.score_if_added(i)
            score[holders[pieces[i].table.name]] = np.inf
            after = max(float(score.min()), loads.worst())
            loads.add(i, busiest)
            if worst - after > best_gain:
                best_gain, best_move = worst - after, (i, int(np.argmin(score)))
        if best_move is None:
            return
        i, rank = best_move
        loads.add(i, rank_of[i], -1.0)
        loads.add(i, rank)
        holders[pieces[i].table.name].remove(rank_of[i])
        holders[pieces[i].table.name].append(rank)
        rank_of[i] = rank


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
        rank = int(np.argmax(allowed))  # the most free memory, the lower rank on a tie
        if allowed[rank] == -np.inf or size > free[rank]:
            raise _no_room(piece, budget - free, budget, pieces)
        free[rank] -= size
        count[rank] += 1
        open_free[rank] = free[rank] if count[rank] < cap else -np.inf
        taken.append(rank)
        shards.append(Shard(piece.table.name, rank, piece.col_offset, piece.cols))
    return shards


def _no_room(piece: _Piece, used: np.ndarray, budget: int, pieces: List[_Piece]) -> PlacementError:
    t = piece.table
    shard = f", shard of {piece.cols}/{t.dim} columns" if piece.shard_count > 1 else ""
    need = sum(p.table.shard_bytes(p.cols) for p in pieces)
    return PlacementError(
        f"table {t.name} ({format_bytes(t.bytes)}: {t.rows:,} rows x {t.dim}, {t.precision}, "
        f"{t.optimizer} state{shard}) does not fit: {len(used)} rank(s) of "
        f"{format_bytes(budget)} have {format_bytes(len(used) * budget - used.sum())} free in "
        f"total for tables needing {format_bytes(need)}")


def _max_over_mean(row: np.ndarray) -> float:
    mean = row.mean()
    return float(row.max() / mean) if mean > 0 else 1.0


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}TiB"
