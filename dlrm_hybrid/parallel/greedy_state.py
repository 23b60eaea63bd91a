"""A greedy plan being built (greedy_search.py's search moves its pieces): where each piece is,
which tables are replicated, and the per-rank sums the cost model needs, kept as pieces come and
go so that one numpy expression scores every rank for a piece (`_AddScores`).
"""

from __future__ import annotations

from array import array
from itertools import islice
from typing import Any, Dict, FrozenSet, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from dlrm_hybrid.parallel.column_split import _column_widths, _no_room, _Piece
from dlrm_hybrid.parallel.cost_model import (Layout, RankSums, StepTime, allreduce_s, fixed_s,
                                             intra_bytes, lookup_s, make_layout,
                                             own_traffic, rank_times, rank_totals, shard_terms)
from dlrm_hybrid.parallel.plan import PlacementError, Plan, Shard
from dlrm_hybrid.parallel.tables import TableSpec

Terms = Tuple[float, float, float]  # a shard's pooled and id bytes per sample, lookup bytes


def _a2a_sent(t: TableSpec, batch: int, world: int, per_sample: float) -> float:
    """Bytes all ranks send for a table whose shards take `per_sample` bytes per sample in and
    out: all but each owner's own 1/P of the batch."""
    return batch * (world - 1) / world * per_sample


def _without(items: tuple, item: Any) -> tuple:
    """`items` less the first that equals `item` (list.remove's)."""
    i = items.index(item)
    return items[:i] + items[i + 1:]


