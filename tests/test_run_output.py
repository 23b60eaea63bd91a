"""What a training run prints and records as it goes: a line per `train.log_every` steps where no
bar is drawn, checkpoints announced as written, and metrics.jsonl records stamped with time,
throughput, both learning rates and the evaluation's seconds. One run serves most tests."""

import json
import os
import pty
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT, failure, read_metrics, run_cli, start_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.train.optim import lr_factor
from dlrm_hybrid.train.progress import figures, shows_bar

STEPS, BATCH, LOG_EVERY = 20, 128, 5
# configs/demo.yaml warms both LRs up over 20 steps, from different base LRs
SETTINGS = [f"train.max_steps={STEPS}", f"data.global_batch_size={BATCH}",
            f"train.log_every={LOG_EVERY}", "checkpoint.every=10", "data.val_samples=1024",
            "train.rank_logs=true"]
LINE = re.compile(r"step (\d+)/(\d+): loss=(\S+) samples_per_s=(\S+) lr_dense=(\S+) "
                  r"lr_embedding=(\S+) elapsed_s=(\S+)")


def train_args(run_dir, *settings):
    return ["train", "--config", "configs/demo.yaml",
            *[a for s in [*SETTINGS, *settings, f"train.run_dir={run_dir}"] for a in ("--set", s)]]


def run_raw(args):
    """The CLI writing into pipes (forked from the CLI zygote), its output as written (text
    mode would read a carriage return as a newline, hiding a bar's redraws)."""
    run = start_cli(args, raw=True)
    out, err = run.communicate(timeout=300)
    return subprocess.CompletedProcess(run.args, run.returncode, out, err)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run as a batch job starts it (stdout and stderr files, train.progress_bar left at
    auto; forked from the CLI zygote, its output as written): its output, records and the
    wall-clock time around it."""
    run_dir = tmp_path_factory.mktemp("run")
    before = time.time()
    result = run_cli(train_args(run_dir), raw=True)
    after = time.time()
    assert result.returncode == 0, failure(result)
    return {"result": result, "dir": run_dir, "records": read_metrics(run_dir),
            "before": before, "after": after}


def training_records(records):
    return [r for r in records if "loss" in r]


def test_a_batch_log_gets_one_parsable_line_per_log_every_steps(run):
    lines = [l for l in run["result"].stdout.splitlines() if l.startswith("step ")]
    parsed = [LINE.fullmatch(line) for line in lines]
    assert all(parsed), lines
    assert [(int(m[1]), int(m[2])) for m in parsed] == [(s, STEPS) for s in (5, 10, 15, 20)]
    for m, record in zip(parsed, training_records(run["records"])):
        assert float(m[3]) == round(record["loss"], 5)
        assert int(m[4]) == round(record["samples_per_s"]) and int(m[4]) > 0
        assert float(m[5]) == pytest.approx(record["lr_dense"], rel=1e-5)
        assert float(m[6]) == pytest.approx(record["lr_embedding"], rel=1e-5)
        assert float(m[7]) == round(record["elapsed_s"], 1)


def test_training_records_carry_window_throughput_and_the_scheduled_lrs(run):
    """samples/s: the window's samples over its training seconds (rank 0's own record of
    them); the LRs are those the schedule gives the next step, the embeddings' read from the
    fused optimizer (float32 there), `lr` kept as earlier versions wrote it."""
    optim = load_config(str(ROOT / "configs/demo.yaml"), SETTINGS).optim
    records = training_records(run["records"])
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    rank = [json.loads(line) for line in (run["dir"] / "rank_0.jsonl").read_text().splitlines()]
    windows = [r for r in rank if "local_loss" in r]
    seconds = [0.0] + [r["train_seconds"] for r in windows]
    for i, record in enumerate(records):
        window_s = seconds[i + 1] - seconds[i]
        assert record["samples_per_s"] == pytest.approx(LOG_EVERY * BATCH / window_s, rel=1e-9)
        factor = lr_factor(record["step"], optim)
        assert factor < 1 or record["step"] == STEPS  # still warming up: the LRs move
        assert record["lr_dense"] == record["lr"] == pytest.approx(optim.dense_lr * factor)
        assert record["lr_embedding"] == pytest.approx(optim.embedding_lr * factor, rel=1e-6)
        assert record["exchange_fwd_bytes"] == windows[i]["exchange_fwd_bytes"]
        assert record["exchange_bwd_bytes"] == windows[i]["exchange_bwd_bytes"]


def test_checkpoints_are_announced_as_they_are_written(run):
    lines = run["result"].stdout.splitlines()
    announced = [(i, line.split(": ", 1)[1]) for i, line in enumerate(lines)
                 if line.startswith("checkpoint: ")]
    assert [path.rsplit("/", 1)[1] for _, path in announced] == ["step_10", "step_20"]
    assert all(os.path.isdir(path) for _, path in announced)
    (at_10, _), (at_20, _) = announced
    assert lines[at_10 - 1].startswith("step 10/") and lines[at_10 + 1].startswith("step 15/")
    assert lines[at_20 - 1].startswith("step 20/")


def test_every_record_is_stamped_with_time_and_elapsed_seconds(run):
    records = run["records"]
    times, elapsed = [r["time"] for r in records], [r["elapsed_s"] for r in records]
    assert len(records) == 1 + 4 + 1  # the loader, the training records, the evaluation
    assert run["before"] < times[0] and times[-1] < run["after"]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert 0 < elapsed[0] and all(a < b for a, b in zip(elapsed, elapsed[1:]))
    assert elapsed[-1] < run["after"] - run["before"]


def test_the_evaluation_record_has_its_seconds(run):
    (evaluation,) = [r for r in run["records"] if "val_auc" in r]
    assert evaluation["step"] == STEPS
    assert 0 < evaluation["eval_s"] < evaluation["elapsed_s"]


def test_auto_draws_no_bar_into_a_batch_log(run):
    result = run["result"]
    assert "\r" not in result.stdout + result.stderr
    assert "train:" not in result.stderr  # tqdm's bar


def test_a_forced_bar_draws_on_a_pipe_too_with_the_figures_in_it(tmp_path):
    """train.progress_bar=true is the bar wherever the output goes (a log viewer that renders
    carriage returns); its postfix holds the window's figures, and no step lines are printed."""
    result = run_raw(train_args(tmp_path, "train.max_steps=4", "train.log_every=2",
                                "checkpoint.every=0", "train.rank_logs=false",
                                "data.val_samples=128", "train.progress_bar=true"))
    assert result.returncode == 0, failure(result)
    assert "\r" in result.stderr
    final = result.stderr.split("\r")[-1]
    assert re.search(r"train: 100%.* 4/4 .*loss=\d\.\d{5} samples_per_s=\d+ lr_dense=\S+ "
                     r"lr_embedding=\S+\]", final), final
    assert not [l for l in result.stdout.splitlines() if l.startswith("step ")]


