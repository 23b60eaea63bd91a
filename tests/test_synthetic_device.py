"""The planted synthetic data made with torch on any device (issue 40): the values it always had
(numpy's, recorded before the change), on the host and on a GPU, and made where it is asked to be.
The meta device stands in for a GPU where there is none: it runs the same code without data."""

import hashlib
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dlrm_hybrid.config import DataConfig
from dlrm_hybrid.data import synthetic
from dlrm_hybrid.data.loader import PrefetchLoader, rank_batches
from dlrm_hybrid.data.source import makes_on_device, make_loader
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.synth_dataset import write_synthetic
from dlrm_hybrid.data.synthetic import SyntheticClicks

GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=GPU)]
FAKE_OR_GPU = [pytest.param("meta"), pytest.param("cuda", marks=GPU)]
FL15 = [7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469, 245828, 11, 2209,
        10667, 104, 4, 968, 15, 8165896, 2675940, 7156453, 302516, 12022, 97, 35]
BASE = dict(cardinalities=[1000, 50, 7], hotness=[1, 4, 2], train_samples=4096, val_samples=1000,
            teacher_scale=1.5)
UNIFORM = {**BASE, "hotness": [10, 1, 3], "hotness_distribution": "uniform"}
# name: (config, tasks, (split, first, count))
CASES = {
    "fixed": (BASE, (), ("val", 10, 256)),
    "uniform": (UNIFORM, (), ("train", 300, 256)),
    "scattered_order3": ({**BASE, "id_order": "scattered", "teacher_order": 3}, (), ("train", 0, 256)),
    "tasks_missing": ({**BASE, "label_missing": 0.3, "task_correlation": 0.3},
                      ("click", "like", "share"), ("val", 5, 256)),
    "tasks_uniform": ({**BASE, "hotness": [3, 2, 1], "hotness_distribution": "uniform",
                       "label_missing": 0.5}, ("click", "like"), ("test", 0, 128)),
    "hot100_exp05": (dict(cardinalities=[1_000_000, 40_000_000], hotness=[100, 3], zipf_exponent=0.5,
                          train_samples=4096, val_samples=64), (), ("train", 64, 64)),
    "exp1": ({**BASE, "zipf_exponent": 1.0, "seed": 99}, (), ("train", 0, 256)),
    "fl15_far": (dict(cardinalities=FL15, hotness=[1], train_samples=4195197692,
                      val_samples=89137319, teacher_scale=1.5), (), ("train", 4195197692 - 1000, 1024)),
}
# sha256 (first 16 hex digits) of each column as numpy's code made it before issue 40: dense,
# labels, valid, ids (the digest of the tables' digests), true_prob, lengths (likewise)
RECORDED = {
    "fixed": ("e3190f675ac413da", "57153ae1fc74e814", "2661920f2409dd6c", "1bb1134ccbc06e01",
              "a43962a538d3f395", None),
    "uniform": ("c4ed620d1d486307", "ce56884b66ad51ef", "2661920f2409dd6c", "624e571f3282bb18",
                "0a1b8878f4ae7e1e", "82fa477eb4b53a84"),
    "scattered_order3": ("f2e47eed343403cf", "2c9b0ede442a57c6", "2661920f2409dd6c",
                         "f83cf4a81cd11aaa", "8ef84f14e0eaedf0", None),
    "tasks_missing": ("0ebfadceb6e2795a", "623bf2a9da2b11a1", "2661920f2409dd6c",
                      "f14ba3e38b3e4275", "feceae755dc4d0b8", None),
    "tasks_uniform": ("5507facd4db53c7a", "3fb9f1973c9aef2f", "7eb24a18990ee4c9",
                      "3c3d56747b48e2f9", "6e3da654ffe5d07e", "a16b0e1eede88a30"),
    "hot100_exp05": ("78f994b8e72e1599", "011a4dc8c2a43cc4", "7c8975e1e60a5c83",
                     "5e63d99ff7da9851", "bffefea27793f1f7", None),
    "exp1": ("6ef4bc462f7383f9", "14e3c7283891f9b3", "2661920f2409dd6c", "5a81fa4de755b58a",
             "233173f5566607c6", None),
    "fl15_far": ("25c460d49ecb1909", "a14b10094789326f", "4f6cca125df291f3", "a1eb044447b8732b",
                 "150164789f9ef83d", None),
}


