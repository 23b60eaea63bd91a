"""The DALI input pipeline: the same batches as the PyTorch loader, fed through a DALI pipeline
(`external_source`) that prefetches them, onto the GPU when there is one, on the CPU otherwise.

DALI's costs are per iteration, per output and per DALI sample, so one DALI sample here is a
whole batch of this rank in two arrays, and one iteration carries several consecutive batches
(GROUP_ROWS samples or more). Measured on one CPU core, batches of 1,024: one batch per
iteration in 12 outputs 0.37M samples/s; in 2 outputs 0.94M; grouped as here 4.3M.

DALI runs each scheduled iteration on its own executor threads, and with a GPU those do CUDA work
(the `.gpu()` copies, their events, pool growth); a CUDA Graph captured in torch's "global" mode
meanwhile fails, or DALI aborts the process (NVIDIA/DALI#3703). `quiesced()` therefore waits until
every scheduled iteration is done and schedules none until exit. That is why this loader drives
the pipeline itself (`share_outputs`, `release_outputs`, `schedule_run`, as DALIGenericIterator
does): the iterator schedules the next iteration inside every `next()`, so it cannot take what is
prefetched without starting more work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import math
from collections import deque
from typing import Deque, Iterator, List, Optional

import numpy as np
import torch

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.batch import Batch, Columns, fixed_hotness_kjt, jagged_kjt

GROUP_ROWS = 8192


def check_dali(loader: str) -> None:
    """`data.loader: dali` where DALI is not installed: a one-line error before any work. A CPU
    install leaves DALI out (requirements-gpu.txt: 955 MB of CUDA libraries a CPU run cannot use);
    the GPU install and `make test` (its CPU pipelines are tested) put it in."""
    if loader != "dali":
        return
    try:
        found = importlib.util.find_spec("nvidia.dali") is not None
    except ImportError:  # no `nvidia` package at all
        found = False
    if not found:
        raise ConfigError("data.loader: 'dali', but NVIDIA DALI is not installed (a CPU install "
                          "leaves it out); install it (.venv/bin/pip install -r "
                          "requirements-gpu.txt) or set data.loader=torch")


class DaliLoader:
    name = "dali"  # data.loader's word for it, in the run's record

    def __init__(self, columns: Iterator[Columns], feature_names: List[str], device: torch.device,
                 depth: int = 4) -> None:
        check_dali(self.name)  # eval of a run trained with DALI, on a host without it
        import nvidia.dali as dali
        import nvidia.dali.fn as fn

        self.keys = list(feature_names)
        self._columns = columns
        first = next(columns)  # the pipeline needs the batch size and widths before it starts
        self._first = [first]
        self._batch = len(first.labels)
        self._group = max(1, math.ceil(GROUP_ROWS / self._batch))
        self._has_true_prob = first.true_prob is not None
        self._hotness = [ids.shape[1] for ids in first.ids]
        self._variable = first.lengths is not None
        self._ready: Deque[Batch] = deque()
        self._pauses = 0  # quiesced() contexts open
        gpu = device.type == "cuda"

        # device_id None: a CPU-only pipeline (DALI's own annotation says int).
        @dali.pipeline_def(batch_size=self._group, num_threads=1,
                           device_id=device.index if gpu else None,  # type: ignore[arg-type]
                           prefetch_queue_depth=depth)
        def pipeline():
            outputs = fn.external_source(source=self._pack, num_outputs=2, batch=True)
            return tuple(o.gpu() for o in outputs) if gpu else tuple(outputs)

        self._pipe: Optional[dali.Pipeline] = pipeline()
        self._pipe.build()
        self._pipe.schedule_run()  # the first call prefetches `depth` iterations

    def _pack(self):
        """Up to `group` batches, each one DALI sample of two arrays: [label, valid, true_prob,
        dense...] float32 rows and all features' ids side by side as int64, followed by each
        feature's lengths with variable hotness (a third output would cost more). StopIteration
        once an evaluation pass is over."""
        group = self._first + list(itertools.islice(self._columns, self._group - len(self._first)))
        self._first = []
        if not group:
            raise StopIteration
        floats = np.empty((len(group), self._batch, 3 + group[0].dense.shape[1]), dtype=np.float32)
        for k, c in enumerate(group):
            floats[k, :, 0], floats[k, :, 1] = c.labels, c.valid
            floats[k, :, 2] = c.true_prob if self._has_true_prob else 0.0
            floats[k, :, 3:] = c.dense
        lengths = lambda c: [] if c.lengths is None else [np.stack(c.lengths, axis=1)]  # noqa: E731
        ids = np.stack([np.concatenate(c.ids + lengths(c), axis=1) for c in group])
        return floats, ids

    def __iter__(self) -> "DaliLoader":
        return self

    def __next__(self) -> Batch:
        if not self._ready:
            if self._pauses:
                raise RuntimeError("DaliLoader: next() inside quiesced() needs a new DALI "
                                   "iteration; take batches only after leaving it")
            self._take()  # StopIteration once an evaluation pass is over
            self._running().schedule_run()
        return self._ready.popleft()

    def _take(self) -> None:
        """The oldest scheduled iteration's batches into `_ready` (waits until it is done)."""
        pipe = self._running()
        floats, ids = (torch.from_dlpack(out.as_tensor()) for out in pipe.share_outputs())
        self._ready.extend(self._unpack(f, i) for f, i in zip(floats, ids))
        pipe.release_outputs()  # the default (dynamic) executor keeps shared buffers valid

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Inside, DALI's threads make no CUDA call: entering takes every scheduled iteration
        (each done by then) and none is scheduled until exit, which restores the prefetch.
        Batches taken on entry can be had from `next()` inside; nesting is fine."""
        taken, pipe = 0, self._pipe  # None once closed: nothing to take or restore
        self._pauses += 1
        try:
            while pipe is not None and not pipe.empty():
                self._take()
                taken += 1
            yield
        finally:
            self._pauses -= 1
            if pipe is not None:
                for _ in range(taken):
                    pipe.schedule_run()

    def _unpack(self, floats: torch.Tensor, ids: torch.Tensor) -> Batch:
        if self._variable:
            *per_feature, lengths = ids.split(self._hotness + [len(self.keys)], dim=1)
            sparse = jagged_kjt(self.keys, per_feature, list(lengths.t()))
        else:
            sparse = fixed_hotness_kjt(self.keys, list(ids.split(self._hotness, dim=1)))
        return Batch(floats[:, 3:], sparse, floats[:, 0], floats[:, 1].bool(),
                     floats[:, 2] if self._has_true_prob else None)

    def _running(self):
        if self._pipe is None:
            raise RuntimeError("DaliLoader: used after close()")
        return self._pipe

    def close(self) -> None:
        self._pipe = None
