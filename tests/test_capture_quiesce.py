"""CUDA Graph capture with the loaders quiesced (issue 11, B6): torch captures in CUDA's "global"
mode, where a CUDA call from another thread (the loader pinning a batch, DALI's executor copying
one) breaks the capture. On CPU, fake batches record when they are read and pinned."""

import contextlib
import threading
import time

import pytest
import torch

from dlrm_hybrid.config import DataConfig
from dlrm_hybrid.data import dali_loader
from dlrm_hybrid.data.dali_loader import DaliLoader
from dlrm_hybrid.data.loader import PrefetchLoader, rank_batches, rank_columns
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.train.cuda_graphs import DenseGraph

CUDA = torch.device("cuda")  # makes the loader pin; the fake batches pin without a GPU
QUIET = 0.3  # seconds a paused producer is watched for


class _Source:
    """Endless fake batches; records how many were read and which were pinned. With `gate`,
    every pin waits for it; with `read_s`, every read takes that long (so a queue fills slowly)."""

    def __init__(self, gate: threading.Event = None, read_s: float = 0.0):
        self.gate, self.read_s = gate, read_s
        self.read, self.pinned = 0, []
        self.pinning = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(self.read_s)
        self.read += 1
        return _FakeBatch(self, self.read)


class _FakeBatch:
    def __init__(self, source: _Source, number: int):
        self.source, self.number = source, number

    def pin_memory(self):
        self.source.pinning.set()
        if self.source.gate is not None:
            self.source.gate.wait()
        self.source.pinned.append(self.number)
        return self

    def to(self, device, non_blocking=False):
        return self


def _next(loader, seconds: float = 5.0):
    """next(loader), failing the test instead of hanging it."""
    got = []
    taker = threading.Thread(target=lambda: got.append(next(loader)), daemon=True)
    taker.start()
    taker.join(seconds)
    assert got, f"no batch within {seconds} s"
    return got[0]


def test_loader_reads_and_pins_nothing_while_quiesced_even_with_queue_room_and_resumes_after():
    source = _Source()
    loader = PrefetchLoader(source, CUDA, depth=8)
    assert _next(loader).number == 1
    with loader.quiesced():
        read, pinned = source.read, list(source.pinned)
        assert read == len(pinned)  # no batch read but not yet pinned
        made = [next(loader).number for _ in range(read - 1)]  # empties the queue: room for 8
        time.sleep(QUIET)
        assert (source.read, source.pinned) == (read, pinned)
    assert made == list(range(2, read + 1))
    assert _next(loader).number == read + 1  # resumed
    loader.close()


def test_quiesced_waits_for_the_batch_being_pinned():
    gate = threading.Event()
    source = _Source(gate=gate)
    loader = PrefetchLoader(source, CUDA)
    assert source.pinning.wait(5)  # batch 1 is being pinned, held at the gate
    opener = threading.Timer(QUIET, gate.set)
    opener.start()
    with loader.quiesced():
        assert gate.is_set()  # entering waited for that pin ...
        assert source.pinned == [1] and source.read == 1  # ... to end, and no other started
    opener.join()
    loader.close()


def test_closing_a_quiesced_loader_and_quiescing_a_closed_one_return_at_once():
    source = _Source()
    loader = PrefetchLoader(source, CUDA, depth=8)
    _next(loader)
    start = time.monotonic()
    with loader.quiesced():
        for _ in range(source.read - 1):  # empties the queue: the thread waits on the pause
            next(loader)
        loader.close()
        assert not loader._thread.is_alive()  # the paused thread saw the close
    with loader.quiesced():
        pass
    assert time.monotonic() - start < 2  # close() gives up on a stuck thread after 5 s


class _Model(torch.nn.Module):
    """What DenseGraph needs of a model: the dense layers and `dense_loss`."""

    def __init__(self):
        super().__init__()
        self.dense_arch, self.interaction = torch.nn.Linear(3, 2), torch.nn.Identity()
        self.over_arch = torch.nn.Linear(2, 1)

    def dense_loss(self, dense, pooled, labels):
        return (self.over_arch(self.dense_arch(dense)) * pooled.sum()).mean()


ARGS = (torch.randn(8, 3), torch.randn(8, 4, requires_grad=True), torch.ones(8))


