"""The threads a training process uses when OMP_NUM_THREADS is unset (dlrm_hybrid/threads.py),
and that an explicit setting stands."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, read_metrics
from dlrm_hybrid import threads
from dlrm_hybrid.torchrun import set_rank_threads


@pytest.mark.parametrize("cores, ranks, expected", [
    (1, 1, 1), (2, 1, 1), (16, 1, 15), (2, 2, 1), (16, 2, 7), (96, 8, 11), (4, 8, 1)])
def test_each_rank_gets_its_share_of_the_cores_less_the_loaders(cores, ranks, expected):
    assert threads.default_threads(ranks, cores) == expected


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "200000 100000\n"}, 2), ({"cpu.max": "150000 100000\n"}, 2),
    ({"cpu.max": "max 100000\n"}, None), ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None)])
def test_a_containers_cpu_limit_caps_the_cores(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert threads.cpu_quota(tmp_path) == quota
    assert 1 <= threads.usable_cores(tmp_path) <= (quota or os.cpu_count())


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_unset_threads_get_the_default_in_torch_and_the_environment(monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset, as the code reads it; restored after
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    torch.set_num_threads(2)
    assert threads.apply_thread_defaults(local_world_size=1) == 3
    assert torch.get_num_threads() == 3 and os.environ["OMP_NUM_THREADS"] == "3"


def test_an_explicit_setting_stands(monkeypatch, torch_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)
    torch.set_num_threads(2)
    assert threads.apply_thread_defaults(local_world_size=1) is None
    assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    set_rank_threads("2")
    assert os.environ["OMP_NUM_THREADS"] == "2"


def test_the_launcher_gives_each_rank_its_share(monkeypatch):
    """Set before torchrun starts the ranks (which would otherwise get 1 each, with a notice);
    a rank then keeps it as the user's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset, as the code reads it; restored after
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    set_rank_threads("2")
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_train_without_a_setting_runs_with_the_default(tmp_path):
    """A fresh `train` with OMP_NUM_THREADS unset (the README's first command) records the
    default, not torch's own (every core; on this 2-core CI host 2 where the default is 1)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    overrides = ["train.max_steps=2", "train.eval_every=0", "train.progress_bar=false",
                 "data.train_samples=4096", "data.val_samples=1024",
                 f"train.run_dir={tmp_path / 'run'}", "checkpoint.resume=none"]
    done = subprocess.run([sys.executable, "-m", "dlrm_hybrid", "train", "--config",
                           "configs/demo.yaml", *[a for o in overrides for a in ("--set", o)]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    recorded = [e["threads"] for e in read_metrics(tmp_path / "run") if "threads" in e]
    assert recorded == [threads.default_threads()]
