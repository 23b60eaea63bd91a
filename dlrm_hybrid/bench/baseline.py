"""The reference-style DLRM the benchmark compares against: how the original DLRM trains,
one `nn.EmbeddingBag(mode="sum", sparse=True)` per table and one `torch.optim.SGD` for all
parameters, fp32, with the same MLPs and the same `dot` interaction (bmm + gather)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits
from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

from dlrm_hybrid.data.batch import Batch
from dlrm_hybrid.model.interactions import build_interaction


class ReferenceDLRM(nn.Module):
    def __init__(self, num_dense: int, rows: List[int], dim: int, bottom_mlp: List[int],
                 top_mlp: List[int], device: torch.device) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum", sparse=True, device=device)
                                    for n in rows)
        self.dense_arch = DenseArch(num_dense, bottom_mlp, device=device)
        self.interaction = InteractionArch(len(rows)).to(device)
        _, width = build_interaction("dot", len(rows), bottom_mlp[-1], dim)
        self.over_arch = OverArch(width, top_mlp, device=device)

    def forward(self, batch: "ReferenceBatch") -> torch.Tensor:
        pooled = [table(ids, offsets) for table, (ids, offsets) in zip(self.tables, batch.lookups)]
        sparse = torch.stack(pooled, dim=1)
        return self.over_arch(self.interaction(self.dense_arch(batch.dense), sparse)).squeeze(1)


@dataclass
class ReferenceBatch:
    """A batch as the reference's loader delivers it: per table, the ids and bag offsets."""

    dense: torch.Tensor
    lookups: List[Tuple[torch.Tensor, torch.Tensor]]
    labels: torch.Tensor

    @staticmethod
    def of(batch: Batch) -> "ReferenceBatch":
        features = batch.sparse.to_dict()
        return ReferenceBatch(batch.dense, [(features[key].values(), features[key].offsets()[:-1])
                                            for key in batch.sparse.keys()], batch.labels)


class ReferenceStep:
    """One SGD step of the reference model (sparse embedding gradients, dense MLP gradients)."""

    def __init__(self, model: ReferenceDLRM, lr: float) -> None:
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def __call__(self, batches: Iterator[ReferenceBatch]) -> torch.Tensor:
        batch = next(batches)
        self.optimizer.zero_grad()
        loss = binary_cross_entropy_with_logits(self.model(batch), batch.labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def reference_step(model_cfg, spec, lr: float, device: torch.device) -> ReferenceStep:
    model = ReferenceDLRM(spec.num_dense, spec.cardinalities, model_cfg.embedding_dim,
                          model_cfg.bottom_mlp, model_cfg.top_mlp, device)
    return ReferenceStep(model, lr)