def test_dense_graph_captures_while_the_loader_is_quiesced():
    source = _Source(read_s=0.005)  # slower than the watch below fills a queue of 1000
    loader = PrefetchLoader(source, CUDA, depth=1000)
    _next(loader)
    seen = []

    def capture(module, static_args):
        read = source.read
        time.sleep(QUIET)
        seen.append((read, source.read, len(source.pinned)))
        return module

    model = _Model()
    graph = DenseGraph(model, torch.device("cpu"), warmup=0, capture=capture)
    graph.capture_guard = loader.quiesced
    model.dense_loss(*ARGS)
    [(read_before, read_after, pinned)] = seen
    assert read_before == read_after == pinned  # nothing read or pinned during the capture
    _next(loader)
    time.sleep(QUIET)
    assert source.read > read_after  # and the loader went on after it
    loader.close()


def test_dense_graph_leaves_the_guard_when_capture_fails():
    events = []

    @contextlib.contextmanager
    def guard():
        events.append("enter")
        yield
        events.append("exit")

    def capture(module, static_args):
        events.append("capture")
        raise RuntimeError("operation not permitted when stream is capturing")

    model = _Model()
    graph = DenseGraph(model, torch.device("cpu"), warmup=0, capture=capture)
    graph.capture_guard = guard
    with pytest.warns(UserWarning, match="capture failed"):
        model.dense_loss(*ARGS)
    model.dense_loss(*ARGS)  # eager from now on: no second capture
    assert events == ["enter", "capture", "exit"] and graph.eager_reason is not None


DATA = DataConfig(cardinalities=[300, 40, 7], hotness=[1, 3, 2], train_samples=5000,
                  val_samples=1000)


class _Counted:
    """An iterator that counts the items taken from it."""

    def __init__(self, items):
        self.items, self.taken = items, 0

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.items)
        self.taken += 1
        return item


def test_dali_loader_quiesced_takes_every_scheduled_iteration_and_schedules_none(monkeypatch):
    monkeypatch.setattr(dali_loader, "GROUP_ROWS", 1024)  # 2 batches per DALI iteration
    data = SyntheticClicks(DATA)
    args = (data, "train", 512, 0, 1, True, 3)
    columns = _Counted(rank_columns(*args))
    loader = DaliLoader(columns, data.spec.feature_names, torch.device("cpu"), depth=3)
    got = [next(loader)]
    with loader.quiesced():
        read = columns.taken  # what was scheduled before entering is all in hand, done:
        got += [next(loader) for _ in range(read - 1)]
        with pytest.raises(RuntimeError, match="inside quiesced"):
            next(loader)  # another would need a new DALI iteration
        assert columns.taken == read  # none was scheduled (its callback reads the columns)
    got += [next(loader) for _ in range(5)]  # prefetching again after exit
    assert columns.taken > read
    for a, b in zip(got, rank_batches(*args)):  # every batch once, in order
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.values(), b.sparse.values())
    with loader.quiesced():
        loader.close()
    with loader.quiesced():
        pass


def test_the_training_step_hands_its_loader_to_the_dense_graph(tmp_path, process_group):
    """What `train.cuda_graphs` relies on: each step's capture would pause the very loader the
    step reads (on CPU the graph stays eager, but the guard is set all the same)."""
    from conftest import ROOT
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import make_loader, open_dataset
    from dlrm_hybrid.train.loop import build_sharded_model
    from dlrm_hybrid.train.optim import build_optimizer
    from dlrm_hybrid.train.step import TrainStep

    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        "train.cuda_graphs=true", "data.global_batch_size=256", f"train.run_dir={tmp_path}"])
    dataset = open_dataset(cfg.data)
    dmp, _ = build_sharded_model(cfg, dataset.spec, process_group, lambda line: None)
    with pytest.warns(UserWarning, match="train.cuda_graphs: needs a CUDA device"):
        step = TrainStep(dmp, *build_optimizer(dmp, cfg.optim), cfg.train, process_group.device)
    batches = make_loader(cfg.data, dataset, "train", process_group)
    try:
        step(batches)
        assert step.graph.capture_guard == batches.quiesced
        step(iter([next(batches)]))  # a plain iterator (as `bench` passes): no guard to take
        assert step.graph.capture_guard is contextlib.nullcontext
    finally:
        batches.close()
