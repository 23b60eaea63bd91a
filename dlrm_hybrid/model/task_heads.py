"""Multi-task ranking (model.tasks): one head per engagement task over the shared trunk, or
over a multi-gate mixture of experts (MMoE), and the masked, weighted sum of per-task log
losses, with an optional learning-to-rank term per request (model.ranking_loss: pairwise or
listwise over groups of consecutive rows). Written for `torch.jit.script` too: the exported
model carries the heads."""

from typing import List

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits


def _mlp(width: int, hidden: List[int], out: int) -> nn.Sequential:
    """Linear + ReLU per hidden width, then a linear layer of `out` (no activation)."""
    layers: List[nn.Module] = []
    for size in hidden:
        layers += [nn.Linear(width, size), nn.ReLU()]
        width = size
    return nn.Sequential(*layers, nn.Linear(width, out))


class TaskHeads(nn.Module):
    """[B, width] trunk output -> [B, T] logits. It takes the place of the top MLP's last
    layer, so every interaction (dcn's parallel structure and des's split first layer too)
    feeds it as it fed that layer. With experts, expert k is an MLP (ReLU after its last layer
    as well) and task t's head reads sum_k softmax(G_t x)_k expert_k(x)."""

    def __init__(self, width: int, heads: List[List[int]], experts: int = 0,
                 expert_mlp: List[int] = ()) -> None:
        super().__init__()
        self.tasks = len(heads)
        self.num_experts = experts
        self.experts = nn.ModuleList(
            [nn.Sequential(_mlp(width, list(expert_mlp)[:-1], list(expert_mlp)[-1]), nn.ReLU())
             for _ in range(experts)])
        self.gates = nn.Linear(width, experts * len(heads)) if experts else nn.Identity()
        head_width = list(expert_mlp)[-1] if experts else width
        self.heads = nn.ModuleList([_mlp(head_width, list(hidden), 1) for hidden in heads])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: List[torch.Tensor] = []
        if self.num_experts == 0:
            for head in self.heads:
                logits.append(head(x))
            return torch.cat(logits, dim=1)
        mixed = torch.stack([expert(x) for expert in self.experts], dim=1)  # [B, K, H]
        gates = torch.softmax(self.gates(x).view(x.shape[0], self.tasks, self.num_experts), -1)
        inputs = torch.bmm(gates, mixed)  # [B, T, H]
        t = 0
        for head in self.heads:
            logits.append(head(inputs[:, t]))
            t += 1
        return torch.cat(logits, dim=1)


def multitask_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
                   ) -> torch.Tensor:
    """sum_t weight_t * (sum of task t's log loss over the samples that have its label) / B.
    A missing label (NaN) is left out, not read as 0. Dividing by the batch size rather than
    by the labels present keeps every rank's share of the global loss independent of how
    labels fall on ranks, so 1 and N ranks train alike; a task labelled on a fraction f of the
    samples weighs f * weight_t."""
    present = ~torch.isnan(labels)
    per_sample = binary_cross_entropy_with_logits(
        logits.float(), torch.where(present, labels, torch.zeros_like(labels)), reduction="none")
    per_task = torch.where(present, per_sample, torch.zeros_like(per_sample)).sum(0)
    return (per_task * weights).sum() / labels.shape[0]


def ranking_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, kind: str,
                 group: int) -> torch.Tensor:
    """A learning-to-rank loss over requests of `group` consecutive rows ([B, T] logits and
    labels, B a multiple of `group`; NaN: missing, left out), sum_t weight_t * (sum over
    requests of the request's task-t loss) / (B / group):
    pairwise (RankNet, Burges et al. 2005): sum over pairs i, j of one request with label_i = 1,
    label_j = 0 of log(1 + exp(z_j - z_i));
    listwise (ListNet's softmax cross-entropy, Cao et al. 2007): -sum_i (label_i / sum label)
    log softmax(z)_i over the request's labelled rows, a request without a positive adding 0."""
    requests, tasks = labels.shape[0] // group, labels.shape[1]
    z = logits.float().reshape(requests, group, tasks)
    y = labels.reshape(requests, group, tasks)
    present = ~torch.isnan(y)
    positive = present & (y > 0.5)
    negative = present & (y <= 0.5)
    if kind == "pairwise":
        margin = z.unsqueeze(2) - z.unsqueeze(1)  # [R, i, j, T]: z_i - z_j
        pairs = positive.unsqueeze(2) & negative.unsqueeze(1)
        per = torch.nn.functional.softplus(-margin)
        per_task = torch.where(pairs, per, torch.zeros_like(per)).sum((0, 1, 2))
    else:
        masked = torch.where(present, z, torch.full_like(z, float("-inf")))
        log_p = torch.log_softmax(masked, dim=1)
        target = torch.where(positive, torch.ones_like(z), torch.zeros_like(z))
        total = target.sum(1, keepdim=True)
        share = target / total.clamp(min=1.0)
        per = torch.where(positive, -share * log_p, torch.zeros_like(z))
        per_task = per.sum((0, 1))
    return (per_task * weights).sum() / requests