def dataset(name: str) -> SyntheticClicks:
    cfg, tasks, _ = CASES[name]
    data = SyntheticClicks(DataConfig(**cfg), tasks)
    data.use_tasks(list(tasks), "the planted synthetic data")
    return data


def digest(a) -> str:
    a = a.cpu().numpy() if isinstance(a, torch.Tensor) else a
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def digests(c) -> tuple:
    tables = lambda arrays: None if arrays is None else hashlib.sha256(  # noqa: E731
        "".join(digest(a) for a in arrays).encode()).hexdigest()[:16]
    return (digest(c.dense), digest(c.labels), digest(c.valid), tables(c.ids),
            digest(c.true_prob), tables(c.lengths))


# The counter-based draws as numpy made them before issue 40 (dlrm_hybrid/data/synthetic.py).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def np_splitmix64(x):
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def np_counter_uniform(seed, stream, index):
    key = np_splitmix64(np.array([(seed << 20) ^ stream], dtype=np.uint64))
    bits = np_splitmix64(index.astype(np.uint64) ^ key)
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def np_zipf_ids(u, rows, exponent):
    if abs(exponent - 1.0) < 1e-9:
        x = np.power(rows + 1.0, u)
    else:
        a = 1.0 - exponent
        x = np.power(1.0 + u * (np.power(rows + 1.0, a) - 1.0), 1.0 / a)
    return np.minimum(x.astype(np.int64) - 1, rows - 1)


@pytest.mark.parametrize("device", DEVICES)
def test_hash_and_uniforms_equal_numpy_bit_for_bit(device):
    """splitmix64 in int64 (wrapping * and +, a masked shift for uint64's logical one) is
    uint64's, for any 64 bits, and so are the uniforms and their keys."""
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**64, 200_000, dtype=np.uint64, endpoint=False)
    bits[:4] = [0, 2**63, 2**64 - 1, 2**63 - 1]
    as_torch = torch.from_numpy(bits.view(np.int64)).to(device)
    assert np.array_equal(synthetic.splitmix64(as_torch).cpu().numpy().view(np.uint64),
                          np_splitmix64(bits))
    index = rng.integers(0, 2**50, 200_000, dtype=np.uint64)
    for seed, stream in ((1234, 0), (0, 3 + 16 * 25 + 4096 * 3), (2**30, 4)):
        got = synthetic.counter_uniform(seed, stream, torch.from_numpy(index.view(np.int64)).to(device))
        assert np.array_equal(got.cpu().numpy(), np_counter_uniform(seed, stream, index))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exponent", [1.1, 1.0, 0.5, 1.05])
def test_zipf_ids_equal_numpy(device, exponent):
    """The inverse CDF's pow may round 1 ulp apart from numpy's (its SIMD pow, torch's, CUDA's):
    an id would move only where the power lands within that of an integer; none does here."""
    u = np_counter_uniform(7, 2, np.arange(300_000, dtype=np.uint64))
    rows = np.array(FL15[:6] * 50_000, dtype=np.int64)  # one table per column, 6 columns
    rows_t = torch.from_numpy(rows.reshape(-1, 6)[0]).to(device)
    scale = torch.from_numpy(synthetic.zipf_scale(rows[:6], exponent)).to(device)
    got = synthetic.zipf_ids(torch.from_numpy(u).to(device).reshape(-1, 6), rows_t, scale, exponent)
    want = np.stack([np_zipf_ids(u.reshape(-1, 6)[:, c], int(rows[c]), exponent) for c in range(6)], 1)
    assert np.array_equal(got.cpu().numpy(), want)


@pytest.mark.parametrize("name", list(CASES))
def test_columns_are_the_ones_numpy_made(name):
    """Every column of every kind of planted data (multi-hot, uniform hotness, scattered ids,
    order 3, tasks with missing labels, hotness 100, exponent 1, FL15's tables at the end of its
    4.2 billion samples), bit for bit as recorded from the numpy code before issue 40."""
    _, _, (split, first, count) = CASES[name]
    assert digests(dataset(name).columns(split, first, count)) == RECORDED[name]