class _State:
    """Pieces on ranks, with the sums of `cost_model.RankSums` per rank and per host. `search` is
    greedy_search's `_Search`: the tables, ranks, budget and rules.

    The sums are `array.array`s of doubles, read as numpy arrays (no copy) where every rank is
    scored: a piece changes one rank and one host, and an element of an array.array takes 2/3
    of the instructions of a numpy element (Python lists: np.array() of one took 0.34 million
    instructions a call, 1,500 calls). Python's float sums are numpy's, bit for bit."""

    def __init__(self, search: Any, replicated: FrozenSet[str]) -> None:
        self.search, self.world, self.batch = search, search.world, search.batch
        self.per_host = search.per_host or search.world
        self.pooled, self.ids, self.lookup, self.shards, self.memory = \
            (array("d", [0.0]) * self.world for _ in range(5))
        self.host_pooled, self.host_ids = \
            (array("d", [0.0]) * (self.world // self.per_host) for _ in range(2))
        self.total_pooled = self.total_ids = self.owners = self.a2a_total = 0.0
        self.rank_of: Dict[_Piece, int] = {}
        # Tuples, so that a copy shares them: a copy of 10,000 tables' lists and 1,024 ranks'
        # took 7 ms (0.17 s of the plan), 0.7 ms of it the garbage collector's.
        self.on: List[Tuple[_Piece, ...]] = [()] * self.world
        self.holders: Dict[str, Tuple[int, ...]] = {}
        self.replicated: FrozenSet[str] = frozenset()
        self.scores = _AddScores()
        self.touched: List[int] = []  # ranks added to or taken from since `scores` last looked
        self.set_replicated(replicated)

    def copy(self) -> "_State":
        other = object.__new__(_State)
        other.__dict__.update(self.__dict__)
        for name in ("pooled", "ids", "lookup", "shards", "memory", "host_pooled", "host_ids"):
            setattr(other, name, getattr(self, name)[:])
        other.rank_of = dict(self.rank_of)
        other.on = list(self.on)
        other.holders = dict(self.holders)
        other.scores, other.touched = _AddScores(), []
        return other

    def set_replicated(self, names: FrozenSet[str]) -> None:
        tables = self.search.by_name  # integers: only the difference need be summed
        more = sum(tables[n].bytes for n in names - self.replicated) - \
            sum(tables[n].bytes for n in self.replicated - names)
        np.frombuffer(self.memory)[:] += more
        self.replicated = frozenset(names)
        self._layout: Optional[Layout] = None

    @property
    def layout(self) -> Layout:
        """Made when first read: `replicate_smallest` replicates 256 tables one by one and
        scores after 1, 2, 4, ...; a layout each time took 0.05 s (10,000 tables)."""
        if self._layout is None:
            tables = self.search.by_name
            self._layout = make_layout(self.world, self.per_host, self.batch,
                                       [tables[n] for n in sorted(self.replicated)])
        return self._layout

    def rank_sums(self) -> RankSums:
        """Copies, as numpy arrays (hosts' repeated for their ranks)."""
        mine = lambda sums: np.frombuffer(sums).copy()  # noqa: E731
        per_rank = lambda host: np.repeat(np.frombuffer(host), self.per_host)  # noqa: E731
        return RankSums(mine(self.pooled), mine(self.ids), mine(self.lookup), mine(self.shards),
                        per_rank(self.host_pooled), per_rank(self.host_ids), self.total_pooled,
                        self.total_ids, self.owners)

    def step(self) -> StepTime:
        return rank_times(self.rank_sums(), self.layout, self.search.device)

    def totals(self) -> np.ndarray:
        """`step().total_s`, bit for bit, without its parts."""
        return rank_totals(self.rank_sums(), self.layout, self.search.device)

    def max_s(self) -> float:
        """`step().max_s`."""
        return float(self.totals().max())

    def totals_if_added(self, piece: _Piece) -> np.ndarray:
        """Each rank's modeled time were `piece` put there; inf where it may not go."""
        totals = self.scores.totals(self, shard_terms(piece.table, piece.cols, self.batch))
        used = np.frombuffer(self.memory)
        totals[used + piece.table.shard_bytes(piece.cols) > self.search.budget] = np.inf
        totals[list(self.holders.get(piece.table.name, ()))] = np.inf
        return totals

    def best_rank(self, piece: _Piece, terms: Terms, pieces: Sequence[_Piece]) -> int:
        """The rank `piece` (of `terms`) raises least, the lower on a tie, among those it may go
        to; `_no_room` where none may. Unmasked first, then masked only where that rank may not
        take it: the same rank, without the mask's 12 of ~50 us a piece."""
        totals = self.scores.totals(self, terms)
        rank = int(totals.argmin())
        if self.memory[rank] + piece.table.shard_bytes(piece.cols) <= self.search.budget and \
                rank not in self.holders.get(piece.table.name, ()):
            return rank
        totals = self.totals_if_added(piece)
        rank = int(np.argmin(totals))
        if totals[rank] == np.inf:
            raise _no_room(piece, np.frombuffer(self.memory).copy(), self.search.budget, pieces)
        return rank

    def add(self, piece: _Piece, rank: int, sign: int = 1, terms: Optional[Terms] = None) -> None:
        dp, di, dl = terms or shard_terms(piece.table, piece.cols, self.batch)
        host = rank // self.per_host
        self.pooled[rank] += sign * dp
        self.ids[rank] += sign * di
        self.lookup[rank] += sign * dl
        self.shards[rank] += sign
        self.host_pooled[host] += sign * dp
        self.host_ids[host] += sign * di
        self.total_pooled += sign * dp
        self.total_ids += sign * di
        self.memory[rank] += sign * piece.table.shard_bytes(piece.cols)
        self.a2a_total += sign * _a2a_sent(piece.table, self.batch, self.world, di + 2 * dp)
        self.touched.append(rank)
        name = piece.table.name
        if sign > 0:
            self.owners += self.shards[rank] == 1
            self.rank_of[piece] = rank
            self.on[rank] += (piece,)
            self.holders[name] = self.holders.get(name, ()) + (rank,)
        else:
            self.owners -= self.shards[rank] == 0
            del self.rank_of[piece]
            self.on[rank] = _without(self.on[rank], piece)
            self.holders[name] = _without(self.holders[name], rank)

    def assign(self, pieces: Sequence[_Piece]) -> "_State":
        """Largest modeled cost first, each piece to the rank whose time it raises least."""
        for piece in sorted(pieces, key=lambda p: (-self.weight(p), -p.table.bytes, p.table.name,
                                                   p.col_offset)):
            terms = shard_terms(piece.table, piece.cols, self.batch)
            self.add(piece, self.best_rank(piece, terms, pieces), 1, terms)
        return self

    def polish(self, moves: int) -> None:
        """Move pieces off the slowest rank while that lowers the modeled max (local search
        after the greedy pass)."""
        for _ in range(moves):
            totals = self.totals()
            slow = int(np.argmax(totals))
            best = (totals[slow] * (1 - 1e-9), None, None)
            for piece in self.on[slow]:
                self.add(piece, slow, -1)
                after = self.totals_if_added(piece)
                after[slow] = np.inf
                rank = int(np.argmin(after))
                rest = self.totals()
                rest[rank] = after[rank]
                if rest.max() < best[0]:
                    best = (rest.max(), piece, rank)
                self.add(piece, slow)
            _, piece, rank = best
            if piece is None:
                return
            self.add(piece, slow, -1)
            self.add(piece, rank)
            if self.totals().max() >= totals[slow]:  # the others' share of it outweighed the gain
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
        slow = int(np.argmax(self.totals()))
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
        smallest = (t for t in reversed(self.search.ordered) if t.name not in self.replicated
                    and counts[t.name] == 1 and self.search.can_replicate(t))
        for t in islice(smallest, 4):  # an owner fewer spares every rank its messages
            yield t, None

    def apply(self, table: TableSpec, count: Optional[int]) -> bool:
        """Re-place `table` in `count` column shards, or replicated (None); False where it
        does not fit."""
        for rank in list(self.holders.get(table.name, ())):
            for piece in [p for p in self.on[rank] if p.table.name == table.name]:
                self.add(piece, rank, -1)
        self.holders.pop(table.name, None)
        if count is None:
            self.set_replicated(self.replicated | {table.name})
            return bool(np.frombuffer(self.memory).max() <= self.search.budget)
        self.set_replicated(self.replicated - {table.name})
        widths = _column_widths(table.dim, count, self.world)
        try:
            self.assign([_Piece(table, i * widths[0], w, len(widths)) for i, w in enumerate(widths)])
        except PlacementError:
            return False
        return True

    @classmethod
    def of(cls, plan: Plan, search: Any) -> "_State":
        state = cls(search, plan.replicated)
        for name in plan.tables:
            shards = plan.shards_of(name)
            for s in shards:
                state.add(_Piece(plan.tables[name], s.col_offset, s.cols, len(shards)), s.rank)
        return state

    def plan(self) -> Plan:
        order = {t.name: i for i, t in enumerate(self.search.ordered)}
        placed = sorted(self.rank_of.items(), key=lambda pr: (order[pr[0].table.name],
                                                                pr[0].col_offset))
        return self.search.make([Shard(p.table.name, rank, p.col_offset, p.cols)
                                 for p, rank in placed], self.replicated)


class _AddScores:
    """Every rank's modeled total were it to take one more shard of `terms`: `rank_totals` of the
    state's sums plus the shard, bit for bit (plans must not change), but a rank's own terms and
    its host's are kept from the last call and redone only where `_State.add` touched since;
    only the all-ranks terms (`inter_bytes`) are redone per call. The greedy pass places
    shards of equal terms one after another, so most calls keep: 10,000 tables on 1,024 ranks,
    ~90 -> ~35 us a shard, the pass 0.95 -> 0.4 s (Intel Xeon, AMX)."""

    def __init__(self) -> None:
        self.terms: Optional[Terms] = None

    def totals(self, state: _State, terms: Terms) -> np.ndarray:
        """A new array (the caller may mask it)."""
        if terms != self.terms or self.layout is not state.layout:
            self.terms, self.layout = terms, state.layout
            self.fill_all(state, terms)
        else:
            if state.owners != self.owners:  # each of the first pieces on 1,024 ranks
                self.fill_fixed(state)
            for rank in set(state.touched):
                self.fill_rank(state, terms, rank)
            for host in {r // state.per_host for r in state.touched}:
                self.fill_host(state, terms, host)
        state.touched.clear()
        dp, di, _ = terms
        # `inter_bytes`, its operations in its order, into kept arrays: 7 fewer made a shard
        sent, got, b = self.sent, self.got, self.layout.local_batch
        np.add(self.own[4], state.total_ids + di, out=sent)
        sent += state.total_pooled + dp
        sent -= self.host
        sent *= b
        np.add(self.own[5], state.total_pooled + dp, out=got)
        got -= self.host_pooled
        got *= b
        totals = np.maximum(sent, got)
        # near + inter + fixed + allreduce, as `rank_totals` adds them (a + b is b + a), in place
        totals /= state.search.device.inter_host_bandwidth
        totals += self.near
        totals += self.fixed
        if self.allreduce:  # x + 0.0 is x
            totals += self.allreduce
        return totals

    def fill_all(self, state: _State, terms: Terms) -> None:
        dp, di, dl = terms
        s = state.rank_sums()
        layout, device = self.layout, state.search.device
        self.own = list(own_traffic(s.pooled + dp, s.ids + di, layout))
        self.sent, self.got = np.empty(state.world), np.empty(state.world)
        self.lookup = lookup_s(s.lookup + dl, layout, device)
        self.fill_fixed(state)
        self.allreduce = allreduce_s(layout, device)
        self.host_pooled = s.host_pooled + dp
        self.host = s.host_ids + di + self.host_pooled
        self.near = self.lookup + np.maximum(*intra_bytes(
            self.own, self.host, self.host_pooled, layout.local_batch)) / \
            device.intra_host_bandwidth

    def fill_fixed(self, state: _State) -> None:
        """Every rank's fixed part, which the count of ranks owning shards changes."""
        shards = np.frombuffer(state.shards)
        self.owners = state.owners
        self.fixed = fixed_s(shards + 1, self.owners + (shards == 0), self.layout,
                             state.search.device)
        self.fixed_of: Dict[float, float] = {}  # a rank's by its shards, while owners hold

    def fill_rank(self, state: _State, terms: Terms, rank: int) -> None:
        """A rank's own terms (its host's: `fill_host`), in Python floats: the same IEEE
        operations as the arrays'."""
        dp, di, dl = terms
        layout, device = self.layout, state.search.device
        own = own_traffic(state.pooled[rank] + dp, state.ids[rank] + di, layout)
        for kept, value in zip(self.own, own):
            kept[rank] = value
        self.lookup[rank] = lookup_s(state.lookup[rank] + dl, layout, device)
        shards = state.shards[rank]
        fixed = self.fixed_of.get(shards)
        if fixed is None:
            fixed = self.fixed_of[shards] = fixed_s(shards + 1, state.owners + (shards == 0),
                                                    layout, device)
        self.fixed[rank] = fixed

    def fill_host(self, state: _State, terms: Terms, host: int) -> None:
        """The host's terms for its ranks, after `fill_rank` of those that changed."""
        dp, di, _ = terms
        ranks = slice(host * state.per_host, (host + 1) * state.per_host)
        host_pooled = state.host_pooled[host] + dp
        host_both = state.host_ids[host] + di + host_pooled
        self.host_pooled[ranks], self.host[ranks] = host_pooled, host_both
        own = [kept[ranks] for kept in self.own[:4]]
        self.near[ranks] = self.lookup[ranks] + np.maximum(*intra_bytes(
            own, host_both, host_pooled, self.layout.local_batch)) / \
            state.search.device.intra_host_bandwidth
