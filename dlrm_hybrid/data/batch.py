"""One rank's slice of a global batch: as numpy columns (what datasets read) and as the
tensors the model takes."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.fx._symbolic_trace import PHWithMeta
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from dlrm_hybrid.errors import DataError


@dataclass
class Columns:
    """numpy arrays (what the DALI loader and the writers read), or torch tensors on a device
    (SyntheticClicks.tensor_columns); `Batch.from_columns` takes either."""

    dense: np.ndarray  # [B, num_dense] float32
    labels: np.ndarray  # [B] float32 in {0, 1}; with tasks [B, T], NaN where a label is missing
    valid: np.ndarray  # [B] bool; False marks padding of the last evaluation batch
    ids: List[np.ndarray]  # per categorical feature, [B, hotness] int64
    true_prob: Optional[np.ndarray] = None  # [B] (tasks: [B, T]) float32, the planted probability
    lengths: Optional[List[np.ndarray]] = None  # per feature, [B] int32: ids used, a row's first; None: all


class ClickDataset:
    """What the loaders need of a dataset: its shape, split sizes, and columns of samples
    [first, first + count) of a split, indices past the end being padding (valid=False)."""

    spec = None  # DataSpec
    label_names: Tuple[str, ...] = ("click",)  # the labels a sample may carry
    tasks: Optional[List[str]] = None  # set by use_tasks: labels come as [B, T] in this order
    # batch(split, first, count, device) makes the batch on a CUDA device itself (no host copy)
    device_batches = False

    def use_tasks(self, tasks: Sequence[str], where: str) -> None:
        """Read the labels of `tasks` (model.tasks' names), [B, T]; none: the one label, [B].
        `where` names the dataset in errors."""
        unknown = [t for t in tasks if t not in self.label_names]
        if unknown:
            raise DataError(f"model.tasks: {where} has no label {unknown[0]!r}; its labels are "
                            f"{', '.join(self.label_names)}")
        if not tasks and len(self.label_names) > 1:
            raise DataError(f"model.tasks: {where} has labels {', '.join(self.label_names)}; "
                            f"name the ones to train in model.tasks, e.g. "
                            f"model.tasks=[{{name: {self.label_names[0]}}}]")
        self.tasks = list(tasks) or None

    def num_samples(self, split: str) -> int:
        raise NotImplementedError

    def columns(self, split: str, first: int, count: int) -> Columns:
        raise NotImplementedError

    def slice_columns(self, split: str, piece) -> Columns:
        """A rank's slice (data/slices.py's `Slice`): its runs of rows, one after the other."""
        return stacked([self.columns(split, first, count) for first, count in piece.runs])

    def batch(self, split: str, first: int, count: int) -> "Batch":
        return Batch.from_columns(self.columns(split, first, count), self.spec.feature_names)


def stacked(parts: Sequence[Columns]) -> Columns:
    """numpy columns of consecutive parts as one (the rows of the first, then the next...)."""
    if len(parts) == 1:
        return parts[0]
    cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    per_feature = lambda name: [np.concatenate(ts)  # noqa: E731
                                for ts in zip(*[getattr(p, name) for p in parts])]
    return Columns(cat("dense"), cat("labels"), cat("valid"), per_feature("ids"),
                   None if parts[0].true_prob is None else cat("true_prob"),
                   None if parts[0].lengths is None else per_feature("lengths"))


@dataclass
class Batch(Pipelineable):
    """torchrec's train pipeline moves it to the device on its own stream (`to`,
    `record_stream`) and traces which model arguments it feeds (`to_proxy_tuple`)."""

    dense: torch.Tensor  # [B, num_dense] float32
    sparse: KeyedJaggedTensor  # one key per categorical feature, B bags each
    labels: torch.Tensor  # [B] float32 in {0, 1}; with tasks [B, T], NaN: missing
    valid: torch.Tensor  # [B] bool; False marks padding of the last evaluation batch
    true_prob: Optional[torch.Tensor] = None  # [B] (tasks: [B, T]) the planted probability

    @staticmethod
    def from_columns(c: Columns, feature_names: List[str]) -> "Batch":
        tensor = lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(a)  # noqa: E731
        sparse = (fixed_hotness_kjt(feature_names, c.ids) if c.lengths is None
                  else jagged_kjt(feature_names, [tensor(i) for i in c.ids],
                                  [tensor(n) for n in c.lengths]))
        return Batch(tensor(c.dense), sparse, tensor(c.labels), tensor(c.valid),
                     None if c.true_prob is None else tensor(c.true_prob))

    def to(self, device: torch.device, non_blocking: bool = False) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(move(self.dense), self.sparse.to(device, non_blocking=non_blocking),
                     move(self.labels), move(self.valid), move(self.true_prob))

    def record_stream(self, stream) -> None:
        for t in (self.dense, self.labels, self.valid, self.true_prob):
            if t is not None:
                t.record_stream(stream)
        self.sparse.record_stream(stream)

    def to_proxy_tuple(self, model) -> dict:
        """The model's forward arguments are this batch's fields of the same names."""
        names = inspect.signature(model.forward).parameters
        return {name: PHWithMeta(name) for name in names}

    def pin_memory(self) -> "Batch":
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(pin(self.dense), self.sparse.pin_memory(), pin(self.labels), pin(self.valid),
                     pin(self.true_prob))


def fixed_hotness_kjt(keys: List[str], ids: Sequence[Union[np.ndarray, torch.Tensor]]
                      ) -> KeyedJaggedTensor:
    """KJT from one [B, hotness] id array per feature (every bag of a feature has the same size):
    numpy arrays are joined by numpy (on the host, a torch op per feature costs more than the
    copy: batch 65536, 2 threads, 36 ms of 62 per batch); the per-key sizes are known, so the
    KJT needs no pass over its lengths to find them (on a GPU, a device-to-host sync)."""
    batch, hotness = ids[0].shape[0], [t.shape[1] for t in ids]
    if isinstance(ids[0], np.ndarray):
        values = torch.from_numpy(np.concatenate([t.reshape(-1) for t in ids]))
        lengths = torch.from_numpy(np.repeat(np.array(hotness, dtype=np.int32), batch))
    else:
        device = ids[0].device
        values = torch.cat([t.reshape(-1) for t in ids])
        lengths = (torch.full((batch * len(ids),), hotness[0], dtype=torch.int32, device=device)
                   if len(set(hotness)) == 1 else
                   torch.cat([torch.full((batch,), h, dtype=torch.int32, device=device)
                              for h in hotness]))
    per_key = [batch * h for h in hotness]
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, stride=batch,
                             length_per_key=per_key,
                             offset_per_key=list(itertools.accumulate(per_key, initial=0)))


def jagged_kjt(keys: List[str], ids: List[torch.Tensor], lengths: List[torch.Tensor]
               ) -> KeyedJaggedTensor:
    """KJT from one [B, hotness] id tensor per feature of which row b uses its first lengths[b]
    ids: one mask per feature instead of a loop over samples (this runs every step)."""
    used = [torch.arange(t.shape[1], device=t.device) < n[:, None] for t, n in zip(ids, lengths)]
    values = torch.cat([torch.masked_select(t, mask) for t, mask in zip(ids, used)])
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values,
                                               lengths=torch.cat(lengths).int())
