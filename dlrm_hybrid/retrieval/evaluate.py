"""Exact retrieval metrics over the whole item corpus, computed on all ranks.

Every rank computes the item tower over its share of the corpus; the vectors are all-gathered
(items x E floats on each rank). Then each rank takes its share of the split's users and, in
chunks of `retrieval.eval_items_per_chunk` items, counts for each of a user's relevant items
how many corpus items score higher (or as high, with a lower item id: ties as a stable sort
serves them), leaving out the items the user engaged with in earlier splits (training, and
validation when testing). That count is the relevant item's exact 0-based position in the
user's ranking of the corpus; recall, HR and NDCG (binary relevance)
at each K and MRR follow from the positions, and the per-user sums are all-reduced, so 1 and N
ranks give the same numbers (up to the order of float sums). Memory per user batch is bounded
by one [users, chunk] score block and its comparison with the relevant items' scores.

A relevant item the user engaged with in an earlier split (a re-watch) is not one to find:
serving (`retrieve`, `recommend`) never returns a user's training items (docs/retrieval.md).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

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
                       prefix: str = "") -> Optional[Dict[str, float]]:
    """recall@K, hr@K, ndcg@K for K in `retrieval.eval_k`, and mrr, averaged over the
    split's users, named `<prefix or split_>metric`; with the planted log's ceiling beside
    them where the dataset records one. Rank 0 gets them; None elsewhere."""
    prefix = prefix or f"{split}_"
    model = _model(dmp)
    model.eval()
    try:
        items = corpus_vectors(dmp, dataset, env, batch)
        seen = dataset.engaged(EARLIER[split])
        want = dataset.findable(split, EARLIER[split])
        users = np.flatnonzero(np.diff(want[0]))
        mine = np.array_split(users, env.world_size)[env.rank]
        ks = sorted(retrieval_cfg.eval_k)
        sums = torch.zeros(3 * len(ks) + 2, dtype=torch.float64)
        steps = torch.tensor([-(-len(mine) // batch)])
        if env.world_size > 1:  # every rank runs the user tower as often (sharded lookups)
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        for s in range(int(steps.item())):
            chunk = mine[s * batch:(s + 1) * batch]
            user_vecs = _user_vectors(dmp, dataset, chunk, batch, env, split)
            sums += _batch_sums(user_vecs[:len(chunk)], items, _csr_rows(*want, chunk),
                                _csr_rows(*seen, chunk), ks, retrieval_cfg.eval_items_per_chunk)
    finally:
        model.train()
    if env.world_size > 1:
        dist.all_reduce(sums)
    if not env.is_main:
        return None
    n = max(1.0, sums[-1].item())
    out = {}
    for i, k in enumerate(ks):
        for j, name in enumerate(("recall", "hr", "ndcg")):
            out[f"{prefix}{name}@{k}"] = sums[j * len(ks) + i].item() / n
    out[f"{prefix}mrr"] = sums[3 * len(ks)].item() / n
    out.update({k: v for k, v in ceiling(dataset, split, prefix).items()
                if k.replace("ceiling_", "") in out})  # the cut-offs evaluated
    out["users"] = int(sums[-1].item())
    return out


def ceiling(dataset, split: str, prefix: str) -> Dict[str, float]:
    """What the planted log's own teacher scores on `split`, as `<prefix>ceiling_<metric>`,
    where the dataset records it (interactions.yaml `extra`: `ceiling_<metric>` for test,
    `ceiling_val_<metric>` for val): the best a learner can reach."""
    extra = dataset.meta.extra
    mark = "ceiling_val_" if split == "val" else "ceiling_"
    return {f"{prefix}ceiling_{key[len(mark):]}": float(value) for key, value in extra.items()
            if key.startswith(mark) and (split == "val" or not key.startswith("ceiling_val_"))}


def _user_vectors(dmp, dataset, users: np.ndarray, batch: int, env, split: str) -> torch.Tensor:
    """User-tower vectors of `users` (a padded batch, so every rank runs the same lookups); a
    history tower reads what each user did before `split`."""
    padded = np.zeros(batch, np.int64)
    padded[:len(users)] = users
    columns = dataset.user_columns(padded, np.arange(batch) < len(users), split)
    b = Batch.from_columns(columns, dataset.spec.feature_names).to(env.device)
    user, _ = split_towers(dmp(b.dense, b.sparse))
    return user


def _csr_rows(indptr: np.ndarray, values: np.ndarray, users: np.ndarray
              ) -> Tuple[np.ndarray, np.ndarray]:
    """(position of the user in `users`, value) of every entry of those users' CSR rows."""
    counts = indptr[users + 1] - indptr[users]
    rows = np.repeat(np.arange(len(users)), counts)
    offsets = np.repeat(indptr[users] - (np.cumsum(counts) - counts), counts)
    return rows, np.asarray(values[offsets + np.arange(len(rows))], np.int64)


