"""Curves a user can look at: TensorBoard event files written by training (read back with
TensorBoard's own reader) and `dlrm-hybrid plot` (images read back with matplotlib)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import failure, read_metrics, run_cli

TRAIN = ["train", "--config", "configs/demo.yaml", "--set", "data.global_batch_size=64",
         "--set", "data.val_samples=2048", "--set", "train.log_every=5",
         "--set", "train.eval_every=10", "--set", "train.progress_bar=false",
         "--set", "checkpoint.every=10"]
C0, C1 = (0.122, 0.467, 0.706), (1.0, 0.498, 0.055)  # matplotlib's first two line colours
HEIGHT, WIDTH = 800, 1200


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A fresh 20-step run, and a copy of it resumed from its step 10 checkpoint to step 25
    (steps 11-20 trained again)."""
    root = tmp_path_factory.mktemp("curves")
    fresh, resumed = root / "fresh", root / "resumed"
    result = run_cli([*TRAIN, "--set", f"train.run_dir={fresh}", "--set", "train.max_steps=20"])
    assert result.returncode == 0, failure(result)
    shutil.copytree(fresh, resumed)
    again = run_cli([*TRAIN, "--set", f"train.run_dir={resumed}", "--set", "train.max_steps=25",
                     "--set", f"checkpoint.resume={resumed / 'checkpoints' / 'step_10'}"])
    assert again.returncode == 0, failure(again)
    return {"fresh": fresh, "resumed": resumed, "stdout": result.stdout}


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0,
                                                                           "tensors": 0})
    events.Reload()
    return events


def _expected_scalars(run_dir: Path) -> dict:
    """{tag: [(step, value, time)]}: each numeric field of metrics.jsonl's training records
    (those with a loss) under train/, of its evaluations under eval/."""
    expected = {}
    for record in read_metrics(run_dir):
        group = "eval" if "val_auc" in record else "train" if "loss" in record else None
        if group is None:
            continue
        for key, value in record.items():
            if key not in ("step", "time") and type(value) in (int, float):
                expected.setdefault(f"{group}/{key}", []).append(
                    (record["step"], float(np.float32(value)), record["time"]))
    return expected


def _assert_mirrors_metrics(run_dir: Path) -> None:
    events = _events(run_dir)
    expected = _expected_scalars(run_dir)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        assert [(e.step, e.value, e.wall_time) for e in events.Scalars(tag)] == points, tag


def test_tensorboard_mirrors_metrics_jsonl(runs):
    """By default (tensorboard installed) the run writes event files whose scalars are
    metrics.jsonl's fields: same tags, steps, values (float32) and wall times."""
    fresh = runs["fresh"]
    tags = _events(fresh).Tags()["scalars"]
    assert {"train/loss", "train/samples_per_s", "train/lr_dense", "train/lr_embedding",
            "train/exchange_fwd_bytes", "eval/val_auc", "eval/val_logloss", "eval/eval_s"
            } <= set(tags)
    assert [e.step for e in _events(fresh).Scalars("train/loss")] == [5, 10, 15, 20]
    assert [e.step for e in _events(fresh).Scalars("eval/val_auc")] == [10, 20]
    _assert_mirrors_metrics(fresh)


def test_tensorboard_placement_text_is_the_printed_plan(runs):
    lines = runs["stdout"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("plan ("))
    end = next(i for i, line in enumerate(lines) if line.startswith("imbalance"))
    (text,) = _events(runs["fresh"]).Tensors("placement/text_summary")
    placement = text.tensor_proto.string_val[0].decode()
    for line in lines[start:end + 1]:
        assert line in placement


def test_resumed_run_has_one_tensorboard_value_per_step(runs):
    """Steps 11-20 were trained twice: TensorBoard shows only the resumed attempt's values,
    as metrics.jsonl does after the resume."""
    resumed = runs["resumed"]
    assert [e.step for e in _events(resumed).Scalars("train/loss")] == [5, 10, 15, 20, 25]
    _assert_mirrors_metrics(resumed)
    records = read_metrics(resumed)
    (mark,) = [i for i, record in enumerate(records) if record.get("resumed")]
    assert records[mark]["elapsed_s"] == records[mark - 1]["elapsed_s"]
    for later in records[mark + 1:]:  # the resumed run's clock goes on from step 10's
        since_resume = later["time"] - records[mark]["time"]
        assert later["elapsed_s"] >= records[mark]["elapsed_s"] + since_resume


