"""Exact validation metrics over the whole split, gathered from every rank."""

from __future__ import annotations

import math
import warnings
from typing import Dict, Iterable, List, Optional

import torch
import torch.distributed as dist
from torch.nn.functional import binary_cross_entropy_with_logits


@torch.no_grad()
def evaluate(model, batches: Iterable, env, prefix: str = "val_",
             tasks: Optional[List[str]] = None) -> Optional[Dict[str, float]]:
    """`<prefix>auc` and `<prefix>logloss` over one pass of `batches` (this rank's slices of a
    split) on rank 0 (None elsewhere); `oracle_auc` too when the data knows the true click
    probabilities. With `tasks` (multi-task), each task's: `<prefix>auc_<task>`,
    `<prefix>logloss_<task>`, `oracle_auc_<task>` over the `samples_<task>` that have its
    label (`samples`: all of them)."""
    model.eval()
    columns = []  # per batch: [logits, labels, valid, true_prob] x local batch, T rows each
    for batch in batches:
        logits = model(batch.dense, batch.sparse).float()
        true_prob = batch.true_prob if batch.true_prob is not None else torch.full_like(logits, -1)
        columns.append(torch.cat([_rows(logits), _rows(batch.labels),
                                  batch.valid.float()[None], _rows(true_prob)]))
    model.train()
    local = torch.cat(columns, dim=1)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)] if env.is_main else None
    dist.gather(local, gathered, dst=0)
    if not env.is_main:
        return None
    table = torch.cat(gathered, dim=1).cpu()
    width = len(tasks) if tasks else 1
    logits, labels = table[:width], table[width:2 * width]
    valid, true_prob = table[2 * width] > 0.5, table[2 * width + 1:]
    if not tasks:
        return _metrics(logits[0], labels[0], true_prob[0], valid, prefix, "")
    result = {}
    for t, task in enumerate(tasks):
        keep = valid & ~torch.isnan(labels[t])
        result.update(_metrics(logits[t], labels[t], true_prob[t], keep, prefix, f"_{task}"))
        result[f"samples_{task}"] = result.pop("samples")
    return {**result, "samples": int(valid.sum())}


def _rows(values: torch.Tensor) -> torch.Tensor:
    """[B] -> [1, B]; [B, T] -> [T, B]."""
    return values[None] if values.dim() == 1 else values.t()


def _metrics(logits: torch.Tensor, labels: torch.Tensor, true_prob: torch.Tensor,
             keep: torch.Tensor, prefix: str, suffix: str) -> Dict[str, float]:
    logits, labels, true_prob = logits[keep], labels[keep], true_prob[keep]
    result = {
        f"{prefix}auc{suffix}": auc_or_nan(torch.sigmoid(logits), labels, f"{prefix}auc{suffix}"),
        f"{prefix}logloss{suffix}": binary_cross_entropy_with_logits(logits, labels).item(),
        "samples": int(keep.sum()),
    }
    if (true_prob >= 0).all():
        result[f"oracle_auc{suffix}"] = auc_or_nan(true_prob, labels, f"oracle_auc{suffix}")
    return result


def binary_auroc(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Area under the ROC curve of `scores` for 0/1 `labels` holding both classes: one ROC point
    per distinct score (tied scores move together), joined by trapezoids, in torchmetrics'
    `binary_auroc` arithmetic (it gives the same values). Not imported from torchmetrics: its
    import (every metric it has, and matplotlib) cost ~1 s of CPU, ~15% of the start of every
    process that trains or evaluates."""
    order = torch.argsort(scores, descending=True)
    scores, labels = scores[order], labels[order].long()
    ends = torch.nonzero(scores[1:] - scores[:-1]).flatten()  # the last of each tied run
    ends = torch.cat([ends, ends.new_tensor([len(scores) - 1])])
    tps = torch.cumsum(labels, 0)[ends]
    fps = 1 + ends - tps
    zero = tps.new_zeros(1)
    tpr, fpr = torch.cat([zero, tps]) / tps[-1], torch.cat([zero, fps]) / fps[-1]
    return torch.trapezoid(tpr, fpr)


def auc_or_nan(scores: torch.Tensor, labels: torch.Tensor, name: str) -> float:
    """AUROC, or NaN with a warning when the split has one class only (the ROC is undefined)
    or a score is NaN (it has no place in the order)."""
    unscored = int(torch.isnan(scores).sum())
    if unscored:
        warnings.warn(f"{name}: undefined (nan): {unscored} of {len(labels)} samples scored nan "
                      f"(a nan or inf among their dense values?)")
        return math.nan
    clicks = int(labels.sum())
    if 0 < clicks < len(labels):
        return binary_auroc(scores, labels.long()).item()
    warnings.warn(f"{name}: undefined (nan): all {len(labels)} samples of the split are "
                  f"{'clicks' if clicks else 'non-clicks'}; evaluate on a split with both")
    return math.nan
