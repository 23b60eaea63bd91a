"""The two-tower training loss: softmax over the global batch's items (in-batch negatives).

Every rank's item vectors are all-gathered with autograd, so each engagement's user is scored
against every item of the global batch; the gather's backward sums the gradients the ranks'
losses send each item vector, which DDP's mean then turns into the gradient of the global
batch's mean loss, as one rank training on the whole batch would get.

The options (`retrieval:`), each a column rule of the [engagements, candidates] logits:
- candidates: the global batch's rows, engagements (label 1) and uniform negatives (label 0,
  drawn from the whole corpus by the dataset: mixed negative sampling, Yang et al. 2020), then
  the cross-batch memory's last M item vectors (detached; Wang et al. 2020).
- logq: logit - log q_j, q_j = p_j + N / items, the expected number of times item j is drawn
  into a step's candidates: p_j from the engagements (Yi et al. 2019's streaming estimate),
  N / items from the uniform draws. The memory replays earlier steps' candidates, which scales every q_j
  alike and leaves the softmax unchanged, so its rows get their item's q_j too.
- remove_accidental_hits: a candidate whose item is the engagement's own item, other than its
  own column, is no negative (logit -inf).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from dlrm_hybrid.compat import all_gather_with_grad


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's rows in rank order (with autograd), or `local` alone without a group.
    Every rank must give the same number of rows."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    return all_gather_with_grad(local.contiguous(), dist.group.WORLD)


class InBatchSoftmax(nn.Module):
    """Its state (buffers: checkpointed with the model, kept out of DDP's broadcast) is updated
    from the global batch, so it is the same on every rank:
    - logq: `step` t, `last_seen` A [items] (0: never), `gap` B [items], the estimated steps
      between two draws of an item; p = 1 / B. At each step, before its logits (as the paper),
      every engagement of item j does B <- (1 - a) B + a (t - A), A <- t (a = logq_decay; an
      item's second draw in a step sees a gap of 0, so p counts draws per step). An item never
      seen has p = 0; at its first draw its B starts from t - A = t.
    - cross_batch_memory M: `memory` [M, dim] and `memory_ids` [M] (-1: empty), a queue (the
      oldest first) the global batch's rows join after each step's logits.
    """

    def __init__(self, retrieval_cfg, items: int, temperature: float, dim: int) -> None:
        """`dim`: the towers' output width (the memory's rows)."""
        super().__init__()
        self.cfg, self.items, self.temperature = retrieval_cfg, items, temperature
        if retrieval_cfg.logq:
            self.register_buffer("step", torch.zeros((), dtype=torch.int64))
            self.register_buffer("last_seen", torch.zeros(items, dtype=torch.int64))
            self.register_buffer("gap", torch.zeros(items, dtype=torch.float64))
        size = retrieval_cfg.cross_batch_memory
        if size:
            self.register_buffer("memory", torch.zeros(size, dim))
            self.register_buffer("memory_ids", torch.full((size,), -1, dtype=torch.int64))

    def forward(self, user: torch.Tensor, item: torch.Tensor, item_ids: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        """Mean over this rank's engagements (label 1) of the softmax loss of its own item
        among the candidates. Rows of label 0 are candidates only."""
        items = gather_rows(item)
        ids, engaged = gather_rows(torch.stack([item_ids.long(), (labels > 0.5).long()], 1)).T
        if self.cfg.logq:
            self.observe(ids[engaged.bool()])
        candidates, candidate_ids = items, ids
        if self.cfg.cross_batch_memory:
            candidates = torch.cat([items, self.memory.to(items.dtype)])
            candidate_ids = torch.cat([ids, self.memory_ids])
        logits = (user @ candidates.T).float() / self.temperature
        if self.cfg.logq:
            logits = logits - self.sampling_probability(candidate_ids).log().float()
        rank = dist.get_rank() if dist.is_initialized() else 0
        target = torch.arange(len(user), device=user.device) + rank * len(user)
        excluded = (candidate_ids < 0).expand_as(logits)  # empty memory slots
        if self.cfg.remove_accidental_hits:
            hits = item_ids.long()[:, None] == candidate_ids[None, :]
            hits[torch.arange(len(user), device=user.device), target] = False
            excluded = excluded | hits
        logits = logits.masked_fill(excluded, float("-inf"))
        queries = labels > 0.5
        loss = cross_entropy(logits[queries], target[queries])
        if self.cfg.cross_batch_memory:
            # The engagements first, then the negatives, each in rank order: one rank's order
            # of the global batch, so the rows that fall out are the same on any number of ranks.
            order = torch.argsort(1 - engaged, stable=True)
            self.remember(items.detach()[order], ids[order])
        return loss

    @torch.no_grad()
    def observe(self, engaged_ids: torch.Tensor) -> None:
        """One step of the streaming estimate from the global batch's engaged items."""
        self.step += 1
        seen, draws = torch.unique(engaged_ids, return_counts=True)
        last, gap = self.last_seen[seen], self.gap[seen]
        elapsed = (self.step - last).double()
        gap = torch.where(last > 0, gap, elapsed)
        keep = (1 - self.cfg.logq_decay) ** (draws - 1).double()  # the draws after the first
        self.gap[seen] = keep * ((1 - self.cfg.logq_decay) * gap + self.cfg.logq_decay * elapsed)
        self.last_seen[seen] = self.step

    def sampling_probability(self, ids: torch.Tensor) -> torch.Tensor:
        """q of each id: expected draws per step among the candidates (module docstring)."""
        gap = self.gap[ids.clamp(min=0)]
        seen = torch.where(gap > 0, 1 / gap.clamp(min=1e-12), torch.zeros_like(gap))
        return seen + self.cfg.uniform_negatives / self.items

    @torch.no_grad()
    def remember(self, items: torch.Tensor, ids: torch.Tensor) -> None:
        """Append this step's item vectors to the memory; the oldest fall out."""
        size = len(self.memory_ids)
        self.memory.copy_(torch.cat([self.memory, items.to(self.memory.dtype)])[-size:])
        self.memory_ids.copy_(torch.cat([self.memory_ids, ids])[-size:])
