"""`preprocess criteo` in bounded memory (counts spilled and aggregated range by range), resumed
after SIGKILL, refused for want of disk, and mapping new files with a dataset's vocabulary."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest

from dlrm_hybrid.data.criteo import budget
from dlrm_hybrid.data.criteo.preprocess import preprocess_criteo
from dlrm_hybrid.data.criteo.splits import SplitRule, split_codes
from dlrm_hybrid.data.criteo.vocabulary import Vocabulary
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 224  # small enough that this file's counts need several ranges (4 processes of ~39 MiB)


def criteo_text(rows, seed=0, unique=0.5):
    """Criteo TSV text: per categorical field, a new random value with probability `unique`,
    else one of a few hundred Zipf-like values (so counts tie and the table-size cut falls
    inside a tie)."""
    rng = np.random.default_rng(seed)
    common = (np.exp(rng.random((rows, 26)) * np.log(300)).astype(np.int64) * 2654435761
              + np.arange(26) * 7919) % 2**32
    cats = np.where(rng.random((rows, 26)) < unique, rng.integers(0, 2**32, (rows, 26)), common)
    missing = rng.random((rows, 26)) < 0.05
    ints = rng.integers(-2, 5000, (rows, 13))
    lines = []
    for r in range(rows):
        fields = [str(r % 2), *map(str, ints[r]),
                  *("" if missing[r, j] else f"{cats[r, j]:08x}" for j in range(26))]
        lines.append("\t".join(fields))
    return "\n".join(lines) + "\n"


def dataset_files(out):
    return {p.relative_to(out): p.read_bytes() for p in sorted(Path(out).rglob("*"))
            if p.is_file() and p.name != "preprocess_report.json"}


def command(inputs, output, *flags, task_bytes=None):
    """`python -m dlrm_hybrid preprocess criteo ...` (tasks of `task_bytes`, as tests shrink)."""
    main = "from dlrm_hybrid.cli import main; main(sys.argv[1:])"
    shrink = f"from dlrm_hybrid.data.criteo import tasks; tasks.TASK_BYTES = {task_bytes}; " \
        if task_bytes else ""
    return [sys.executable, "-c", f"import sys; {shrink}{main}", "preprocess", "criteo",
            "--input", *map(str, inputs), "--output", str(output), *flags]


class TreeRss:
    """Samples the RSS of a process and all its descendants (from /proc) every few ms."""

    def __init__(self, pid):
        self.pid, self.peak, self._stop = pid, 0, False
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop:
            self.peak = max(self.peak, sum(_rss(p) for p in _tree(self.pid)))
            time.sleep(0.005)

    def stop(self):
        self._stop = True
        self._thread.join()
        return self.peak


def _tree(pid):
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        kids = [int(c) for c in children.read_text().split()]
    except OSError:
        return []
    return [pid, *(p for k in kids for p in _tree(k))]


def _rss(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("logs")
    (folder / "day_0").write_text(criteo_text(60_000, seed=1))
    (folder / "day_23").write_text(criteo_text(12_000, seed=2))
    return folder


@pytest.fixture(scope="module")
def in_memory(logs):
    """The reference: the same inputs and options with all counts in memory."""
    report = preprocess_criteo([logs / "day_0", logs / "day_23"], logs / "in_memory",
                               max_table_size=2_000, workers=2)
    assert report["partitions"] == 1
    return logs / "in_memory"


def test_a_memory_limit_spills_the_counts_and_gives_the_in_memory_output(logs, in_memory):
    out = logs / "limited"
    child = subprocess.Popen(command([logs / "day_0", logs / "day_23"], out,
                                     "--max-table-size", "2000", "--workers", "2",
                                     "--memory-limit", f"{LIMIT_MIB}M"),
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeRss(child.pid)
    output = child.communicate(timeout=300)[0]
    peak = sampler.stop()
    assert child.returncode == 0, output
    assert output.startswith(f"memory limit {LIMIT_MIB / 1024:.2f} GiB (--memory-limit)")
    report = json.loads((out / "preprocess_report.json").read_text())
    assert report["partitions"] >= 3 and report["spill_bytes"] > 0
    assert dataset_files(out) == dataset_files(in_memory)
    assert peak < LIMIT_MIB * 2**20  # the whole tree, sampled from outside
    assert report["peak_rss_bytes"] < LIMIT_MIB * 2**20  # its own bound: each process's peak
    assert report["peak_rss_bytes"] >= peak * 0.9


@pytest.mark.parametrize("step", ["count", "write"])
def test_a_run_killed_mid_pass_continues_with_the_same_command_to_the_same_bytes(
        logs, in_memory, tmp_path, step):
    out = tmp_path / "out"
    args = command([logs / "day_0", logs / "day_23"], out, "--max-table-size", "2000",
                   "--workers", "2", task_bytes=200_000)
    child = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    done = tmp_path / ".out.preprocess" / "done"
    deadline = time.monotonic() + 120
    while len(list(done.glob(f"{step}.*.json"))) < 3 and child.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.002)
    os.killpg(child.pid, signal.SIGKILL)  # the parent and its workers, as a lost node
    child.wait()
    finished = len(list(done.glob(f"{step}.*.json")))
    assert 3 <= finished < 87 and not out.exists()  # 86 tasks of 200 kB: killed part way
    again = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "continuing the partial work" in again.stdout
    assert json.loads((out / "preprocess_report.json").read_text())["resumed_steps"] >= finished
    assert dataset_files(out) == dataset_files(in_memory)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_partial_work_of_other_settings_is_refused_unless_restarted(logs, tmp_path, monkeypatch):
    def fail(*args):
        raise KeyboardInterrupt

    from dlrm_hybrid.data.criteo.preprocess_job import Job
    monkeypatch.setattr(Job, "write", fail)
    with pytest.raises(KeyboardInterrupt):
        preprocess_criteo([logs / "day_23"], tmp_path / "out", workers=1, split="hash")
    monkeypatch.undo()
    with pytest.raises(DataError, match=r"^.*\.out\.preprocess: holds the partial work of a run "
                                        r"with --frequency-threshold 0 \(now 3\); run that same "
                                        r"command to finish it, or add --restart to discard it$"):
        preprocess_criteo([logs / "day_23"], tmp_path / "out", frequency_threshold=3,
                          workers=1, split="hash")
    report = preprocess_criteo([logs / "day_23"], tmp_path / "out", frequency_threshold=3,
                               workers=1, split="hash", restart=True)
    assert report["resumed_steps"] == 0 and report["frequency_threshold"] == 3


def test_too_little_disk_for_the_spill_is_a_one_line_error_leaving_nothing(logs, tmp_path,
                                                                          monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 10**6))
    with pytest.raises(DataError, match=r"^\S+\.out\.preprocess: the spilled counts and the "
                                        r"dataset need about [\d.]+ GiB of disk, 0\.00 GiB are "
                                        r"free; free space there or put --output on a larger "
                                        r"disk") as error:
        preprocess_criteo([logs / "day_0", logs / "day_23"], tmp_path / "out", workers=1)
    assert "\n" not in str(error.value) and not list(tmp_path.iterdir())


def test_a_resumed_run_refused_for_want_of_disk_keeps_the_work_it_says_it_keeps(
        logs, tmp_path, monkeypatch):
    """A run stopped after counting, then run again on a disk that has filled up meanwhile: the
    refusal says the work done is kept, and it once was deleted."""
    from dlrm_hybrid.data.criteo.preprocess_job import Job

    def stop(*args):
        raise KeyboardInterrupt

    inputs = [logs / "day_23"]
    monkeypatch.setattr(Job, "write", stop)
    with pytest.raises(KeyboardInterrupt):
        preprocess_criteo(inputs, tmp_path / "out", workers=1, split="hash")
    monkeypatch.undo()
    counted = sorted(p.name for p in (tmp_path / ".out.preprocess" / "done").iterdir())
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda path: usage(10**9, 10**9, 0))
    with pytest.raises(DataError, match=r"GiB of disk, 0\.00 GiB are free; .*\(work done so far "
                                        r"is kept\)$"):
        preprocess_criteo(inputs, tmp_path / "out", workers=1, split="hash")
    assert sorted(p.name for p in (tmp_path / ".out.preprocess" / "done").iterdir()) == counted
    monkeypatch.undo()
    report = preprocess_criteo(inputs, tmp_path / "out", workers=1, split="hash")
    assert report["resumed_steps"] == len(counted)


def test_vocabulary_maps_new_files_with_the_datasets_ids(logs, in_memory, tmp_path):
    """The same files mapped with the dataset's vocabulary give its very files; a new day's known
    values get the ids the dataset gave them, its unseen values id 0."""
    same = tmp_path / "same"
    preprocess_criteo([logs / "day_0", logs / "day_23"], same, workers=2,
                      vocabulary=str(in_memory))
    assert dataset_files(same) == dataset_files(in_memory)
    (tmp_path / "new.txt").write_text(criteo_text(3_000, seed=9))
    preprocess_criteo([tmp_path / "new.txt"], tmp_path / "new", workers=1,
                      vocabulary=str(in_memory), split="hash")
    vocabulary = Vocabulary.load(str(in_memory))
    fspec = load_feature_spec(str(tmp_path / "new"))
    assert fspec.spec.cardinalities == vocabulary.cardinalities
    raw = np.array([[int(v, 16) if v else -1 for v in line.split("\t")[14:]]
                    for line in (tmp_path / "new.txt").read_text().splitlines()])
    expected = vocabulary.map(raw)
    codes = split_codes(SplitRule("hash", 0), np.arange(len(raw)))
    for s, split in enumerate(("train", "validation", "test")):
        for f in range(26):
            got = np.fromfile(fspec.splits[split].categorical[f], fspec.categorical_dtypes[f])
            np.testing.assert_array_equal(got, expected[codes == s, f])
    assert (expected == 0).any() and (expected > 0).any()


def test_the_memory_plan_counts_the_parent_the_fork_server_and_each_worker(monkeypatch):
    """Each process costs `base` before any data; 2 workers make 4 processes with the parent and
    the fork server the workers are forked from."""
    monkeypatch.setattr(budget, "own_rss", lambda: 40 * 2**20)
    per_worker = budget.MIN_CHUNK_BYTES * 6 + budget.MIN_ENTRIES * budget.RANGE_BYTES_PER_ENTRY
    need = (4 * 40 * 2**20 + 2 * per_worker) / budget.HEADROOM
    with pytest.raises(ConfigError, match=rf"below the {need / 2**20:,.0f} MiB that 2 workers "
                                          rf"need at least \(40 MiB per process before data\)"):
        budget.plan_memory(20 * 2**20, 2, 8, 6, 1 << 20)


def test_memory_limits_are_read_as_sizes_and_one_too_small_is_a_one_line_error(logs, tmp_path):
    assert [budget.parse_size(t) for t in ("512M", "1.5GiB", "8 GB", "4096")] == \
        [512 * 2**20, 3 * 2**29, 8 * 2**30, 4096]
    with pytest.raises(ConfigError, match=r"^--memory-limit: 'lots' is not a size; write e\.g\."):
        budget.parse_size("lots")
    with pytest.raises(ConfigError, match=r"^--memory-limit: 20 MiB is below the [\d,]+ MiB that "
                                          r"2 workers need at least .*; raise it or use fewer "
                                          r"--workers$"):
        preprocess_criteo([logs / "day_23"], tmp_path / "out", workers=2, split="hash",
                          memory_limit=20 * 2**20)
    with pytest.raises(ConfigError, match=r"^--memory-limit: 0 MiB is below"):  # not the default
        preprocess_criteo([logs / "day_23"], tmp_path / "out", workers=1, split="hash",
                          memory_limit=0)
    assert not list(tmp_path.iterdir())
