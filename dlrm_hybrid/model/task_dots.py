"""Per-task dot interactions (`model.task_dot_dim: k > 0`, with model.tasks): each task t has
its own projection P_t (d -> k, no bias) of the bottom-MLP output v_0 and the pooled
embeddings v_1..v_F, and its own weight w_t,ij per pair, and adds

    sum_{i<j} w_t,ij <P_t v_i, P_t v_j>

to its head's logit. The shared interaction gives every task the same dot per pair; tasks whose
pairwise factors differ (a click and a hide read different parts of the same vectors) each get
their own bilinear form here.

The two halves sit where the model already joins its interaction and its top MLP (as dcn's
parallel structure does), so the model's forward and the served model stay one line:
`TaskDotsInteraction` returns [shared interaction's output; every task's pair dots], and
`TaskDotsOverArch` runs the top MLP (with its task heads) on the first part and adds each
task's weighted sum of the second.
"""

from typing import List

import torch
from torch import nn


class TaskDotsInteraction(nn.Module):
    """[B, d] dense and [B, F, d] pooled -> [B, width + T * C(F + 1, 2)]: `inner`'s output
    (`width` wide), then per task the dots <P_t v_i, P_t v_j>, i < j, in row-major order."""

    def __init__(self, inner: nn.Module, num_sparse: int, dim: int, tasks: int,
                 task_dim: int) -> None:
        super().__init__()
        self.inner = inner
        self.num_sparse, self.dim, self.tasks, self.task_dim = num_sparse, dim, tasks, task_dim
        n = num_sparse + 1
        self.pairs = n * (n - 1) // 2
        # nn.Linear's default initialisation, one [k, d] block of rows per task
        self.projection = nn.Linear(dim, tasks * task_dim, bias=False)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("flat_pairs", rows * n + cols, persistent=False)

    def around(self, inner: nn.Module) -> "TaskDotsInteraction":
        """The same per-task projections around another shared interaction (export: its
        TorchScript form)."""
        other = TaskDotsInteraction(inner, self.num_sparse, self.dim, self.tasks, self.task_dim)
        other.projection = self.projection
        return other

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor
                ) -> torch.Tensor:
        shared = self.inner(dense_features, sparse_features)
        vectors = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        batch, n = vectors.shape[0], vectors.shape[1]
        projected = self.projection(vectors).view(batch, n, self.tasks, self.task_dim)
        per_task = projected.transpose(1, 2).reshape(batch * self.tasks, n, self.task_dim)
        gram = torch.bmm(per_task, per_task.transpose(1, 2)).flatten(1)
        dots = torch.index_select(gram, 1, self.flat_pairs)  # [B * T, pairs]
        return torch.cat((shared, dots.reshape(batch, self.tasks * self.pairs).to(shared.dtype)),
                         dim=1)


class TaskDotsOverArch(nn.Module):
    """The top MLP (`inner`, its task heads in place, [B, T] logits) on the first `width`
    columns, plus sum_ij w_t,ij dots_t,ij over task t's pair dots in the rest."""

    def __init__(self, inner: nn.Module, width: int, tasks: int, pairs: int) -> None:
        super().__init__()
        self.inner = inner
        self.width, self.tasks, self.pairs = width, tasks, pairs
        # Every pair weighed 1 at first, a factorization machine over the task's projections:
        # on the planted teacher (benchmarks/multitask.py, 1,500 steps) 0.02-0.04 AUC above
        # nn.Linear's random signs, and above zeros or 1 / sqrt(pairs)
        self.pair_weights = nn.Parameter(torch.ones(tasks, pairs))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        logits = self.inner(features[:, :self.width])
        dots = features[:, self.width:].reshape(features.shape[0], self.tasks, self.pairs)
        return logits + (dots * self.pair_weights.to(dots.dtype)).sum(2).to(logits.dtype)


def with_task_dots(interaction: nn.Module, over_arch: nn.Module, width: int, num_sparse: int,
                   dim: int, tasks: int, task_dim: int) -> List[nn.Module]:
    """[interaction, over_arch] with the per-task dots added (`width`: the interaction's
    output width, which the top MLP reads)."""
    dots = TaskDotsInteraction(interaction, num_sparse, dim, tasks, task_dim)
    return [dots, TaskDotsOverArch(over_arch, width, tasks, dots.pairs)]