@pytest.mark.parametrize("name", ["uniform", "tasks_uniform", "hot100_exp05"])
def test_blocks_of_samples_do_not_change_the_values(name, monkeypatch):
    """The host makes a batch in blocks of samples (BLOCK_ELEMENTS), a GPU in one: each
    sample's values are its own, whatever block it is made in."""
    _, _, (split, first, count) = CASES[name]
    whole = digests(dataset(name).columns(split, first, count))
    monkeypatch.setitem(synthetic.BLOCK_ELEMENTS, "cpu", 1)  # one sample a block
    assert digests(dataset(name).columns(split, first, count)) == whole


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_columns_are_the_host_ones(name):
    """On CUDA: ids, lengths, valid and labels bit for bit; dense and the true probabilities
    (float64 ndtri, bmm and sums, rounded to float32) within one float32 ulp of the host's."""
    data = dataset(name)
    _, _, (split, first, count) = CASES[name]
    host, gpu = data.tensor_columns(split, first, count, torch.device("cpu")), \
        data.tensor_columns(split, first, count, torch.device("cuda"))
    for a, b in zip(host.ids + (host.lengths or []), gpu.ids + (gpu.lengths or [])):
        assert torch.equal(a, b.cpu())
    assert torch.equal(host.valid, gpu.valid.cpu())
    assert torch.equal(host.labels.nan_to_num(-1), gpu.labels.cpu().nan_to_num(-1))
    for a, b in ((host.dense, gpu.dense.cpu()), (host.true_prob, gpu.true_prob.cpu())):
        ulp = torch.nextafter(a, torch.full_like(a, np.inf)) - a
        assert ((a - b).abs() <= ulp).all(), f"{((a - b).abs() > 0).sum()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["fixed", "tasks_missing", "fl15_far"])
def test_making_a_batch_on_the_gpu_never_waits_for_it(name):
    """No device-to-host sync inside (an .item(), a boolean-mask assignment): the loader's
    thread queues a whole batch and waits once, at its end. (Uniform hotness has one: its
    jagged KJT's masked_select.)"""
    data = dataset(name)
    _, _, (split, first, count) = CASES[name]
    data.batch(split, first, count, torch.device("cuda"))  # constants, library handles
    torch.cuda.set_sync_debug_mode("error")
    try:
        data.batch(split, first, count, torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)


