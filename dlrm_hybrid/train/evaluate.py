"""Exact validation metrics over the whole split, gathered from every rank."""

from __future__ import annotations

import math
import warnings
from typing import Dict, Iterable, Optional

import torch
import torch.distributed as dist
from torch.nn.functional import binary_cross_entropy_with_logits
from torchmetrics.functional.classification import binary_auroc


@torch.no_grad()
def evaluate(model, batches: Iterable, env, prefix: str = "val_") -> Optional[Dict[str, float]]:
    """`<prefix>auc` and `<prefix>logloss` over one pass of `batches` (this rank's slices of a
    split) on rank 0 (None elsewhere); `oracle_auc` too when the data knows the true click
    probabilities."""
    model.eval()
    columns = []  # per batch: [logit, label, valid, true_prob] x local batch
    for batch in batches:
        logits = model(batch.dense, batch.sparse).float()
        true_prob = batch.true_prob if batch.true_prob is not None else torch.full_like(logits, -1)
        columns.append(torch.stack([logits, batch.labels, batch.valid.float(), true_prob]))
    model.train()
    local = torch.cat(columns, dim=1)
    gathered = [torch.empty_like(local) for _ in range(env.world_size)] if env.is_main else None
    dist.gather(local, gathered, dst=0)
    if not env.is_main:
        return None
    logits, labels, valid, true_prob = torch.cat(gathered, dim=1)
    keep = valid > 0.5
    logits, labels, true_prob = logits[keep].cpu(), labels[keep].cpu(), true_prob[keep].cpu()
    result = {
        f"{prefix}auc": auc_or_nan(torch.sigmoid(logits), labels, f"{prefix}auc"),
        f"{prefix}logloss": binary_cross_entropy_with_logits(logits, labels).item(),
        "samples": int(keep.sum()),
    }
    if (true_prob >= 0).all():
        result["oracle_auc"] = auc_or_nan(true_prob, labels, "oracle_auc")
    return result


def auc_or_nan(scores: torch.Tensor, labels: torch.Tensor, name: str) -> float:
    """AUROC, or NaN with a warning when the split has one class only (torchmetrics gives 0)."""
    clicks = int(labels.sum())
    if 0 < clicks < len(labels):
        return binary_auroc(scores, labels.long()).item()
    warnings.warn(f"{name}: undefined (nan): all {len(labels)} samples of the split are "
                  f"{'clicks' if clicks else 'non-clicks'}; evaluate on a split with both")
    return math.nan