def test_auto_means_a_bar_on_a_terminal_and_lines_elsewhere(monkeypatch):
    leader, follower = pty.openpty()
    with open(follower, "w") as terminal:
        monkeypatch.setattr(sys, "stdout", terminal)
        monkeypatch.setattr(sys, "stderr", terminal)
        assert shows_bar("auto") and shows_bar("true") and not shows_bar("false")
        with open(os.devnull, "w") as file:
            monkeypatch.setattr(sys, "stdout", file)  # stdout kept in a file, the bar on a terminal
            assert not shows_bar("auto")
    os.close(leader)


def test_progress_bar_of_an_earlier_config_yaml_still_loads(tmp_path):
    """Earlier versions wrote `progress_bar: true|false` (a YAML boolean) into config.yaml."""
    for written, read in (("true", "true"), ("false", "false"), ("auto", "auto")):
        (tmp_path / "config.yaml").write_text(f"train: {{progress_bar: {written}}}\n")
        assert load_config(str(tmp_path / "config.yaml")).train.progress_bar == read


def test_the_line_shows_the_steps_fp16_skipped():
    record = {"step": 3, "loss": 0.5, "samples_per_s": 10.0, "lr_dense": 0.1,
              "lr_embedding": 0.2, "skipped_steps": 2, "elapsed_s": 1.26}
    assert figures(record) == ("loss=0.50000 samples_per_s=10 lr_dense=0.1 lr_embedding=0.2 "
                               "skipped_steps=2 elapsed_s=1.3")