class _DeviceLog(TorchDispatchMode):
    """Every tensor each op takes or returns: (op, device, elements)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device.type, t.numel()))
        return out


@pytest.mark.parametrize("device", FAKE_OR_GPU)
@pytest.mark.parametrize("name", ["fixed", "uniform", "tasks_missing", "fl15_far"])
def test_a_batch_asked_for_on_a_device_is_made_there(device, name):
    """No op along the way touches a host tensor of a batch's size: the columns are not made on
    the host and copied (a silent fallback), and the heavy draws run on the device."""
    data = dataset(name)
    _, _, (split, first, count) = CASES[name]
    data.tensor_columns(split, first, 1, torch.device(device))  # per-device constants, once
    with _DeviceLog() as log:
        columns = data.tensor_columns(split, first, count, torch.device(device))
        if name != "uniform":  # a jagged KJT needs values (masked_select): not on meta
            data.batch(split, first, count, torch.device(device))
    on_host = [(op, n) for op, where, n in log.seen if where == "cpu" and n >= count]
    assert not on_host, f"host tensors of a batch's size: {on_host[:5]}"
    latents = count * sum(data.spec.hotness) * data.teacher_dim
    assert max(n for op, where, n in log.seen if where == device) >= latents
    assert all(t.device.type == device for t in [columns.dense, columns.labels, *columns.ids])


def test_the_loader_makes_synthetic_batches_on_a_gpu_only():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert makes_on_device(dataset("fixed"), cuda)
    assert not makes_on_device(dataset("fixed"), cpu)
    assert not SplitBinaryDataset.device_batches


def test_device_batches_are_neither_pinned_nor_copied():
    """made_on_device: the loader yields what the batches iterator made on the device (here
    meta, which cannot be pinned or copied to the host), not a host copy."""
    data = dataset("fixed")
    meta = torch.device("meta")
    for on_device in (True, False):
        loader = PrefetchLoader(rank_batches(data, "train", 512, 1, 2, device=meta), meta, 2,
                                on_device=on_device, made_on_device=True)
        batch = next(loader)
        loader.close()
        assert batch.dense.device == meta and batch.sparse.values().device == meta
        assert batch.dense.shape == (256, 13)


class _SlowSource:
    """Batches that take `make_s` each to make (as a GPU's would, on the loader's thread)."""

    def __init__(self, make_s: float):
        self.make_s, self.started, self.finished = make_s, 0, 0

    def __iter__(self):
        return self

    def __next__(self):
        self.started += 1
        time.sleep(self.make_s)
        self.finished += 1
        return dataset("fixed").batch("train", 0, 8, torch.device("meta"))


def test_quiesced_waits_for_the_batch_being_made_on_the_device_and_makes_no_other():
    """The CUDA Graph capture contract holds for batches made on the device: entering waits for
    the batch in the making, and none is started until exit."""
    source = _SlowSource(0.2)
    loader = PrefetchLoader(source, torch.device("meta"), depth=8, made_on_device=True)
    while source.started == 0:
        time.sleep(0.01)
    with loader.quiesced():
        assert source.started == source.finished  # none is being made
        started = source.started
        time.sleep(0.5)
        assert source.started == started
    deadline = time.monotonic() + 5
    while source.started == started and time.monotonic() < deadline:
        time.sleep(0.01)
    resumed = source.started > started
    got = []
    taker = threading.Thread(target=lambda: got.append(next(loader)), daemon=True)
    taker.start()
    taker.join(5)
    loader.close()
    assert resumed and got


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_loader_batches_are_the_host_ones_and_survive_graph_capture():
    """make_loader on a GPU: batches made there (also for a consumer that copies, on_device
    False), equal to the host's; CUDA Graphs captured inside quiesced() while it runs."""
    from types import SimpleNamespace

    cfg = DataConfig(**{**CASES["fl15_far"][0], "global_batch_size": 8192, "prefetch": 2})
    data = SyntheticClicks(cfg)
    env = SimpleNamespace(rank=0, world_size=1, device=torch.device("cuda", torch.cuda.current_device()))
    loader = make_loader(cfg, data, "train", env, on_device=False)
    x = torch.ones(1024, device=env.device)
    for step, host in zip(range(6), rank_batches(data, "train", 8192, 0, 1)):
        batch = next(loader)
        assert batch.dense.is_cuda and batch.sparse.values().is_cuda
        assert torch.equal(batch.sparse.values().cpu(), host.sparse.values())
        assert torch.equal(batch.labels.cpu(), host.labels)
        with loader.quiesced():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = x * 2 + batch.dense.shape[0]
            graph.replay()
        assert y[0].item() == 8194
    loader.close()


# sha256 (16 hex digits) of every file `synth --output` wrote before issue 40
SYNTH_FILES = {
    "feature_spec.yaml": "5e24c0854eafe70b", "test/cat_0.bin": "3489ba9fbb602610",
    "test/cat_1.bin": "dd8f9932b8d1fe20", "test/cat_2.bin": "7d5b3bfa0e6603a3",
    "test/label.bin": "46dbda07f75a4f58", "test/numerical.bin": "972b6ab173b53f37",
    "test/true_prob.bin": "d888b77991c2385a", "train/cat_0.bin": "44156b426cfb83c2",
    "train/cat_1.bin": "f52d116728a82f2b", "train/cat_2.bin": "42be379b728c20f5",
    "train/label.bin": "6c32442f63209308", "train/numerical.bin": "14f35da372ad0327",
    "train/true_prob.bin": "ff4891e30715c6bc", "validation/cat_0.bin": "aac2e734279cb961",
    "validation/cat_1.bin": "24daf82acaa4b624", "validation/cat_2.bin": "61445e1be163a040",
    "validation/label.bin": "128a892e3ed255fb", "validation/numerical.bin": "4ff0c3d5fcf8f686",
    "validation/true_prob.bin": "7ad7c1e0d1092c53"}


def test_synth_output_writes_the_files_it_always_wrote(tmp_path):
    cfg = DataConfig(cardinalities=[300, 40, 70000], hotness=[1, 3, 2], train_samples=70000,
                     val_samples=1000, teacher_scale=1.5)  # train: more than one 65536 chunk
    write_synthetic(cfg, str(tmp_path))
    written = {str(p.relative_to(tmp_path)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
               for p in sorted(Path(tmp_path).rglob("*")) if p.is_file()}
    assert written == SYNTH_FILES