def _batch_sums(user: torch.Tensor, items: torch.Tensor, wanted, seen, ks: List[int],
                chunk: int) -> torch.Tensor:
    """Sums over these users of recall@K, hr@K, ndcg@K, mrr, and their count. `wanted` and
    `seen`: (user's row in `user`, item) pairs to find and to leave out."""
    n, device = len(user), user.device
    sums = torch.zeros(3 * len(ks) + 2, dtype=torch.float64)
    if not n:
        return sums
    rows, relevant = (torch.from_numpy(a).to(device) for a in wanted)
    seen_rows, seen_items = (torch.from_numpy(a).to(device) for a in seen)
    positive = (user[rows] * items[relevant]).sum(1)
    above = torch.zeros(len(rows), dtype=torch.int64, device=device)
    # The j-th relevant item of each user: rows in order, at most one per user (j = 0: all).
    first = torch.searchsorted(rows, torch.arange(n, device=device))
    nth = torch.arange(len(rows), device=device) - first[rows]
    groups = [torch.nonzero(nth == j).flatten() for j in range(int(nth.max()) + 1)]
    for start in range(0, items.shape[0], chunk):
        scores = user @ items[start:start + chunk].T  # [users, chunk]: the memory bound
        inside = (seen_items >= start) & (seen_items < start + scores.shape[1])
        scores[seen_rows[inside], seen_items[inside] - start] = -math.inf
        ids = torch.arange(start, start + scores.shape[1], device=device)[None, :]
        for pairs in groups:
            mine = scores if len(pairs) == n else scores[rows[pairs]]
            higher = mine > positive[pairs, None]
            # a tie goes to the lower item id, as a stable sort serves it: several relevant
            # items tied (a zero vector ties every item) are not all first
            tied = mine == positive[pairs, None]
            if bool(tied.any()):
                higher |= tied & (ids < relevant[pairs, None])
            above[pairs] += higher.view(torch.uint8).sum(1, dtype=torch.int32)
        # An item is not above itself: its score here may round apart from `positive`.
        own = (relevant >= start) & (relevant < start + scores.shape[1])
        above[own] -= (scores[rows[own], relevant[own] - start] > positive[own]).long()
    ks_t = torch.tensor(ks, device=device)
    hit = (above[:, None] < ks_t[None, :]).double()  # [pairs, K]
    found = torch.zeros(n, len(ks), dtype=torch.float64, device=device).index_add_(0, rows, hit)
    discount = 1.0 / torch.log2(above.double() + 2)
    dcg = torch.zeros(n, len(ks), dtype=torch.float64, device=device).index_add_(
        0, rows, hit * discount[:, None])
    count = torch.bincount(rows, minlength=n).double()
    best = torch.log2(torch.arange(max(ks), dtype=torch.float64, device=device) + 2)
    ideal = (1.0 / best).cumsum(0)[(torch.minimum(count[:, None], ks_t[None, :]) - 1).long()]
    first_hit = torch.full((n,), float(items.shape[0]), dtype=torch.float64, device=device)
    first_hit.scatter_reduce_(0, rows, above.double(), reduce="amin")
    return torch.cat([(found / torch.minimum(count[:, None], ks_t[None, :])).sum(0).cpu(),
                      (found > 0).double().sum(0).cpu(), (dcg / ideal).sum(0).cpu(),
                      (1.0 / (first_hit + 1)).sum().cpu()[None],
                      torch.tensor([n], dtype=torch.float64)])
