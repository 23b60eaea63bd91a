"""Exact retrieval metrics over the whole item corpus, computed on all ranks.

Every rank computes the item tower over its share of the corpus; the vectors are all-gathered
(items x E floats on each rank). Then each rank takes its share of the split's users and, in
chunks of `retrieval.eval_items_per_chunk` items, counts for each of a user's relevant items
how many corpus items score higher, leaving out the items the user engaged with in earlier
splits (training, and validation when testing). That count is the relevant item's exact rank;
recall, HR, NDCG at each K and MRR follow from the ranks, and the per-user sums are all-reduced,
so 1 and N ranks give the same numbers.
"""

from __future__ import annotations

import math
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from dlrm_hybrid.data.batch import Batch
from dlrm_hybrid.model.two_tower import split_towers

EARLIER = {"val": ("train",), "test": ("train", "val")}  # what each split's users have seen


def _model(dmp):
    return getattr(dmp, "module", dmp)


@torch.no_grad()
def corpus_vectors(dmp, dataset, env, batch: int) -> torch.Tensor:
    """[items, E] item-tower vectors of the whole corpus, on every rank."""
    per_rank = -(-dataset.items // env.world_size)
    steps = -(-per_rank // batch)
    first = env.rank * per_rank
    out = []
    for s in range(steps):
        start = first + s * batch
        count = max(0, min(batch, first + per_rank - start))
        columns = dataset.corpus_columns(start, batch)
        columns.valid &= np.arange(batch) < count
        b = Batch.from_columns(columns, dataset.spec.feature_names).to(env.device)
        _, item = split_towers(dmp(b.dense, b.sparse))
        out.append(item[b.valid])
    local = torch.cat(out) if out else torch.zeros(0, device=env.device)
    return _gather_ragged(local, env)


def _gather_ragged(local: torch.Tensor, env) -> torch.Tensor:
    if env.world_size == 1:
        return local
    sizes = torch.tensor([local.shape[0]], device=local.device)
    all_sizes = [torch.zeros_like(sizes) for _ in range(env.world_size)]
    dist.all_gather(all_sizes, sizes)
    most = int(max(s.item() for s in all_sizes))
    padded = torch.zeros(most, local.shape[1], dtype=local.dtype, device=local.device)
    padded[:local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(env.world_size)]
    dist.all_gather(pieces, padded)
    return torch.cat([p[:int(n.item())] for p, n in zip(pieces, all_sizes)])


@torch.no_grad()
def evaluate_retrieval(dmp, dataset, retrieval_cfg, env, batch: int, split: str = "val",
                       prefix: str = "val_") -> Optional[Dict[str, float]]:
    """recall@K, hr@K, ndcg@K for K in `retrieval.eval_k`, and mrr, averaged over the
    split's users (rank 0 gets them; None elsewhere)."""
    model = _model(dmp)
    model.eval()
    try:
        items = corpus_vectors(dmp, dataset, env, batch)
        seen_ptr, seen = dataset.engaged(EARLIER[split])
        want_ptr, want = dataset.engaged((split,))
        users = np.flatnonzero(np.diff(want_ptr))
        mine = np.array_split(users, env.world_size)[env.rank]
        ks = sorted(retrieval_cfg.eval_k)
        sums = torch.zeros(2 * len(ks) + 2, dtype=torch.float64)
        steps = torch.tensor([-(-len(mine) // batch)])
        if env.world_size > 1:
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        for s in range(int(steps.item())):
            chunk = mine[s * batch:(s + 1) * batch]
            user_vecs = _user_vectors(dmp, dataset, chunk, batch, env)
            sums += _batch_sums(user_vecs[:len(chunk)], items, chunk, seen_ptr, seen, want_ptr,
                                want, ks, retrieval_cfg.eval_items_per_chunk)
    finally:
        model.train()
    if env.world_size > 1:
        dist.all_reduce(sums)
    if not env.is_main:
        return None
    n = max(1.0, sums[-1].item())
    out = {}
    for i, k in enumerate(ks):
        out[f"{prefix}recall@{k}"] = sums[i].item() / n
        out[f"{prefix}hr@{k}"] = sums[len(ks) + i].item() / n
    out[f"{prefix}mrr"] = sums[2 * len(ks)].item() / n
    out["users"] = int(sums[-1].item())
    return out


def _user_vectors(dmp, dataset, users: np.ndarray, batch: int, env) -> torch.Tensor:
    """User-tower vectors of `users` (a padded batch, so every rank runs the same lookups)."""
    padded = np.zeros(batch, np.int64)
    padded[:len(users)] = users
    columns = dataset.tower_columns(padded, np.zeros(batch, np.int64), np.arange(batch) < len(users))
    b = Batch.from_columns(columns, dataset.spec.feature_names).to(env.device)
    user, _ = split_towers(dmp(b.dense, b.sparse))
    return user


def _batch_sums(user: torch.Tensor, items: torch.Tensor, users: np.ndarray, seen_ptr, seen,
                want_ptr, want, ks, chunk: int) -> torch.Tensor:
    """Per-metric sums over these users: recall@K, hr@K, mrr, count."""
    rows = torch.from_numpy(np.repeat(np.arange(len(users)), want_ptr[users + 1] - want_ptr[users]))
    relevant = torch.from_numpy(np.concatenate([want[want_ptr[u]:want_ptr[u + 1]] for u in users]
                                               or [np.zeros(0, np.int64)]))
    rows, relevant = rows.to(user.device), relevant.to(user.device)
    positive = (user[rows] * items[relevant]).sum(1)
    above = torch.zeros(len(rows), dtype=torch.int64, device=user.device)
    seen_rows = np.repeat(np.arange(len(users)), seen_ptr[users + 1] - seen_ptr[users])
    seen_items = np.concatenate([seen[seen_ptr[u]:seen_ptr[u + 1]] for u in users]
                                or [np.zeros(0, np.int64)])
    for start in range(0, items.shape[0], chunk):
        scores = user @ items[start:start + chunk].T
        inside = (seen_items >= start) & (seen_items < start + scores.shape[1])
        scores[torch.from_numpy(seen_rows[inside]), torch.from_numpy(seen_items[inside] - start)] = -math.inf
        above += (scores[rows] > positive[:, None]).sum(1)
    ks_t = torch.tensor(ks, device=user.device)
    hit = (above[:, None] < ks_t[None, :]).double()  # [pairs, K]
    per_user = torch.zeros(len(users), len(ks), dtype=torch.float64, device=user.device)
    per_user.index_add_(0, rows, hit)
    count = torch.from_numpy(want_ptr[users + 1] - want_ptr[users]).to(user.device).double()
    recall = (per_user / torch.minimum(count[:, None], ks_t[None, :].double())).sum(0)
    hr = (per_user > 0).double().sum(0)
    best = torch.full((len(users),), float(items.shape[0]), dtype=torch.float64, device=user.device)
    best.scatter_reduce_(0, rows, above.double(), reduce="amin")
    mrr = (1.0 / (best + 1)).sum()
    return torch.cat([recall.cpu(), hr.cpu(), mrr.cpu()[None], torch.tensor([len(users)], dtype=torch.float64)])
