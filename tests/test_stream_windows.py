"""Streaming in time order (`data.stream_window_s`): windows cut by the rows' times, each
evaluated on rows the model has not trained on and that are later than every row it did; one
pass; a run stopped mid-window resumes exactly where its checkpoint says it stood."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import failure, generated_yambda, read_metrics, run_cli
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.stream_windows import StreamWindows, stream_windows
from dlrm_hybrid.errors import DataError


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(0, 40), min_size=1, max_size=300), width=st.integers(1, 60),
       batch=st.integers(1, 64))
def test_no_window_is_evaluated_on_a_row_trained_or_earlier_than_one_trained(gaps, width, batch):
    times = np.cumsum(np.array(gaps, np.uint32)) + 1000
    stream = StreamWindows.of(times, width * 5.0, 5.0, batch)
    starts = stream.starts
    assert starts[0] == 0 and starts[-1] == len(times) and (np.diff(starts) > 0).all()
    for k in range(stream.count):  # a window is the rows of one width of time, in time order
        rows = times[starts[k]:starts[k + 1]]
        assert stream.times[k] <= rows.min() and rows.max() < stream.times[k] + width
        assert k == 0 or stream.times[k] >= stream.times[k - 1] + width
    evaluated = []
    for step in range(1, stream.steps + 1):
        trained = step * batch  # rows [0, trained) trained after `step` steps
        k, into = stream.at(step)  # the window the next row is in, and its rows trained
        assert starts[k] + into == trained
        assert into < starts[k + 1] - starts[k] or (k == stream.count - 1 and trained == starts[-1])
        window = stream.next_window(step)
        if window is None:
            continue
        first, end = stream.rows(window)
        assert first >= trained  # not one row of it trained
        assert times[trained - 1] < times[first]  # every trained row is earlier
        assert starts[window] // batch == step  # its previous window ends here
        evaluated.append(window)
    assert evaluated == sorted(set(evaluated))  # each once, in time order
    # Every window but the first is evaluated, unless it and the one before end at one step.
    ends = [int(starts[k + 1]) // batch for k in range(stream.count - 1)]
    assert set(evaluated) == {k + 1 for k in range(stream.count - 1)
                              if ends[k] > 0 and (k + 1 == stream.count - 1 or ends[k + 1] > ends[k])}


def test_a_days_windows_on_hand_made_times():
    day = 86400 / 5  # Yambda's 5-second units
    times = np.array([0, 10, day - 1, day, day + 5, 3 * day, 3 * day + 1, 4 * day], np.uint32)
    stream = StreamWindows.of(times, 86400, 5.0, batch=2)
    assert stream.starts.tolist() == [0, 3, 5, 7, 8]  # day 2 is empty: no window
    assert stream.times.tolist() == [0, day, 3 * day, 4 * day]
    assert stream.steps == 4
    assert [stream.next_window(s) for s in range(5)] == [None, 1, 2, 3, None]  # 4: the pass end
    assert stream.record(3) == {"window": 2, "rows_into_window": 1, "next_row": 6,
                                "window_start_time": 3 * day, "windows": 4}


@pytest.fixture(scope="module")
def yambda(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    generated_yambda(root, "data", ["20000", "--users", "200", "--items", "400", "--days", "10",
                                    "--seed", "3"], history=8)
    return root


def _copy(yambda: Path, tmp_path: Path) -> Path:
    shutil.copytree(yambda / "data", tmp_path / "data")
    return tmp_path / "data"


def test_the_dataset_must_have_row_times_in_order_and_one_per_row(yambda, tmp_path):
    data = _copy(yambda, tmp_path)
    times = data / "train" / "timestamp.bin"
    stream = stream_windows(SplitBinaryDataset(str(data)), 86400, 256)
    assert stream.count >= 7 and stream.starts[-1] == SplitBinaryDataset(str(data)).num_samples("train")
    raw = np.fromfile(times, np.uint32)
    swapped = raw.copy()
    swapped[[100, 101]] = raw[100] + 50, raw[100]
    swapped.tofile(times)
    with pytest.raises(DataError, match=r"train/timestamp.bin: the training rows are not in time "
                                        r"order \(row 101 is earlier"):
        stream_windows(SplitBinaryDataset(str(data)), 86400, 256)
    raw[:-1].tofile(times)
    with pytest.raises(DataError, match=r"timestamp.bin: 14,654 row times for a training split "
                                        r"of 14,655 rows"):
        stream_windows(SplitBinaryDataset(str(data)), 86400, 256)
    spec = data / "feature_spec.yaml"
    spec.write_text(spec.read_text().replace("  time_unit_s: 1.0\n", ""))
    with pytest.raises(DataError, match="does not say the row times' unit"):
        stream_windows(SplitBinaryDataset(str(data)), 86400, 256)
    spec.write_text("\n".join(line for line in spec.read_text().splitlines()
                              if "timestamp.bin" not in line and "row_times" not in line))
    with pytest.raises(DataError, match="has no row times to cut windows by"):
        stream_windows(SplitBinaryDataset(str(data)), 86400, 256)


RANKER = ["model.sequence=hstu", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
          "model.top_mlp=[16, 1]", "model.tasks=[{name: click}]", "value_model={}",
          "data.label_missing=0", "data.global_batch_size=256", "train.progress_bar=false",
          "data.stream_window_s=86400", "train.max_steps=0", "train.eval_every=0",
          "train.log_every=1"]


def _train(data: Path, run: Path, *extra: str, nproc: int = 2):
    return run_cli(["train", "--config", "configs/multitask_demo.yaml",
                    *(f"--set={o}" for o in [f"data.path={data}", *RANKER,
                                             f"train.run_dir={run}", *extra])], nproc=nproc)


def _windows(run: Path) -> dict:
    return {e["step"]: (e["evaluated"], e["window_auc_click"]) for e in read_metrics(run)
            if "windows_trained" in e}


def test_two_ranks_stream_window_after_window_and_resume_mid_window_exactly(yambda, tmp_path):
    data = yambda / "data"
    whole = _train(data, tmp_path / "whole", "checkpoint.every=20", "checkpoint.keep=3")
    assert whole.returncode == 0, failure(whole)
    assert ("streaming in time order: 8 windows of 86400 s over the training split's 14,655 "
            "rows, 57 steps of 256 from step 0 (window 0, 0 rows into it); windows each on the "
            "next window; the last 63 rows are not trained") in whole.stdout
    windows = _windows(tmp_path / "whole")
    assert sorted(windows) == [7, 14, 22, 30, 38, 44, 50]  # window k ends at its next's row // 256
    assert windows[7][0] == "window 1 (training rows 1,987-3,774)"
    meta = json.loads((tmp_path / "whole" / "checkpoints" / "step_40" / "meta.json").read_text())
    assert meta["stream"] == {"window": 5, "rows_into_window": 476, "next_row": 10240,
                              "window_start_time": 432060.0, "windows": 8}
    resumed = _train(data, tmp_path / "resumed",
                     f"checkpoint.resume={tmp_path / 'whole' / 'checkpoints' / 'step_40'}")
    assert resumed.returncode == 0, failure(resumed)
    assert "from step 40 (window 5, 476 rows into it)" in resumed.stdout
    again = _windows(tmp_path / "resumed")
    assert sorted(again) == [44, 50] and all(again[s] == windows[s] for s in again)  # exactly
    losses = {e["step"]: e["loss"] for e in read_metrics(tmp_path / "whole") if "loss" in e}
    for e in read_metrics(tmp_path / "resumed"):
        if "loss" in e:
            assert e["loss"] == losses[e["step"]], e  # dropout's draws too
    # A checkpoint whose stream record disagrees with where its step falls is not resumed.
    tampered = tmp_path / "tampered"
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "step_40", tampered)
    (tampered / "meta.json").write_text(json.dumps({**meta, "stream": {**meta["stream"],
                                                                       "window": 4}}))
    refused = _train(data, tmp_path / "refused", f"checkpoint.resume={tampered}", nproc=0)
    assert refused.returncode != 0
    assert "stopped in window 4 at 476 rows into it, and these data and settings put step 40 " \
           "in window 5" in refused.stderr


def test_other_windows_on_resume_a_shuffle_or_a_second_pass_are_refused(yambda, tmp_path):
    data = yambda / "data"
    cases = [(["data.shuffle=true"], "data.shuffle: data.stream_window_s: time order; set "
                                     "data.shuffle=false"),
             (["train.max_steps=58"], "train.max_steps: 58 steps of 256 are more than one pass "
                                      "over the 14,655 training rows (57 steps)"),
             (["data.stream_window_s=-1"], "data.stream_window_s: must be >= 0"),
             (["data.stream_eval=later"], "data.stream_eval: 'later' is not one of next, "
                                          "heldout, none")]
    for extra, message in cases:
        result = _train(data, tmp_path / "r", *extra, nproc=0)
        assert result.returncode != 0 and message in result.stderr, (extra, result.stderr)
    first = _train(data, tmp_path / "first", "train.max_steps=10", nproc=0)
    assert first.returncode == 0, failure(first)
    step = tmp_path / "first" / "checkpoints" / "step_10"
    other = _train(data, tmp_path / "other", f"checkpoint.resume={step}",
                   "data.stream_window_s=3600", nproc=0)
    assert other.returncode != 0
    assert "data.stream_window_s (86400.0 there, 3600.0 here)" in other.stderr
    heldout = _train(data, tmp_path / "heldout", f"checkpoint.resume={step}",
                     "data.stream_eval=heldout", "train.max_steps=16", nproc=0)
    assert heldout.returncode == 0, failure(heldout)
    assert _windows(tmp_path / "heldout")[14][0] == "the validation split"
