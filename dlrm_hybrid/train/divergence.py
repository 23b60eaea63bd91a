"""The guard against publishing a diverged model: a checkpoint is written only when every loss
since the last check and every weight is finite on every rank, so "the last good checkpoint"
(what `resume: auto`, torchrun restarts and the divergence error point at) is always good.

Per step it costs one on-device `isfinite` of the loss (no sync); the weights are scanned only
before a checkpoint, which reads them all anyway.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from dlrm_hybrid.errors import TrainingDiverged
from dlrm_hybrid.train.checkpoint import complete_checkpoints


class DivergenceGuard:
    def __init__(self, checkpoint_root: Path, device: torch.device, first_step: int) -> None:
        self.root = checkpoint_root
        self.checked_step = first_step  # every loss up to here is known finite
        self._bad_loss = torch.zeros((), dtype=torch.bool, device=device)

    def observe(self, loss: torch.Tensor) -> None:
        """Every step's local loss: remembered if it is not finite."""
        self._bad_loss |= ~torch.isfinite(loss)

    def check_loss(self, global_loss: float, step: int) -> None:
        """At a log step, with the loss every rank agrees on (all-reduced)."""
        if not math.isfinite(global_loss):
            self._diverged(f"the loss became {global_loss}", step)
        self._forget(step)

    def check_state(self, dmp, step: int) -> None:
        """Collective, before a checkpoint: raises on every rank if any rank saw a non-finite
        loss since the last check or holds a non-finite weight."""
        bad = self._bad_loss.clone()
        for value in dmp.state_dict().values():
            for tensor in _local_tensors(value):
                bad |= ~torch.isfinite(tensor).all()
        flag = bad.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            self._diverged("the loss or the weights became non-finite", step)
        self._forget(step)

    def _forget(self, step: int) -> None:
        self.checked_step = step
        self._bad_loss.zero_()

    def _diverged(self, what: str, step: int) -> None:
        found = complete_checkpoints(self.root)
        then = (f"the last good checkpoint is {found[-1]}: lower the learning rates and resume "
                f"from it" if found else "no checkpoint was written: lower the learning rates")
        raise TrainingDiverged(f"{what} between steps {self.checked_step + 1} and {step}; {then}")


def _local_tensors(value):
    """This rank's part of a state-dict entry: a sharded table's local shards, or the tensor."""
    if hasattr(value, "local_shards"):
        return [shard.tensor for shard in value.local_shards()]
    if hasattr(value, "to_local"):
        return [value.to_local()]
    return [value] if isinstance(value, torch.Tensor) else []
