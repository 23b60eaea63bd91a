"""Which rank owns which embedding table, or which columns of it, and which tables every rank
holds whole (replicated, torchrec `data_parallel`).

Two strategies, memory (`tables.py`) a hard limit for both:

- `nvidia`: NVIDIA DLRM's heuristic as its README states it, made memory-aware: largest table
  first, each to the rank with the most free memory, at most ceil(T/G) per rank.
- `greedy` (default): minimises the slowest rank's modeled step time (`cost_model.py`).
  Small tables whose all-to-all costs more than updating them whole on every rank are
  replicated; then largest shard first, each to the rank whose modeled time it raises least
  (LPT); then moves off the slowest rank, and trials on its tables (one more column split,
  replicating, or no longer replicating one) kept where they lower the modeled max and the
  total all-to-all bytes stay within those of the memory-forced splits (nvidia's).
  A table whose optimizer keeps state per row of each shard (`PER_SHARD_ROW_STATE`) is split
  only where memory forces it, unless `split_rowwise`: a split changes its updates.

Both split a table larger than one rank's budget column-wise over as many ranks as it needs.
Everything is deterministic: ties go to the lower rank, equal tables by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.parallel.column_split import (_column_widths, _no_room, _Piece, _shards_to_fit,
                                               _split, _split_largest)
from dlrm_hybrid.parallel.cost_model import (DEVICES, DeviceConstants, RankSums, StepTime,
                                             make_layout, rank_times, rank_totals,
                                             replicated_update_bytes, shard_terms)
from dlrm_hybrid.parallel.nvidia_heuristic import _place_nvidia
from dlrm_hybrid.parallel.plan import PlacementError, Plan, Shard, format_bytes
from dlrm_hybrid.parallel.tables import PER_SHARD_ROW_STATE, REPLICABLE_OPTIMIZERS, TableSpec

STRATEGIES = ("greedy", "nvidia")
MAX_PACKINGS = 16  # greedy's tries to pack, each splitting the largest table further
MAX_TRIALS = 32  # greedy's trials of another sharding for a table on the slowest rank
MAX_GROUP = 256  # the most small tables greedy tries replicating together
POLISH_MOVES = 64  # moves off the slowest rank after the first assignment (8 after a trial)


def search_rules(cfg) -> Dict[str, bool]:
    """The `plan_tables` rules a config sets: row-wise Adagrad splits for speed only on request;
    no replicated table where the config says so or asks for the des exchange or fp16's loss
    scaler (neither runs with one)."""
    return {"split_rowwise": cfg.parallel.split_rowwise,
            "replicate": (cfg.parallel.replicate and cfg.parallel.exchange != "des"
                          and cfg.train.precision != "fp16")}


def plan_tables(tables: Sequence[TableSpec], world_size: int, budget_bytes: int,
                batch_size: int, strategy: str = "greedy",
                gpus_per_node: Optional[int] = None, device: Optional[DeviceConstants] = None,
                split_rowwise: bool = False, replicate: bool = True) -> Plan:
    """Place every table (or its column shards) on ranks; PlacementError if they cannot fit,
    saying how many ranks of this budget would hold them. `device` (default h100) is what the
    greedy search models; `split_rowwise` lets it split row-wise Adagrad tables for speed;
    `replicate` False keeps every table sharded.

    An error is certain where a table's narrowest shard (torchrec's column split over at most
    `world_size` ranks) exceeds the budget or the tables' bytes exceed all ranks' budgets. Packing
    is NP-hard: `nvidia` fails wherever its rule does; `greedy` (falling back to memory alone)
    may miss a packing that exists only where the tables need over 3/4 of all ranks' memory
    (random cases it missed needed 80-99%; tests/test_placement.py checks this contract)."""
    search = _Search(tables, world_size, budget_bytes, batch_size, strategy, gpus_per_node,
                     device or DEVICES["h100"], split_rowwise, replicate)
    try:
        return search.plan()
    except PlacementError as e:
        narrowest = max(t.shard_bytes(min(_column_widths(t.dim, t.dim))) for t in tables)
        if narrowest > budget_bytes:
            raise PlacementError(f"{e}; even split column-wise as far as it goes, a shard needs "
                                 f"{format_bytes(narrowest)}: raise parallel.memory_per_rank") from None
        world = _ranks_needed(search)
        raise PlacementError(f"{e}; {world} ranks of {format_bytes(budget_bytes)} would hold them "
                             f"(or raise parallel.memory_per_rank)") from None


def _ranks_needed(search: "_Search") -> int:
    """The fewest ranks (found by doubling, then bisection) on which the tables fit."""
    fits = lambda world: replace(search, world=world, per_host=None).fits()  # noqa: E731
    low = max(search.world, math.ceil(sum(t.bytes for t in search.ordered) / search.budget) - 1)
    high = low + 1
    while not fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


@dataclass
class _Search:
    """One placement problem; `plan()` solves it with its strategy."""
    tables: Sequence[TableSpec]
    world: int
    budget: int
    batch: int
    strategy: str
    per_host: Optional[int]
    device: DeviceConstants
    split_rowwise: bool
    replicate: bool

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; use one of "
                             f"{', '.join(STRATEGIES)}")
        self.ordered = sorted(self.tables, key=lambda t: (-t.bytes, t.name))
        self.by_name = {t.name: t for t in self.tables}

    def make(self, shards: List[Shard], replicated: FrozenSet[str] = frozenset()) -> Plan:
        return Plan(self.world, self.strategy, self.budget, self.batch,
                    self.by_name, shards, self.per_host, replicated,
                    self.device)

    def plan(self) -> Plan:
        counts = {t.name: _shards_to_fit(t, self.budget) for t in self.ordered}
        made: Dict[str, Tuple[int, List[_Piece]]] = {}  # kept from try to try
        if self.strategy == "nvidia":
            return self.make(_place_nvidia(_split(self.ordered, counts, self.world, made),
                                           self.world, self.budget))
        replicated = self.worth_replicating(counts)
        baseline = self.a2a_total(counts)  # memory-forced splits, nothing replicated: nvidia's
        state, error, tried = None, None, []
        for _ in range(MAX_PACKINGS):
            sharded = [t for t in self.ordered if t.name not in replicated]
            pieces = _split(sharded, counts, self.world, made)
            try:
                state = _State(self, replicated).assign(pieces)
                break
            except PlacementError as e:
                error, state = error or e, None
                tried.append(pieces)
                if replicated:  # their memory on every rank first
                    replicated = frozenset()
                elif not _split_largest(self.ordered, counts, self.world):
                    break
        if state is None:
            return self.make(_place_by_memory(tried, self.world, self.budget, error))
        state.polish(POLISH_MOVES)
        state = self.improve(state, counts, max(baseline, state.a2a_total))
        return self.replicate_smallest(state, counts).plan()

    def fits(self) -> bool:
        """Do the tables fit? By memory alone, largest first (as greedy falls back to), after
        the same splits; for nvidia by its capped rule."""
        counts = {t.name: _shards_to_fit(t, self.budget) for t in self.ordered}
        for _ in range(MAX_PACKINGS):
            pieces = _split(self.ordered, counts, self.world, {})
            try:
                _place_nvidia(pieces, self.world, self.budget, capped=self.strategy == "nvidia")
                return True
            except PlacementError:
                if self.strategy == "nvidia" or not _split_largest(self.ordered, counts,
                                                                   self.world):
                    return False
        return False

    def a2a_total(self, counts: Dict[str, int]) -> float:
        """All ranks' all-to-all bytes per step for these split counts, nothing replicated."""
        shard = lambda t: len(_column_widths(t.dim, counts[t.name], self.world))  # noqa: E731
        return sum(_a2a_sent(t, self.batch, self.world, shard(t) * t.id_bytes
                             + 2 * t.pooled_bytes(t.dim))
                   for t in self.ordered)

    def can_replicate(self, t: TableSpec) -> bool:
        return (self.replicate and self.world > 1 and t.optimizer in REPLICABLE_OPTIMIZERS
                and t.bytes <= self.budget)

    def can_split(self, t: TableSpec, count: int) -> bool:
        """May `t` be split into more than `count` shards for speed alone?"""
        return (self.split_rowwise or t.optimizer not in PER_SHARD_ROW_STATE) and \
            len(_column_widths(t.dim, count + 1, self.world)) > count

    def worth_replicating(self, counts: Dict[str, int]) -> FrozenSet[str]:
        """Tables (whole ones, smallest first, while their copies take under a quarter of the
        memory the shards leave free) whose update on every rank costs less time per rank than
        their share of the all-to-all, lookups and shard costs if sharded."""
        d, world = self.device, self.world
        if world == 1:
            return frozenset()
        g = self.per_host or world
        per_byte = ((g - 1) / d.intra_host_bandwidth + (world - g) / d.inter_host_bandwidth) / \
            (world - 1)
        link = d.inter_host_bandwidth if world > g else d.intra_host_bandwidth
        room = (self.budget - sum(t.bytes for t in self.ordered) / world) / 4
        chosen, used = [], 0
        for t in sorted(self.ordered, key=lambda t: (t.bytes, t.name)):
            if counts[t.name] > 1 or not self.can_replicate(t) or used + t.bytes > room:
                continue
            sent = _a2a_sent(t, self.batch, world, t.id_bytes + 2 * t.pooled_bytes(t.dim))
            sharded = (t.shard_lookup_bytes(t.dim, self.batch) / d.memory_bandwidth
                       + d.shard_fixed_s + sent * per_byte) / world
            whole = (replicated_update_bytes(t) / d.memory_bandwidth + d.shard_fixed_s
                     + 2 * (world - 1) / world * t.rows * t.dim * 4 / link
                     + t.shard_lookup_bytes(t.dim, self.batch / world) / d.memory_bandwidth)
            if whole < sharded:
                chosen.append(t.name)
                used += t.bytes
        return frozenset(chosen)

    def replicate_smallest(self, state: "_State", counts: Dict[str, int]) -> "_State":
        """The plan, or the best of it with its 1, 2, 4, ... smallest sharded tables replicated
        together, if faster. One at a time (as `improve` tries) rarely pays where per-message
        costs dominate: an owner of other tables still sends to every peer; an owner emptied
        sends nothing."""
        smallest = [t for t in reversed(self.ordered) if t.name not in state.replicated
                    and counts[t.name] == 1 and self.can_replicate(t)][:MAX_GROUP]
        best, trial = state, state.copy()
        for k, t in enumerate(smallest, 1):
            if not trial.apply(t, None):
                break
            if k & (k - 1) == 0 or k == len(smallest):
                polished = trial.copy()
                polished.polish(8)
                if polished.step().max_s < best.step().max_s * (1 - 1e-9):
                    best = polished
        return best

    def improve(self, state: "_State", counts: Dict[str, int], most_a2a: float) -> "_State":
        """Trials on the slowest rank's tables, each kept if it lowers the modeled max within
        `most_a2a` total all-to-all bytes; until none does or MAX_TRIALS are spent."""
        best = state.step().max_s
        trials = 0
        while trials < MAX_TRIALS:
            for table, count in state.changes(counts):
                trials += 1
                trial = state.copy()
                if trial.apply(table, count) and trial.a2a_total <= most_a2a * (1 + 1e-9):
                    trial.polish(8)
                    if trial.step().max_s < best * (1 - 1e-9):
                        state, best = trial, trial.step().max_s
                        break
                if trials >= MAX_TRIALS:
                    return state
            else:
                return state
        return state


