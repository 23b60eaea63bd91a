"""Pixie random walks (Eksombatchai et al., WWW 2018) on the item-user graph (graph/bipartite.py).

One step goes item -> a uniformly drawn user of it -> a uniformly drawn item of that user, and
counts a visit of the item it reaches; after each step the walker returns to its query item with
probability `alpha`. The visit distribution v is then the solution of v = y P,
y = alpha e_q + (1 - alpha) v (P: the item -> user -> item transition matrix, y: where a step
starts): the personalized PageRank of the query, one step later. Each walker starts at its query
and its last walk is cut where the budget ends, so W walkers over N steps differ from v by at most
W / (alpha N) in total variation on top of the sampling noise.

Several query items with weights w_q (e.g. per engagement type): the `steps` are split in
proportion to w_q * s_q, s_q = d_q * (C - ln d_q) (d_q: the query's degree, C: the graph's largest
item degree; the source's scaling, so a query with ten thousand users gets more steps than one with
five); the candidates' scores combine the queries' counts with the multi-hit boost
(sum_q sqrt(visits_q))^2, so items reached from several queries rank higher. Early stopping: a
query's walk ends once its `early_stop_candidates`-th most visited item has at least
`early_stop_visits` visits (the source: 1,000 and 20). The count of items at the threshold is kept
exactly every round (O(walkers), no sort), so a walk stops at the end of the round whose steps
reach it: at most its walkers' steps of one round (budget_q / rounds) past the exact step, exactly
there with one walker.

Speed: every query's walkers (about `walkers` in all) advance together as tensors, one step per
round (ceil(steps / walkers) rounds), on the graph's device (CPU or CUDA, the same code; a
Python loop per round, none per step); visits go into a dense [queries, items] count table, the
queries taken in groups that keep it under COUNTS_BYTES. Seeded: the same seed, graph and queries
give the same candidates on the same device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.graph.bipartite import Graph

COUNTS_BYTES = 128 << 20  # the [queries, items] int32 visit counts of one group of queries


@dataclass
class PixieParams:
    steps: int = 100_000  # walk steps per request, split among its query items
    alpha: float = 0.5  # restart probability after each step
    walkers: int = 4096  # walkers advanced together
    early_stop_candidates: int = 1000  # n_p; 0: no early stopping
    early_stop_visits: int = 20  # n_v
    boost: bool = True  # (sum sqrt)^2 over queries; False: plain sum of visits
    seed: int = 0

    def check(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps: must be at least 1, got {self.steps}")
        if not 0 < self.alpha <= 1:
            raise UserError(f"--alpha: the restart probability must be in (0, 1], got {self.alpha}")
        if self.walkers < 1:
            raise UserError(f"--walkers: must be at least 1, got {self.walkers}")
        if self.early_stop_candidates < 0 or self.early_stop_visits < 1:
            raise UserError("--early-stop: give N_P,N_V with N_P >= 0 (0: off) and N_V >= 1")


@dataclass
class PixieResult:
    items: np.ndarray  # candidates, best first (query items left out unless kept)
    scores: np.ndarray  # their boosted visit counts
    budget: np.ndarray  # [queries] steps allotted
    walked: np.ndarray  # [queries] steps taken (less than budget where a walk stopped early)
    stopped_early: np.ndarray  # [queries] bool: walked < budget

    @property
    def steps_saved(self) -> int:
        return int(self.budget.sum() - self.walked.sum())


def allocate_steps(degrees: np.ndarray, weights: np.ndarray, total: int,
                   max_degree: int) -> np.ndarray:
    """[queries] steps: `total` split in proportion to w_q * d_q * (C - ln d_q), C =
    `max_degree`, by largest remainders (they add up to `total`); a query without edges gets 0."""
    d = np.asarray(degrees, np.float64)
    with np.errstate(divide="ignore"):
        scale = np.where(d > 0, d * (max(max_degree, 1) - np.log(np.maximum(d, 1))), 0.0)
    weights = np.asarray(weights, np.float64)  # in proportion only: huge ones times the
    share = weights / max(float(weights.max(initial=0)), 1e-300) * scale  # scale overflowed
    if share.sum() <= 0:
        return np.zeros(len(d), np.int64)
    exact = total * share / share.sum()
    steps = np.floor(exact).astype(np.int64)
    left = total - int(steps.sum())
    steps[np.argsort(-(exact - steps), kind="stable")[:left]] += 1
    return steps


def walk_device(name: str) -> torch.device:
    """cpu or an available CUDA device; a one-line error otherwise."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device: {name!r} is not a device; give cpu or cuda") from None
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and
                                               not torch.cuda.is_available()):
        raise UserError(f"--device: {name} is not available here; give cpu"
                        + (" or cuda" if torch.cuda.is_available() else ""))
    return device


