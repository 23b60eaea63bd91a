"""What the two-tower model is measured against: a popularity baseline and `implicit`'s matrix
factorisation (ALS, BPR), trained on the same training split and scored by the same code.

Every peer here is a pair of vector tables (users [U, E], items [I, E]) whose dot product is its
score, so `retrieval/evaluate.py` ranks it exactly as it ranks the towers: the whole corpus,
the user's earlier-split items left out, the relevant item's rank = the items scoring strictly
higher. `implicit` is imported only inside the functions that train with it.
"""

from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch

from dlrm_hybrid.data.interactions.interaction_data import InteractionData

Vectors = Tuple[np.ndarray, np.ndarray]  # (users [U, E], items [I, E]); score = their dot product


def train_matrix(data: InteractionData):
    """The training split as a binary user x item CSR matrix (implicit's `fit` input)."""
    from scipy.sparse import csr_matrix

    indptr, items = data.engaged(("train",))
    return csr_matrix((np.ones(len(items), np.float32), items, indptr),
                      shape=(data.users, data.items))


def popularity(data: InteractionData) -> Vectors:
    """Every user gets the items with the most training engagements first; among equal counts
    the lower item id comes first (a strict order: no tie flatters a relevant item)."""
    counts = np.bincount(np.asarray(data.pairs["train"][1]), minlength=data.items)
    score = counts + 0.5 * (1.0 - np.arange(data.items) / data.items)  # < 1 apart: counts rule
    return np.ones((data.users, 1)), score[:, None]


def als(data: InteractionData, factors: int = 64, regularization: float = 0.01,
        alpha: float = 1.0, iterations: int = 15, seed: int = 0, threads: int = 0) -> Vectors:
    """implicit's AlternatingLeastSquares (Hu, Koren, Volinsky 2008) on the training split."""
    from implicit.cpu.als import AlternatingLeastSquares

    model = AlternatingLeastSquares(factors=factors, regularization=regularization, alpha=alpha,
                                    iterations=iterations, random_state=seed,
                                    num_threads=threads)
    model.fit(train_matrix(data), show_progress=False)
    return np.asarray(model.user_factors), np.asarray(model.item_factors)


def bpr(data: InteractionData, factors: int = 64, learning_rate: float = 0.01,
        regularization: float = 0.01, iterations: int = 100, seed: int = 0,
        threads: int = 0) -> Vectors:
    """implicit's BayesianPersonalizedRanking (Rendle et al. 2009) on the training split; its
    item vectors carry the item bias against a constant 1 in the user vectors."""
    from implicit.cpu.bpr import BayesianPersonalizedRanking

    model = BayesianPersonalizedRanking(factors=factors, learning_rate=learning_rate,
                                        regularization=regularization, iterations=iterations,
                                        random_state=seed, num_threads=threads)
    model.fit(train_matrix(data), show_progress=False)
    return np.asarray(model.user_factors), np.asarray(model.item_factors)


class FixedVectors(torch.nn.Module):
    """A peer's tables behind the two-tower evaluation interface: `forward(dense, sparse)` gives
    [B, 2E] user | item vectors looked up by the batch's user_id and item_id features (a row
    whose bag is empty gets zeros)."""

    def __init__(self, vectors: Vectors) -> None:
        super().__init__()
        users, items = vectors
        if users.shape[1] != items.shape[1]:
            raise ValueError(f"user vectors of width {users.shape[1]}, items {items.shape[1]}")
        self.users = torch.from_numpy(np.ascontiguousarray(users, np.float64))
        self.items = torch.from_numpy(np.ascontiguousarray(items, np.float64))

    def forward(self, dense: torch.Tensor, sparse) -> torch.Tensor:
        return torch.cat([self._lookup(self.users, sparse["user_id"]),
                          self._lookup(self.items, sparse["item_id"])], dim=1)

    @staticmethod
    def _lookup(table: torch.Tensor, bags) -> torch.Tensor:
        lengths = bags.lengths()
        out = torch.zeros(len(lengths), table.shape[1], dtype=table.dtype)
        out[lengths > 0] = table[bags.values().long()]
        return out


def evaluate_peer(vectors: Vectors, data: InteractionData, retrieval_cfg, split: str = "test",
                  batch: int = 1024) -> Dict[str, float]:
    """`evaluate_retrieval`'s metrics of a peer on `split` (one process), keys prefixed by it."""
    from dlrm_hybrid.parallel.process_group import DistEnv
    from dlrm_hybrid.retrieval.evaluate import evaluate_retrieval

    env = DistEnv(0, 1, 0, 1, "gloo", torch.device("cpu"))
    return evaluate_retrieval(FixedVectors(vectors), data, retrieval_cfg, env, batch,
                              split=split, prefix=f"{split}_")