def _a2a_sent(t: TableSpec, batch: int, world: int, per_sample: float) -> float:
    """Bytes all ranks send for a table whose shards take `per_sample` bytes per sample in and
    out: all but each owner's own 1/P of the batch."""
    return batch * (world - 1) / world * per_sample


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


class _State:
    """A greedy plan being built: where each piece is, which tables are replicated, and the
    per-rank sums the cost model needs (`cost_model.RankSums`, hosts broadcast to their ranks),
    kept as pieces come and go so that one numpy expression scores every rank for a piece."""

    def __init__(self, search: _Search, replicated: FrozenSet[str]) -> None:
        self.search, self.world, self.batch = search, search.world, search.batch
        self.per_host = search.per_host or search.world
        self.sums = np.zeros((6, self.world))  # pooled, ids, lookup, shards, host pooled, host ids
        self.memory = np.zeros(self.world)
        self.total_pooled = self.total_ids = self.owners = self.a2a_total = 0.0
        self.rank_of: Dict[_Piece, int] = {}
        self.on: List[List[_Piece]] = [[] for _ in range(self.world)]
        self.holders: Dict[str, List[int]] = {}
        self.replicated: FrozenSet[str] = frozenset()
        self.set_replicated(replicated)

    def copy(self) -> "_State":
        other = object.__new__(_State)
        other.__dict__.update(self.__dict__)
        other.sums, other.memory = self.sums.copy(), self.memory.copy()
        other.rank_of = dict(self.rank_of)
        other.on = [list(pieces) for pieces in self.on]
        other.holders = {name: list(ranks) for name, ranks in self.holders.items()}
        return other

    def set_replicated(self, names: FrozenSet[str]) -> None:
        tables = self.search.by_name
        self.memory += sum(tables[n].bytes for n in names) - \
            sum(tables[n].bytes for n in self.replicated)
        self.replicated = frozenset(names)
        self.layout = make_layout(self.world, self.per_host, self.batch,
                                  [tables[n] for n in sorted(names)])

    def rank_sums(self, extra: Optional[Tuple[float, float, float]] = None) -> RankSums:
        """The current sums, or every rank's were it to take a piece of `extra` terms."""
        pooled, ids, lookup, shards, host_pooled, host_ids = self.sums
        if extra is None:
            return RankSums(pooled, ids, lookup, shards, host_pooled, host_ids,
                            self.total_pooled, self.total_ids, self.owners)
        dp, di, dl = extra
        return RankSums(pooled + dp, ids + di, lookup + dl, shards + 1, host_pooled + dp,
                        host_ids + di, self.total_pooled + dp, self.total_ids + di,
                        self.owners + (shards == 0))

    def step(self) -> StepTime:
        return rank_times(self.rank_sums(), self.layout, self.search.device)

    def totals_if_added(self, piece: _Piece) -> np.ndarray:
        """Each rank's modeled time were `piece` put there; inf where it may not go."""
        totals = rank_totals(self.rank_sums(shard_terms(piece.table, piece.cols, self.batch)), self.layout,
                             self.search.device)
        totals[self.memory + piece.table.shard_bytes(piece.cols) > self.search.budget] = np.inf
        totals[self.holders.get(piece.table.name, [])] = np.inf
        return totals

    def add(self, piece: _Piece, rank: int, sign: int = 1) -> None:
        dp, di, dl = shard_terms(piece.table, piece.cols, self.batch)
        first = rank - rank % self.per_host
        self.sums[:4, rank] += (sign * dp, sign * di, sign * dl, sign)
        self.sums[4, first:first + self.per_host] += sign * dp
        self.sums[5, first:first + self.per_host] += sign * di
        self.total_pooled += sign * dp
        self.total_ids += sign * di
        self.memory[rank] += sign * piece.table.shard_bytes(piece.cols)
        self.a2a_total += sign * _a2a_sent(piece.table, self.batch, self.world, di + 2 * dp)
        if sign > 0:
            self.owners += self.sums[3, rank] == 1
            self.rank_of[piece] = rank
            self.on[rank].append(piece)
            self.holders.setdefault(piece.table.name, []).append(rank)
        else:
            self.owners -= self.sums[3, rank] == 0
            del self.rank_of[piece]
            self.on[rank].remove(piece)
            self.holders[piece.table.name].remove(rank)

    def assign(self, pieces: Sequence[_Piece]) -> "_State":
        """Largest modeled cost first, each piece to the rank whose time it raises least."""
        for piece in sorted(pieces, key=lambda p: (-self.weight(p), -p.table.bytes, p.table.name,
                                                   p.col_offset)):
            totals = self.totals_if_added(piece)
            rank = int(np.argmin(totals))
            if totals[rank] == np.inf:
                raise _no_room(piece, self.memory, self.search.budget, pieces)
            self.add(piece, rank)
        return self

    def polish(self, moves: int) -> None:
        """Move pieces off the slowest rank while that lowers the modeled max (local search
        after the greedy pass)."""
        for _ in range(moves):
            totals = self.step().total_s
            slow = int(np.argmax(totals))
            best = (totals[slow] * (1 - 1e-9), None, None)
            for piece in list(self.on[slow]):
                self.add(piece, slow, -1)
                after = self.totals_if_added(piece)
                after[slow] = np.inf
                rank = int(np.argmin(after))
                rest = self.step().total_s
                rest[rank] = after[rank]
                if rest.max() < best[0]:
                    best = (rest.max(), piece, rank)
                self.add(piece, slow)
            _, piece, rank = best
            if piece is None:
                return
            self.add(piece, slow, -1)
            self.add(piece, rank)
            if self.step().max_s >= totals[slow]:  # the others' share of it outweighed the gain
                self.add(piece, rank, -1)
                self.add(piece, slow)
                return

    def weight(self, piece: _Piece) -> float:
        """A piece's modeled time on its owner alone: lookups and all-to-all across hosts."""
        d, t = self.search.device, piece.table
        return (t.shard_lookup_bytes(piece.cols, self.batch) / d.memory_bandwidth
                + t.shard_a2a_bytes(piece.cols, self.batch) / d.inter_host_bandwidth)

    def changes(self, counts: Dict[str, int]) -> Iterator[Tuple[TableSpec, Optional[int]]]:
        """Other shardings worth a trial (None: replicated): for the slowest rank's tables,
        costliest first, replicating it or one more column split; sharding a replicated table
        again, in its fewest shards (`counts`); replicating the smallest sharded tables."""
        slow = int(np.argmax(self.step().total_s))
        seen = set()
        for piece in sorted(self.on[slow], key=lambda p: (-self.weight(p), p.table.name)):
            t = piece.table
            if t.name in seen:
                continue
            seen.add(t.name)
            if counts[t.name] == 1 and self.search.can_replicate(t):
                yield t, None
            shards = len(self.holders[t.name])
            if self.search.can_split(t, shards):
                yield t, len(_column_widths(t.dim, shards + 1, self.world))
        for name in sorted(self.replicated, key=lambda n: (-self.search.by_name[n].bytes, n)):
            yield self.search.by_name[name], counts[name]
        smallest = [t for t in reversed(self.search.ordered) if t.name not in self.replicated
                    and counts[t.name] == 1 and self.search.can_replicate(t)]
        for t in smallest[:4]:  # an owner fewer spares every rank its messages
            yield t, None

    def apply(self, table: TableSpec, count: Optional[int]) -> bool:
        """Re-place `table` in `count` column shards, or replicated (None); False where it
        does not fit."""
        for rank in list(self.holders.get(table.name, [])):
            for piece in [p for p in self.on[rank] if p.table.name == table.name]:
                self.add(piece, rank, -1)
        self.holders.pop(table.name, None)
        if count is None:
            self.set_replicated(self.replicated | {table.name})
            return bool(self.memory.max() <= self.search.budget)
        self.set_replicated(self.replicated - {table.name})
        widths = _column_widths(table.dim, count, self.world)
        try:
            self.assign([_Piece(table, i * widths[0], w, len(widths)) for i, w in enumerate(widths)])
        except PlacementError:
            return False
        return True

    @classmethod
    def of(cls, plan: Plan, search: _Search) -> "_State":
        state = cls(search, plan.replicated)
        for name in plan.tables:
            shards = plan.shards_of(name)
            for s in shards:
                state.add(_Piece(plan.tables[name], s.col_offset, s.cols, len(shards)), s.rank)
        return state

    def plan(self) -> Plan:
        order = {t.name: i for i, t in enumerate(self.search.ordered)}
        pieces = sorted(self.rank_of, key=lambda p: (order[p.table.name], p.col_offset))
        return self.search.make([Shard(p.table.name, self.rank_of[p], p.col_offset, p.cols)
                                 for p in pieces], self.replicated)
