"""The two-tower training loss: softmax over the global batch's items (in-batch negatives).

Every rank's item vectors are all-gathered with autograd, so each engagement's user is scored
against every item of the global batch; the gather's backward sums the gradients the ranks'
losses send each item vector, which DDP's mean then turns into the gradient of the global
batch's mean loss, as one rank training on the whole batch would get.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_gather
from torch.nn.functional import cross_entropy


def gather_rows(local: torch.Tensor) -> torch.Tensor:
    """Every rank's rows in rank order (with autograd), or `local` alone without a group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    return torch.cat(all_gather(local.contiguous()), 0)


class InBatchSoftmax(nn.Module):
    def __init__(self, retrieval_cfg, items: int, temperature: float) -> None:
        super().__init__()
        self.cfg, self.items, self.temperature = retrieval_cfg, items, temperature

    def forward(self, user: torch.Tensor, item: torch.Tensor, item_ids: torch.Tensor,
                labels: torch.Tensor) -> torch.Tensor:
        """Mean over this rank's engagements (label 1) of the softmax loss of its own item
        among all the global batch's items."""
        items = gather_rows(item)
        rank = dist.get_rank() if dist.is_initialized() else 0
        logits = (user @ items.T).float() / self.temperature
        target = torch.arange(len(user), device=user.device) + rank * len(user)
        queries = labels > 0.5
        return cross_entropy(logits[queries], target[queries])
