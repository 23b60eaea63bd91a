"""The sequence model's training loss (model.kind hstu): next-item prediction at every position of
every training sequence, by sampled softmax (the reference's `SampledSoftmaxLoss`).

Position t of a sequence predicts the item after it: the next slot's item, or, at the last
slot, the sample's target item. Its logits are its positive first, then the candidates, all
<output, item vector> / temperature over L2-normalised vectors:
- candidates: the distinct items of the global batch, each once: every position's positive
  (in-batch negatives, `model.hstu.in_batch_negatives`) and the uniform draws the dataset adds
  (`retrieval.uniform_negatives`, the reference's "local" sampling, 128 on MovieLens);
- a candidate that is the position's own positive is no negative (masked out);
- the loss is the mean over the global batch's positions: each rank's sum over the number of
  positions of the whole batch per rank, so DDP's mean of the ranks' gradients is the gradient
  one rank training on the whole batch gets, however unevenly the positions fall.
The candidates' vectors are all-gathered with autograd (retrieval/loss.py's `gather_rows`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

from dlrm_hybrid.retrieval.loss import gather_rows

MASKED = -5e4  # the reference's logit for a candidate that is the positive itself


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class SequenceSoftmax(nn.Module):
    def __init__(self, temperature: float, in_batch: bool) -> None:
        super().__init__()
        self.temperature, self.in_batch = temperature, in_batch

    def forward(self, outputs: torch.Tensor, positives: torch.Tensor, positive_ids: torch.Tensor,
                negatives: torch.Tensor, negative_ids: torch.Tensor) -> torch.Tensor:
        """outputs, positives [P, D]: this rank's positions' normalised outputs and their next
        items' normalised vectors (ids [P]); negatives [M, D]: this rank's uniform draws (ids
        [M]). -> the loss (module docstring)."""
        vectors, ids = [gather_rows(negatives)], [gather_rows(negative_ids[:, None])[:, 0]]
        if self.in_batch:
            vectors.append(gather_rows(_padded(positives, self._widest(len(positives)))))
            ids.append(gather_rows(_padded(positive_ids[:, None].long(),
                                           self._widest(len(positives)), -1))[:, 0])
        vectors, ids = torch.cat(vectors), torch.cat(ids).long()
        distinct, first = _first_of_each(ids)
        keep = distinct >= 0  # padding rows carry id -1
        candidates, candidate_ids = vectors[first[keep]], distinct[keep]
        wide = torch.promote_types(outputs.dtype, torch.float32)
        scaled = outputs.to(wide) / self.temperature  # [P, D]: cheaper than dividing the logits
        positive = (scaled * positives.to(wide)).sum(-1)
        negative = scaled @ candidates.to(wide).T  # [P, C]
        negative = negative.masked_fill(positive_ids.long()[:, None] == candidate_ids[None, :],
                                        MASKED)
        logits = torch.cat([positive[:, None], negative], 1)  # the positive in column 0
        total = cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long,
                                                  device=logits.device), reduction="sum")
        return total / (self._positions(len(outputs)) / world_size())

    def _widest(self, local: int) -> int:
        """The most positions any rank holds this step (all_gather needs equal shapes)."""
        if world_size() == 1:
            return local
        count = torch.tensor([local])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count)

    def _positions(self, local: int) -> float:
        """The global batch's positions."""
        if world_size() == 1:
            return float(max(local, 1))
        count = torch.tensor([float(local)])
        dist.all_reduce(count)
        return float(count.clamp(min=1))


def _padded(rows: torch.Tensor, count: int, fill: float = 0.0) -> torch.Tensor:
    if len(rows) == count:
        return rows
    pad = rows.new_full((count - len(rows), *rows.shape[1:]), fill)
    return torch.cat([rows, pad])


def _first_of_each(ids: torch.Tensor):
    """(the distinct ids sorted, the index of each one's first row in `ids`)."""
    distinct, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    rows = torch.arange(len(ids), device=ids.device)
    first = torch.full((len(distinct),), len(ids), dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return distinct, first