def test_a_fresh_run_sets_the_earlier_runs_events_aside(runs, tmp_path):
    """A fresh run into a folder holding an earlier run moves that run's events (and its
    curves) aside with its metrics.jsonl: each folder's TensorBoard shows one run."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["fresh"], run_dir)
    (run_dir / "curves.png").write_bytes(b"earlier")
    result = run_cli([*TRAIN, "--set", f"train.run_dir={run_dir}", "--set", "train.max_steps=2",
                      "--set", "data.val_samples=256", "--set", "checkpoint.resume=none"])
    assert result.returncode == 0, failure(result)
    (aside,) = run_dir.glob("earlier_run_*")
    assert [e.step for e in _events(aside).Scalars("train/loss")] == [5, 10, 15, 20]
    assert (aside / "curves.png").read_bytes() == b"earlier"
    assert [e.step for e in _events(run_dir).Scalars("train/loss")] == [2]
    assert not (run_dir / "curves.png").exists()


def test_tensorboard_false_writes_no_events(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli([*TRAIN, "--set", f"train.run_dir={run_dir}", "--set", "train.max_steps=2",
                      "--set", "data.val_samples=256", "--set", "train.tensorboard=false"])
    assert result.returncode == 0, failure(result)
    assert (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "tensorboard").exists()


def test_tensorboard_true_without_the_package_is_one_line(tmp_path):
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named tensorboard')\n")
    run_dir = tmp_path / "run"
    result = run_cli([*TRAIN, "--set", f"train.run_dir={run_dir}", "--set", "train.max_steps=2",
                      "--set", "train.tensorboard=true"],
                     extra_env={"PYTHONPATH": str(shadow.parent)})
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [
        "error: train.tensorboard: true, but the tensorboard package is not installed; install "
        "it (.venv/bin/pip install tensorboard) or set train.tensorboard=auto or false"]
    assert not run_dir.exists()


def test_tensorboard_auto_without_the_package_is_off(monkeypatch):
    from dlrm_hybrid.train.tensorboard_log import check_tensorboard

    assert check_tensorboard("auto")
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard: ImportError
    assert not check_tensorboard("auto")


# --- dlrm-hybrid plot, on metrics.jsonl files written here -------------------------------

def _fabricate(run_dir: Path, timed: bool = True, scale: float = 1.0) -> Path:
    """A run's metrics.jsonl: a start record, losses every 5 steps, evaluations every 20."""
    run_dir.mkdir(parents=True)
    records = [{"step": 0, "loader": "torch", "step_driver": "plain"}]
    for step in range(5, 105, 5):
        records.append({"step": step, "loss": scale * (0.45 + 0.3 / step), "lr_dense": 0.1})
        if step % 20 == 0:
            records.append({"step": step, "val_auc": 0.7 + scale * step / 1000,
                            "val_logloss": 0.46})
    if timed:
        for record in records:
            record.update(time=1.7e9 + 2 * record["step"], elapsed_s=2.0 * record["step"])
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _read_png(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def _colour_pixels(image: np.ndarray, colour) -> np.ndarray:
    """[[top left, top right], [bottom left, bottom right]]: pixels of `colour` in each panel
    (loss / AUC against steps / time)."""
    near = (np.abs(image[:, :, :3] - np.array(colour)) < 0.05).all(axis=2)
    h, w = image.shape[0] // 2, image.shape[1] // 2
    return np.array([[near[:h, :w].sum(), near[:h, w:].sum()],
                     [near[h:, :w].sum(), near[h:, w:].sum()]])


@pytest.fixture(scope="module")
def plotted(tmp_path_factory):
    """One run plotted with the defaults: (its folder, what plot said)."""
    run_dir = _fabricate(tmp_path_factory.mktemp("plotted") / "run")
    return run_dir, run_cli(["plot", str(run_dir)])


def test_plot_one_run_default_out(plotted):
    run_dir, result = plotted
    assert result.returncode == 0, failure(result)
    assert result.stdout.strip() == f"plot: wrote {run_dir / 'curves.png'} (1 run)"
    image = _read_png(run_dir / "curves.png")
    assert image.shape[:2] == (HEIGHT, WIDTH)
    assert image[:, :, :3].std() > 0.05
    assert (_colour_pixels(image, C0) > 300).all()  # a curve in each of the four panels
    assert not list(run_dir.glob("*.partial*"))


def test_plot_overlays_several_runs_into_the_current_folder(tmp_path):
    """Several runs: one image, each run's curves in every panel, written where the command
    runs (by default; no run's folder is preferred)."""
    a, b = _fabricate(tmp_path / "a"), _fabricate(tmp_path / "b", scale=1.2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "dlrm_hybrid", "plot", "a", "b"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    image = _read_png(tmp_path / "curves.png")
    assert image.shape[:2] == (HEIGHT, WIDTH)
    assert (_colour_pixels(image, C0) > 300).all() and (_colour_pixels(image, C1) > 300).all()
    assert not (a / "curves.png").exists() and not (b / "curves.png").exists()


def test_plot_older_run_without_time_plots_against_steps(tmp_path):
    run_dir = _fabricate(tmp_path / "old", timed=False)
    out = tmp_path / "old.png"
    result = run_cli(["plot", str(run_dir), "--out", str(out)])
    assert result.returncode == 0, failure(result)
    assert "no time panel for old" in result.stderr
    pixels = _colour_pixels(_read_png(out), C0)
    assert (pixels[:, 0] > 300).all() and (pixels[:, 1] == 0).all()


def test_plot_of_a_two_tower_run_draws_its_recall(tmp_path):
    """A two-tower run's evaluations hold recall/HR/NDCG@K (and the planted ceiling's), no AUC:
    the lower panels draw each K's recall@K (not the ceiling's), not "no evaluation yet"."""
    from dlrm_hybrid.curves import read_run

    run_dir = tmp_path / "two_tower"
    run_dir.mkdir()
    records = [{"step": 0, "loader": "torch", "time": 1.7e9, "elapsed_s": 0.5}]
    for step in (10, 20):
        records.append({"step": step, "loss": 6.0 - step / 10, "time": 1.7e9 + step,
                         "elapsed_s": float(step)})
        records.append({"step": step, **{f"val_{m}@{k}": step / 100 + k / 200
                                         for k in (10, 50) for m in ("recall", "hr", "ndcg")},
                        "val_mrr": 0.06, "val_ceiling_recall@10": 0.33, "users": 2000,
                        "eval_s": 0.08, "time": 1.7e9 + step + 1, "elapsed_s": step + 1.0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = run_cli(["plot", str(run_dir)])
    assert result.returncode == 0, failure(result)
    assert (_colour_pixels(_read_png(run_dir / "curves.png"), C0) > 100).all()
    assert dict(read_run(str(run_dir), "two_tower").eval_curves()) == {
        f" recall@{k}": [(step, step + 1.0, step / 100 + k / 200) for step in (10, 20)]
        for k in (10, 50)}


def test_plot_skips_a_cut_last_line_and_the_resume_marker(tmp_path, plotted):
    """A killed run's cut last line and a resume's `resumed` record (its superseded events
    inside) leave the image as the clean record draws it."""
    clean, _ = plotted
    messy = _fabricate(tmp_path / "run")  # the same folder name: the same legend
    lines = (messy / "metrics.jsonl").read_text().splitlines()
    superseded = [{"step": 60, "loss": 9.0, "time": 1.7e9, "elapsed_s": 999.0}]
    lines.insert(12, json.dumps({"step": 50, "resumed": True, "superseded": superseded}))
    (messy / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 105, "loss": 0.4')
    result = run_cli(["plot", str(messy)])
    assert result.returncode == 0, failure(result)
    assert f"skipped line {len(lines) + 1}, cut short" in result.stderr
    assert np.array_equal(_read_png(clean / "curves.png"), _read_png(messy / "curves.png"))


def test_plot_reads_a_record_saved_by_an_editor_as_written(tmp_path, plotted):
    """A metrics.jsonl copied through an editor (a byte-order mark, CRLF line ends, blank
    lines) holds the same points, not a "damaged" file."""
    from dlrm_hybrid.curves import read_run

    clean, _ = plotted
    edited = tmp_path / "run"
    edited.mkdir()
    lines = (clean / "metrics.jsonl").read_text().splitlines()
    lines.insert(5, "  ")
    (edited / "metrics.jsonl").write_bytes(
        "\ufeff".encode() + ("\r\n".join(lines) + "\r\n\r\n\n").encode())
    assert read_run(str(edited), "run") == read_run(str(clean), "run")


@pytest.mark.parametrize("case, message", [
    ("missing", "is not a folder"),
    ("no_metrics", "holds no metrics.jsonl"),
    ("empty", "has no loss or evaluation records yet"),
    ("damaged", "line 2 is not a JSON record"),
    ("out_is_input", "is the run record"),
])
def test_plot_bad_input_is_one_line_and_writes_nothing(tmp_path, case, message):
    good = _fabricate(tmp_path / "good")
    run_dir, out = tmp_path / "run", tmp_path / "out.png"
    if case == "no_metrics":
        run_dir.mkdir()
    elif case == "empty":
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("")
    elif case == "damaged":
        _fabricate(run_dir)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        lines[1] = lines[1][:10]
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    elif case == "out_is_input":
        run_dir, out = good, good / "metrics.jsonl"
    before = out.read_bytes() if out.exists() else None
    result = run_cli(["plot", str(good), str(run_dir), "--out", str(out)])
    assert result.returncode == 2, failure(result)
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: plot: ") and message in line
    assert (out.read_bytes() if out.exists() else None) == before
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.rglob("*.partial*"))
