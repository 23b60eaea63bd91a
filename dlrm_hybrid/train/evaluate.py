"""Exact validation metrics over the whole split, gathered from every rank."""

from __future__ import annotations

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
        f"{prefix}auc": binary_auroc(torch.sigmoid(logits), labels.long()).item(),
        f"{prefix}logloss": binary_cross_entropy_with_logits(logits, labels).item(),
        "samples": int(keep.sum()),
    }
    if (true_prob >= 0).all():
        result["oracle_auc"] = binary_auroc(true_prob, labels.long()).item()
    return result
