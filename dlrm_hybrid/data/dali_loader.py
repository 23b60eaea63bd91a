"""The DALI input pipeline: the same batches as the PyTorch loader, fed through a DALI pipeline
(`external_source`) that prefetches them, onto the GPU when there is one, on the CPU otherwise."""

from __future__ import annotations

from typing import Iterator, List

import numpy as np
import torch

from dlrm_hybrid.data.batch import Batch, Columns, fixed_hotness_kjt


class DaliLoader:
    def __init__(self, columns: Iterator[Columns], feature_names: List[str], device: torch.device,
                 depth: int = 4) -> None:
        import nvidia.dali as dali
        import nvidia.dali.fn as fn
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        self.keys = list(feature_names)
        self._columns = columns
        first = next(columns)  # the pipeline needs the batch size and widths before it starts
        self._pending = [first]
        self._has_true_prob = first.true_prob is not None
        self._hotness = [ids.shape[1] for ids in first.ids]
        gpu = device.type == "cuda"

        @dali.pipeline_def(batch_size=len(first.labels), num_threads=1,
                           device_id=device.index if gpu else None, prefetch_queue_depth=depth)
        def pipeline():
            outputs = fn.external_source(source=self._pack, num_outputs=2, batch=True)
            return tuple(o.gpu() for o in outputs) if gpu else tuple(outputs)

        self._pipe = pipeline()
        self._pipe.build()
        self._iterator = DALIGenericIterator([self._pipe], ["floats", "ids"], size=-1)

    def _pack(self):
        """One batch as two arrays: [label, valid, true_prob, dense...] as float32 and all
        features' ids side by side as int64. Two DALI outputs instead of one per column: each
        output costs a copy and bookkeeping per batch (measured 2.5x faster this way).
        StopIteration ends an evaluation pass."""
        c = self._pending.pop() if self._pending else next(self._columns)
        n = len(c.labels)
        floats = np.empty((n, 3 + c.dense.shape[1]), dtype=np.float32)
        floats[:, 0], floats[:, 1] = c.labels, c.valid
        floats[:, 2] = c.true_prob if self._has_true_prob else 0.0
        floats[:, 3:] = c.dense
        return floats, np.concatenate(c.ids, axis=1)

    def __iter__(self) -> "DaliLoader":
        return self

    def __next__(self) -> Batch:
        out = next(self._iterator)[0]
        floats, ids = out["floats"], out["ids"]
        sparse = fixed_hotness_kjt(self.keys, list(ids.split(self._hotness, dim=1)))
        return Batch(floats[:, 3:], sparse, floats[:, 0], floats[:, 1].bool(),
                     floats[:, 2] if self._has_true_prob else None)

    def close(self) -> None:
        del self._iterator, self._pipe
