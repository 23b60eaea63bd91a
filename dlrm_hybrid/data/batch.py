"""One rank's slice of a global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


@dataclass
class Batch:
    dense: torch.Tensor  # [B, num_dense] float32
    sparse: KeyedJaggedTensor  # one key per categorical feature, B bags each
    labels: torch.Tensor  # [B] float32 in {0, 1}
    valid: torch.Tensor  # [B] bool; False marks padding of the last evaluation batch
    true_prob: Optional[torch.Tensor] = None  # [B] the planted click probability (synthetic data)

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.dense), self.sparse.to(device, non_blocking=non_blocking),
                     move(self.labels), move(self.valid), move(self.true_prob))

    def pin_memory(self) -> "Batch":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.dense), self.sparse.pin_memory(), pin(self.labels), pin(self.valid),
                     pin(self.true_prob))


def fixed_hotness_kjt(keys: List[str], ids: List[torch.Tensor]) -> KeyedJaggedTensor:
    """KJT from one [B, hotness] id tensor per feature (every bag of a feature has the same size)."""
    batch, device = ids[0].shape[0], ids[0].device
    lengths = torch.cat([torch.full((batch,), t.shape[1], dtype=torch.int32, device=device)
                         for t in ids])
    values = torch.cat([t.reshape(-1) for t in ids])
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
