"""The DALI input pipeline: the same batches as the PyTorch loader, fed through a DALI pipeline
(`external_source`) that prefetches them, onto the GPU when there is one, on the CPU otherwise."""

from __future__ import annotations

from typing import Iterator, List

import numpy as np
import torch

from dlrm_hybrid.data.batch import Batch, fixed_hotness_kjt


class DaliLoader:
    def __init__(self, batches: Iterator[Batch], feature_names: List[str], device: torch.device,
                 depth: int = 4) -> None:
        import nvidia.dali as dali
        import nvidia.dali.fn as fn
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        self.keys = list(feature_names)
        self._batches = batches
        first = next(batches)  # the pipeline needs the batch size before it starts
        self._pending = [first]
        self._has_true_prob = first.true_prob is not None
        self.names = ["dense", "labels", "valid", "true_prob", *self.keys]
        gpu = device.type == "cuda"

        @dali.pipeline_def(batch_size=len(first.labels), num_threads=1,
                           device_id=device.index if gpu else None, prefetch_queue_depth=depth)
        def pipeline():
            outputs = fn.external_source(source=self._next_columns, num_outputs=len(self.names),
                                         batch=True)
            return tuple(o.gpu() for o in outputs) if gpu else tuple(outputs)

        self._pipe = pipeline()
        self._pipe.build()
        self._iterator = DALIGenericIterator([self._pipe], self.names, size=-1)

    def _next_columns(self):
        """One batch as numpy columns; StopIteration ends an evaluation pass."""
        batch = self._pending.pop() if self._pending else next(self._batches)
        n = len(batch.labels)
        true_prob = batch.true_prob if self._has_true_prob else torch.zeros(n)
        ids = [batch.sparse[k].values().numpy().reshape(n, -1) for k in self.keys]
        return (batch.dense.numpy(), batch.labels.numpy(), batch.valid.numpy().astype(np.uint8),
                true_prob.numpy(), *ids)

    def __iter__(self) -> "DaliLoader":
        return self

    def __next__(self) -> Batch:
        out = next(self._iterator)[0]
        sparse = fixed_hotness_kjt(self.keys, [out[k].to(torch.int64) for k in self.keys])
        return Batch(out["dense"], sparse, out["labels"], out["valid"].bool(),
                     out["true_prob"] if self._has_true_prob else None)

    def close(self) -> None:
        del self._iterator, self._pipe
