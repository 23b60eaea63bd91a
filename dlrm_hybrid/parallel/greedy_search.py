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
from functools import cached_property
from itertools import islice
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.parallel.column_split import (_column_widths, _Piece, _shards_to_fit, _split,
                                               _split_largest)
from dlrm_hybrid.parallel.cost_model import DEVICES, DeviceConstants, replicated_update_bytes
from dlrm_hybrid.parallel.greedy_state import _a2a_sent, _State
from dlrm_hybrid.parallel.nvidia_heuristic import _place_nvidia
from dlrm_hybrid.parallel.plan import PlacementError, Plan, Shard, format_bytes
from dlrm_hybrid.parallel.tables import (PER_SHARD_ROW_STATE, REPLICABLE_OPTIMIZERS, TableColumns,
                                         TableSpec, table_columns)

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
    (random cases it missed needed 80-99%; tests/test_placement.py checks this contract).
    A plan returned places every table (`_check_made`)."""
    search = _Search(tables, world_size, budget_bytes, batch_size, strategy, gpus_per_node,
                     device or DEVICES["h100"], split_rowwise, replicate)
    try:
        plan = search.plan()
    except PlacementError as e:
        narrowest = max(t.shard_bytes(min(_column_widths(t.dim, t.dim))) for t in tables)
        if narrowest > budget_bytes:
            raise PlacementError(f"{e}; even split column-wise as far as it goes, a shard needs "
                                 f"{format_bytes(narrowest)}: raise parallel.memory_per_rank") from None
        world = _ranks_needed(search)
        raise PlacementError(f"{e}; {world} ranks of {format_bytes(budget_bytes)} would hold them "
                             f"(or raise parallel.memory_per_rank)") from None
    _check_made(plan)
    return plan


def _check_made(plan: Plan) -> None:
    """Refuse, in one line, a plan that leaves a table out or a rank over its budget: a search
    that returned one once wrote tables on no rank into `plan --out` and into training."""
    problem = plan.unplaced()
    over = int(plan.loads[0].argmax())
    if problem is None and plan.loads[0, over] > plan.budget_bytes:
        problem = (f"rank {over} holds {format_bytes(plan.loads[0, over])} of tables, over its "
                   f"{format_bytes(plan.budget_bytes)} budget")
    if problem is not None:
        raise PlacementError(f"the {plan.strategy} placement failed its check ({problem}); this is "
                             f"a planner bug: report it with the config, and meanwhile try "
                             f"parallel.strategy={'nvidia' if plan.strategy == 'greedy' else 'greedy'}")


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
        state, error = None, None
        tried: List[Tuple[List[_Piece], FrozenSet[str]]] = []
        for _ in range(MAX_PACKINGS):
            sharded = [t for t in self.ordered if t.name not in replicated]
            pieces = _split(sharded, counts, self.world, made)
            try:
                state = _State(self, replicated).assign(pieces)
                break
            except PlacementError as e:
                error, state = error or e, None
                tried.append((pieces, replicated))
                if replicated:  # their memory on every rank first
                    replicated = frozenset()
                elif not _split_largest(self.ordered, counts, self.world):
                    break
        if state is None:
            return self.make(*_place_by_memory(tried, self.by_name, self.world, self.budget,
                                               error))
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

    @cached_property
    def columns(self) -> List[Tuple[np.ndarray, TableColumns]]:
        """`ordered`'s fields as arrays (`tables.table_columns`): its sums in a few numpy calls,
        not a method call each (worth_replicating: 10,000 tables 217 -> 92 million
        instructions)."""
        return table_columns(self.ordered)

    def a2a_total(self, counts: Dict[str, int]) -> float:
        """All ranks' all-to-all bytes per step for these split counts, nothing replicated."""
        shards = np.array([len(_column_widths(t.dim, counts[t.name], self.world))
                           for t in self.ordered])
        sent = np.empty(len(self.ordered))
        for index, t in self.columns:
            sent[index] = _a2a_sent(t, self.batch, self.world,
                                    shards[index] * t.id_bytes + 2 * t.pooled_bytes(t.dim))
        return sum(sent.tolist())  # one by one, as before (numpy's sum pairs them)

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
        if self.world == 1:
            return frozenset()
        room = (self.budget - sum(t.bytes for t in self.ordered) / self.world) / 4
        pays = np.empty(len(self.ordered), dtype=bool)
        for index, columns in self.columns:
            pays[index] = self.replication_pays(columns)
        chosen, used = [], 0
        for t, better in sorted(zip(self.ordered, pays.tolist()),
                                key=lambda tb: (tb[0].bytes, tb[0].name)):
            if better and counts[t.name] == 1 and self.can_replicate(t) and \
                    used + t.bytes <= room:
                chosen.append(t.name)
                used += t.bytes
        return frozenset(chosen)

    def replication_pays(self, t: TableColumns) -> np.ndarray:
        """Would updating each of these (whole) tables on every rank cost less time per rank
        than its share of the all-to-all, lookups and shard costs if sharded?"""
        d, world = self.device, self.world
        g = self.per_host or world
        per_byte = ((g - 1) / d.intra_host_bandwidth + (world - g) / d.inter_host_bandwidth) / \
            (world - 1)
        link = d.inter_host_bandwidth if world > g else d.intra_host_bandwidth
        sent = _a2a_sent(t, self.batch, world, t.id_bytes + 2 * t.pooled_bytes(t.dim))
        sharded = (t.shard_lookup_bytes(t.dim, self.batch) / d.memory_bandwidth
                   + d.shard_fixed_s + sent * per_byte) / world
        whole = (replicated_update_bytes(t) / d.memory_bandwidth + d.shard_fixed_s
                 + 2 * (world - 1) / world * t.rows * t.dim * 4 / link
                 + t.shard_lookup_bytes(t.dim, self.batch / world) / d.memory_bandwidth)
        return whole < sharded

    def replicate_smallest(self, state: _State, counts: Dict[str, int]) -> _State:
        """The plan, or the best of it with its 1, 2, 4, ... smallest sharded tables replicated
        together, if faster. One at a time (as `improve` tries) rarely pays where per-message
        costs dominate: an owner of other tables still sends to every peer; an owner emptied
        sends nothing."""
        smallest = list(islice((t for t in reversed(self.ordered) if t.name not in state.replicated
                                and counts[t.name] == 1 and self.can_replicate(t)), MAX_GROUP))
        best, trial = state, state.copy()
        for k, t in enumerate(smallest, 1):
            if not trial.apply(t, None):
                break
            if k & (k - 1) == 0 or k == len(smallest):
                polished = trial.copy()
                polished.polish(8)
                if polished.max_s() < best.max_s() * (1 - 1e-9):
                    best = polished
        return best

    def improve(self, state: _State, counts: Dict[str, int], most_a2a: float) -> _State:
        """Trials on the slowest rank's tables, each kept if it lowers the modeled max within
        `most_a2a` total all-to-all bytes; until none does or MAX_TRIALS are spent."""
        best = state.max_s()
        trials = 0
        while trials < MAX_TRIALS:
            for table, count in state.changes(counts):
                trials += 1
                trial = state.copy()
                if trial.apply(table, count) and trial.a2a_total <= most_a2a * (1 + 1e-9):
                    trial.polish(8)
                    if trial.max_s() < best * (1 - 1e-9):
                        state, best = trial, trial.max_s()
                        break
                if trials >= MAX_TRIALS:
                    return state
            else:
                return state
        return state


def _place_by_memory(tried: List[Tuple[List[_Piece], FrozenSet[str]]],
                     tables: Dict[str, TableSpec], world: int, budget: int,
                     error: PlacementError) -> Tuple[List[Shard], FrozenSet[str]]:
    """Where balancing traffic too strands a table, memory alone may still fit them: each
    split tried, with the tables it replicated (their copies take memory on every rank),
    largest table first to the most free memory (no cap); else the first error."""
    for pieces, replicated in tried:
        room = budget - sum(tables[name].bytes for name in replicated)
        try:
            return _place_nvidia(pieces, world, room, capped=False), replicated
        except PlacementError:
            pass
    raise error
