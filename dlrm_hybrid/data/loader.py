"""The PyTorch input pipeline: this rank's slices read in a background thread, a few batches
ahead, into pinned memory when the model is on a GPU (so copies overlap compute), or made on
the GPU itself by a dataset that can (the planted synthetic data), on a stream of its own."""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from typing import ContextManager, Iterator, Optional, cast

import torch

from dlrm_hybrid.data.batch import Batch, Columns
from dlrm_hybrid.data.slices import Slice, eval_slices, train_slices

_DONE = object()


def rank_slices(dataset, split: str, global_batch: int, rank: int, world_size: int,
                shuffle: bool = False, seed: int = 0, start_step: int = 0) -> Iterator[Slice]:
    """This rank's slices (global_batch // world_size samples each) in order: endless for
    "train" (from `start_step` on: resuming reads no skipped data), one pass (padded)
    otherwise."""
    n = dataset.num_samples(split)
    slices = (train_slices(n, global_batch, rank, world_size, shuffle, seed) if split == "train"
              else eval_slices(n, global_batch, rank, world_size))
    return itertools.islice(slices, start_step, None)


def rank_columns(dataset, split: str, global_batch: int, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0, start_step: int = 0) -> Iterator[Columns]:
    """This rank's slices (`rank_slices`) as columns."""
    for piece in rank_slices(dataset, split, global_batch, rank, world_size, shuffle, seed,
                             start_step):
        yield dataset.slice_columns(split, piece)


def rank_batches(dataset, split: str, global_batch: int, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0, start_step: int = 0,
                 device: Optional[torch.device] = None) -> Iterator[Batch]:
    """This rank's slices as model inputs: made on `device` by the dataset itself (one whose
    `device_batches` is true), else on the host. A slice of several runs (a batch across an
    epoch's end) is made on the host and moved."""
    args = (dataset, split, global_batch, rank, world_size, shuffle, seed, start_step)
    if device is None:
        for columns in rank_columns(*args):
            yield Batch.from_columns(columns, dataset.spec.feature_names)
        return
    for piece in rank_slices(*args):
        if len(piece.runs) == 1:
            yield dataset.batch(split, *piece.runs[0], device)
        else:
            yield Batch.from_columns(dataset.slice_columns(split, piece),
                                     dataset.spec.feature_names).to(device)


class PrefetchLoader:
    """Iterates `batches` on a daemon thread, `depth` ahead; yields batches on `device`
    (`on_device`), or pinned on the host for a consumer that copies them on its own stream.
    With `made_on_device`, `batches` makes them on `device` itself (`rank_batches(...,
    device=)`): on a CUDA device the thread makes them on a stream of its own and waits for
    them, so they are whole when taken, whatever stream reads them; nothing is pinned or copied.

    `quiesced()` pauses that thread: pinning, and making a batch on the GPU, are CUDA calls, and a
    CUDA Graph captured in torch's "global" capture mode (train.cuda_graphs) fails when another
    thread makes one."""

    name = "torch"  # data.loader's word for it, in the run's record

    def __init__(self, batches: Iterator[Batch], device: torch.device, depth: int = 4,
                 on_device: bool = True, made_on_device: bool = False) -> None:
        self.made_on_device = made_on_device
        self.device = device if on_device or made_on_device else torch.device("cpu")
        self._pin = device.type == "cuda" and not made_on_device
        self._stream = (torch.cuda.Stream(device) if made_on_device and device.type == "cuda"
                        else None)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._state = threading.Condition()  # guards `_pauses` and `_busy`
        self._pauses = 0  # quiesced() contexts open
        self._busy = False  # the thread is reading, making or pinning a batch
        self._made: object = None  # the thread's last batch
        self._thread = threading.Thread(target=self._produce, args=(batches,), daemon=True)
        self._thread.start()

    def _produce(self, batches: Iterator[Batch]) -> None:
        try:
            while self._make(batches):
                if not self._put(self._made) or self._made is _DONE:
                    return
        except BaseException as e:  # surfaces in the consumer, with its traceback
            self._put(e)

    def _make(self, batches: Iterator[Batch]) -> bool:
        """The next batch (or _DONE), pinned or made on the device, into `_made`, only while not
        quiesced; False once closed. The batch made before is let go here too: freeing pinned
        memory is a CUDA call."""
        with self._state:
            self._state.wait_for(lambda: self._pauses == 0 or self._stop.is_set())
            if self._stop.is_set():
                return False
            self._busy = True
        try:
            with self._on_stream():
                self._made = batch = next(batches, _DONE)
                if self._stream is not None:
                    self._stream.synchronize()  # the batch is whole: any stream may read it
            if self._pin and batch is not _DONE:
                self._made = cast(Batch, batch).pin_memory()
            return True
        finally:
            with self._state:
                self._busy = False
                self._state.notify_all()

    def _on_stream(self) -> ContextManager:
        """The thread's own CUDA stream, current while it makes a batch on the device: the
        training stream's kernels do not wait behind the batch's."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Inside, the loader thread makes no CUDA call: entering waits for the batch it is
        reading and pinning (or making on the device), and it starts no other until exit
        (nesting is fine). Batches made before can still be taken; a `next()` that needs a new
        one waits until exit."""
        with self._state:
            self._pauses += 1
            self._state.wait_for(lambda: not self._busy)
        try:
            yield
        finally:
            with self._state:
                self._pauses -= 1
                self._state.notify_all()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "PrefetchLoader":
        return self

    def __next__(self) -> Batch:
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        if self._stream is not None:  # made on our stream: its memory must wait for the reader's
            item.record_stream(torch.cuda.current_stream(self.device))
            return item
        return item.to(self.device, non_blocking=True)

    def close(self) -> None:
        self._stop.set()
        with self._state:  # wakes a thread paused by quiesced()
            self._state.notify_all()
        self._thread.join(timeout=60)  # a batch in the making is finished (a torch op cut off by
        # interpreter exit aborts the process: "terminate called without an active exception")