class PixieWalker:
    """A graph's CSR arrays on `device`, and walks on them."""

    def __init__(self, graph: Graph, device: str = "cpu") -> None:
        self.graph, self.device = graph, walk_device(device)
        put = lambda a: torch.from_numpy(np.asarray(a)).to(self.device)  # noqa: E731
        self.item_indptr = put(graph.item_indptr).long()
        self.user_indptr = put(graph.user_indptr).long()
        self.item_users, self.user_items = put(graph.item_users), put(graph.user_items)
        self.item_degree = self.item_indptr[1:] - self.item_indptr[:-1]
        self.user_degree = self.user_indptr[1:] - self.user_indptr[:-1]
        self.max_degree = int(self.item_degree.max()) if graph.items else 0

    def walk(self, queries: Sequence[int], weights: Optional[Sequence[float]] = None,
             params: PixieParams = PixieParams(), k: int = 0,
             keep_queries: bool = False) -> PixieResult:
        """The top `k` (0: every visited) items of a walk from `queries` (item ids) weighted by
        `weights` (default 1 each); the query items themselves are left out unless
        `keep_queries`. A repeated query item is one query with the weights summed (it would
        otherwise boost its own neighbours as if two queries had reached them); the result's
        per-query arrays follow the distinct items in increasing order."""
        params.check()
        queries = np.asarray(queries, np.int64).reshape(-1)
        weights = np.ones(len(queries)) if weights is None else np.asarray(weights, np.float64)
        self._check_queries(queries, weights)
        queries, inverse = np.unique(queries, return_inverse=True)
        weights = np.bincount(inverse.reshape(-1), weights, minlength=len(queries))
        degrees = self.item_degree[torch.from_numpy(queries).to(self.device)].cpu().numpy()
        budget = allocate_steps(degrees, weights, params.steps, self.max_degree)
        generator = torch.Generator(self.device).manual_seed(params.seed)
        walked = np.zeros(len(queries), np.int64)
        score = torch.zeros(self.graph.items, dtype=torch.float64, device=self.device)
        group = max(1, COUNTS_BYTES // (4 * max(self.graph.items, 1)))
        for first in range(0, len(queries), group):
            part = slice(first, first + group)
            counts, walked[part] = self._walk_group(
                queries[part], budget[part], params, generator)
            at = counts.nonzero().squeeze(1)  # the visited (query, item) pairs only
            visits = counts.index_select(0, at).double()
            score.index_add_(0, at % self.graph.items, visits.sqrt() if params.boost else visits)
        if not keep_queries:
            score[torch.from_numpy(queries).to(self.device)] = 0
        items = score.nonzero().squeeze(1)
        values = score.index_select(0, items)
        values = values.square() if params.boost else values
        return self._ranked(items.cpu().numpy(), values.cpu().numpy(), k, budget, walked)

    def _walk_group(self, queries: np.ndarray, budget: np.ndarray, params: PixieParams,
                    generator: torch.Generator):
        """(flat [queries * items] int32 visit counts, steps walked) of one group of queries."""
        device, items = self.device, self.graph.items
        counts = torch.zeros(len(queries) * items, dtype=torch.int32, device=device)
        remaining = torch.from_numpy(budget.copy()).to(device)
        rounds = max(1, -(-int(budget.sum()) // params.walkers))
        slots = torch.from_numpy(-(-budget // rounds)).to(device)  # walkers per query
        owner = torch.repeat_interleave(torch.arange(len(queries), device=device), slots)
        rank = torch.arange(len(owner), device=device) - (torch.cumsum(slots, 0) - slots)[owner]
        start = torch.from_numpy(queries).to(device, self.user_items.dtype)[owner]  # as ids
        here, row = start.clone(), owner * items  # row: the walker's query's counts
        ones = torch.ones(len(owner), dtype=torch.int32, device=device)
        reached = torch.zeros(len(queries), dtype=torch.float64, device=device)
        walked = torch.zeros(len(queries), dtype=torch.int64, device=device)
        early = params.early_stop_candidates > 0
        while True:
            going = rank < remaining.index_select(0, owner)  # walkers past the budget rest
            if not bool(going.all()):
                owner, rank, start, here, row, ones = (
                    t[going] for t in (owner, rank, start, here, row, ones))
            if not len(owner):
                break
            there = self._step(here, generator)
            keys = row + there
            if early:
                before = counts.index_select(0, keys)
            counts.index_add_(0, keys, ones)
            if early:
                # an item whose count crosses n_v this round is counted once: each of its m
                # visits adds 1/m, m = after - before (exact once rounded)
                after = counts.index_select(0, keys)
                crossed = (before < params.early_stop_visits) & (
                    after >= params.early_stop_visits)
                reached.index_add_(0, owner, crossed.double() / (after - before))
            taken = torch.minimum(slots, remaining)
            walked += taken
            remaining -= taken
            if early:
                remaining.masked_fill_(reached >= params.early_stop_candidates - 0.5, 0)
            restart = torch.rand(len(here), generator=generator, device=device) < params.alpha
            here = torch.where(restart, start, there)
        return counts, walked.cpu().numpy()

    def _step(self, here: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """item -> a random user of it -> a random item of that user, for every walker."""
        user = self._pick(self.item_indptr, self.item_degree, self.item_users, here, generator)
        return self._pick(self.user_indptr, self.user_degree, self.user_items, user, generator)

    def _pick(self, indptr: torch.Tensor, degree: torch.Tensor, neighbours: torch.Tensor,
              nodes: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A uniformly drawn neighbour of each node (all have one). index_select, not
        indexing: 3x faster on CPU at these sizes."""
        d = degree.index_select(0, nodes)
        draw = torch.rand(len(nodes), generator=generator, device=self.device, dtype=torch.float64)
        at = indptr.index_select(0, nodes) + torch.minimum((draw * d).long(), d - 1)
        return neighbours.index_select(0, at)

    def _check_queries(self, queries: np.ndarray, weights: np.ndarray) -> None:
        if not len(queries):
            raise UserError("pixie: no query items; give at least one item")
        if len(weights) != len(queries):
            raise UserError(f"pixie: {len(weights)} weights for {len(queries)} query items")
        bad = (queries < 0) | (queries >= self.graph.items)
        if bad.any():
            raise UserError(f"pixie: item {int(queries[bad][0])} is not in the graph (its items "
                            f"are 0..{self.graph.items - 1})")
        if not np.isfinite(weights).all() or (weights < 0).any() or not weights.sum() > 0:
            raise UserError("pixie: query weights must be finite, 0 or more, and not all 0")

    @staticmethod
    def _ranked(items: np.ndarray, scores: np.ndarray, k: int, budget: np.ndarray,
                walked: np.ndarray) -> PixieResult:
        order = np.lexsort((items, -scores))  # ties: the lower id first
        if k:
            order = order[:k]
        return PixieResult(items[order], scores[order], budget, walked, walked < budget)
