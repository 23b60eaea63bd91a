"""Serving a multi-task ranker: `export` writes a file giving each task's probability and the
value model's sum of them; `predict` in another process reproduces every task's `eval` AUC
(missing labels left out), writes the value, takes other value weights without re-export, and
labels each request's top K rows for a first-stage model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.model.dlrm import build_model
from dlrm_hybrid.model.embeddings import table_order
from dlrm_hybrid.serve.export import scoring_model, table_precisions
from dlrm_hybrid.serve.predict import load_scoring_model, predict, top_k_labels

TASKS = ["click", "like", "see_less"]
VALUE = [1.0, 2.0, -3.0]  # the config's value_model, in TASKS order
CONFIG = """
model:
  embedding_dim: 8
  bottom_mlp: [16, 8]
  top_mlp: [16, 1]
  tasks:
    - {name: click}
    - {name: like, weight: 0.5, head: [8]}
    - {name: see_less}
value_model: {click: 1.0, like: 2.0, see_less: -3.0}
data:
  train_samples: 8192
  val_samples: 2048
  global_batch_size: 256
  label_missing: 0.3
train:
  max_steps: 24
  progress_bar: false
checkpoint:
  resume: none
"""


def _cli(args) -> str:
    result = run_cli(args)
    assert result.returncode == 0, failure(result)
    return result.stdout.strip().splitlines()[-1]


def _fields(line: str) -> dict:
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A split-binary dataset of 3 planted tasks (two with missing labels), a model trained 24
    steps on it, its `eval` on the validation split, its fp32 export (with the value model)
    and int8 export (without one), what `predict` of the fp32 file said of that split, and the
    split's rows as a CSV whose empty label fields are the missing labels."""
    root = tmp_path_factory.mktemp("multitask_serve")
    (root / "mt.yaml").write_text(CONFIG)
    data = root / "data"
    _cli(["synth", "--config", str(root / "mt.yaml"), "--output", str(data)])
    spec = yaml.safe_load((data / "feature_spec.yaml").read_text())  # as a ranking log's
    spec["metadata"].update(request_feature="user", categorical_features=["user", "item", "hour"])
    (data / "feature_spec.yaml").write_text(yaml.safe_dump(spec))
    _cli(["train", "--config", str(root / "mt.yaml"), "--set", f"data.path={data}",
          "--set", f"train.run_dir={root / 'run'}"])
    checkpoint = root / "run" / "checkpoints" / "step_24"
    evaluated = _fields(_cli(["eval", "--checkpoint", str(checkpoint), "--split", "val"]))
    _cli(["export", "--checkpoint", str(checkpoint), "--out", str(root / "fp32.pt")])
    _cli(["export", "--checkpoint", str(checkpoint), "--out", str(root / "int8.pt"),
          "--quantize", "int8", "--set", "value_model={}"])
    said = _fields(_cli(["predict", "--model", str(root / "fp32.pt"), "--data", str(data),
                         "--split", "val", "--out", str(root / "p.csv")]))
    dataset = SplitBinaryDataset(str(data))
    dataset.use_tasks(TASKS, "data")
    columns = dataset.columns("val", 0, dataset.num_samples("val"))
    assert np.isnan(columns.labels).any(axis=0).tolist() == [False, True, True]
    names = [*TASKS, *(f"num_{i}" for i in range(columns.dense.shape[1])),
             *(f"cat_{f}" for f in range(len(columns.ids)))]
    lines = [",".join(names)]
    for i in range(len(columns.dense)):
        lines.append(",".join([*("" if np.isnan(y) else str(int(y)) for y in columns.labels[i]),
                               *(repr(float(v)) for v in columns.dense[i]),
                               *(str(ids[i, 0]) for ids in columns.ids)]))
    (root / "val.csv").write_text("\n".join(lines) + "\n")
    return {"root": root, "eval": evaluated, "columns": columns, "lines": lines,
            "predicted": said}


def _table(path: Path):
    """(header, rows) of predict's CSV output."""
    header = path.read_text().splitlines()[0].split(",")
    return header, np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)


def test_predict_reproduces_each_tasks_eval_auc_and_writes_the_value(served):
    root, evaluated, said = served["root"], served["eval"], served["predicted"]
    header, table = _table(root / "p.csv")
    assert header == [*TASKS, "value"] and table.shape == (len(served["columns"].dense), 4)
    for task in TASKS:  # eval leaves missing labels out: so must predict
        assert abs(float(said[f"auc_{task}"]) - float(evaluated[f"val_auc_{task}"])) < 1e-4
        assert abs(float(said[f"logloss_{task}"]) -
                   float(evaluated[f"val_logloss_{task}"])) < 1e-4
    assert said["value_model"] == "click:1,like:2,see_less:-3"
    np.testing.assert_allclose(table[:, 3], table[:, :3] @ VALUE, rtol=0, atol=2e-6)
    by_value = np.argsort(-table[:, 3])  # best first: the weighted sum falls along it
    assert (np.diff((table[:, :3] @ VALUE)[by_value]) <= 4e-6).all()

    said = _fields(_cli(["predict", "--model", str(root / "int8.pt"), "--data",
                         str(root / "val.csv"), "--out", str(root / "q.csv")]))
    header, quantized = _table(root / "q.csv")
    assert header == TASKS and said["value_model"] == "none"  # exported without a value model
    assert np.abs(quantized - table[:, :3]).max() < 5e-3
    for task in TASKS:
        assert abs(float(said[f"auc_{task}"]) - float(evaluated[f"val_auc_{task}"])) < 2e-3


def test_csv_rows_score_as_the_dataset_and_other_value_weights_need_no_re_export(served):
    root = served["root"]
    before = (root / "fp32.pt").read_bytes()
    said = _fields(_cli(["predict", "--model", str(root / "fp32.pt"), "--data",
                         str(root / "val.csv"), "--out", str(root / "v.csv"),
                         "--value", "click=1,like=0.5"]))
    header, table = _table(root / "v.csv")
    assert header == [*TASKS, "value"] and said["value_model"] == "click:1,like:0.5,see_less:0"
    np.testing.assert_allclose(table[:, 3], table[:, 0] + 0.5 * table[:, 1], rtol=0, atol=1e-6)
    assert (root / "fp32.pt").read_bytes() == before
    # the CSV's named label columns, empty where missing, read as the dataset's labels
    np.testing.assert_allclose(table[:, :3], _table(root / "p.csv")[1][:, :3], rtol=0, atol=1e-6)
    for key in (f"{metric}_{task}" for metric in ("auc", "logloss") for task in TASKS):
        assert said[key] == served["predicted"][key]

    # the file itself: the exported weights by default, others on request, none without them
    columns = served["columns"]
    dense = torch.from_numpy(columns.dense[:64])
    ids = torch.from_numpy(np.concatenate(columns.ids, 1)[:64])
    module, description = load_scoring_model(root / "fp32.pt")
    assert description["tasks"] == TASKS and description["value_model"] == dict(zip(TASKS, VALUE))
    probabilities, value = module.score_with_value(dense, ids)
    assert torch.equal(probabilities, module(dense, ids)) and probabilities.shape == (64, 3)
    assert torch.allclose(value, probabilities @ torch.tensor(VALUE), atol=1e-6)
    other = torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(module.score_with_value(dense, ids, None, other)[1], probabilities[:, 1])
    unvalued, _ = load_scoring_model(root / "int8.pt")
    with pytest.raises(torch.jit.Error, match="exported without a value model; give one "
                                              "weight per task"):
        unvalued.score_with_value(dense, ids)
    assert unvalued.score_with_value(dense, ids, None, other)[1].shape == (64,)


def test_top_k_labels_mark_each_requests_best_rows_ties_in_row_order():
    requests = np.array([7, 7, 7, 7, 3, 3, 3, 7])  # the last row belongs to request 7 too
    values = np.array([0.1, 0.5, 0.5, 0.2, 0.9, 0.9, 0.1, 0.0])
    assert top_k_labels(requests, values, 2).tolist() == [0, 1, 1, 0, 1, 1, 0, 0]
    assert top_k_labels(requests, values, 1).tolist() == [0, 1, 0, 0, 1, 0, 0, 0]
    values[7] = 0.6  # request 7's best row comes after request 3's rows
    assert top_k_labels(requests, values, 1).tolist() == [0, 0, 0, 0, 1, 0, 0, 1]
    assert top_k_labels(requests[:0], values[:0], 1).tolist() == []


def test_predict_writes_a_top_k_label_per_row_for_a_hand_built_request_log(served, tmp_path):
    """Requests by cat_0: rows of one id, then of another, then the first id again (the same
    request). The validation rows' values (predict's of the whole split) say which rows lead
    each request."""
    root, columns = served["root"], served["columns"]
    value = _table(root / "p.csv")[1][:, 3]
    user = columns.ids[0][:, 0]
    a, b = np.unique(user, return_counts=True)[0][:2]
    low, mid, high = _by_value(np.flatnonzero(user == a), value)
    other_low, _, other_high = _by_value(np.flatnonzero(user == b), value)
    log = [mid, high, low, other_low, other_high, low]
    unlabelled = [",".join(line.split(",")[len(TASKS):]) for line in served["lines"]]
    (tmp_path / "log.csv").write_text("\n".join([unlabelled[0], *(unlabelled[1 + i] for i in log)])
                                      + "\n")
    said = _cli(["predict", "--model", str(root / "fp32.pt"), "--data", str(tmp_path / "log.csv"),
                 "--out", str(tmp_path / "p.csv"), "--top-k-label", "1", "--label-out",
                 str(tmp_path / "top.txt"), "--request-feature", "cat_0"])
    assert f"wrote {tmp_path / 'p.csv'} and {tmp_path / 'top.txt'} samples=6" in said
    assert (tmp_path / "top.txt").read_text().split() == ["0", "1", "0", "0", "1", "0"]
    predict(str(root / "fp32.pt"), str(tmp_path / "log.csv"), str(tmp_path / "p.csv"),
            top_k_label=2, label_out=str(tmp_path / "top.txt"), request_feature="cat_0")
    assert (tmp_path / "top.txt").read_text().split() == ["1", "1", "0", "1", "1", "0"]


def test_a_datasets_recorded_request_feature_groups_its_rows(served, tmp_path):
    """The dataset's metadata names `user` (its own name of cat_0) the request feature: the
    rows of one cat_0 id, wherever they are, get one 1, on their row of highest value."""
    root, columns = served["root"], served["columns"]
    said = _cli(["predict", "--model", str(root / "fp32.pt"), "--data", str(root / "data"),
                 "--split", "val", "--out", str(tmp_path / "p.csv"), "--top-k-label", "1",
                 "--label-out", str(tmp_path / "top.txt")])
    assert "samples=2048 " in said
    labels = np.loadtxt(tmp_path / "top.txt", dtype=np.int64)
    value, user = _table(tmp_path / "p.csv")[1][:, 3], columns.ids[0][:, 0]
    runs = np.flatnonzero(np.r_[True, user[1:] != user[:-1]])
    assert len(labels) == len(user) and len(np.unique(user)) < len(runs)  # ids that come back
    for request in np.unique(user):
        rows = np.flatnonzero(user == request)
        assert labels[rows].sum() == 1
        assert value[rows[labels[rows].argmax()]] == value[rows].max()


def _by_value(rows: np.ndarray, value: np.ndarray) -> list:
    """The rows of lowest, median and highest value."""
    rows = rows[np.argsort(value[rows])]
    assert len(rows) >= 3 and value[rows[0]] < value[rows[len(rows) // 2]] < value[rows[-1]]
    return [rows[0], rows[len(rows) // 2], rows[-1]]


@pytest.mark.parametrize("args, message", [
    (["--value", "click=1,likes=2"], "--value likes=2: no task 'likes'; the model's tasks are "
                                     "click, like, see_less (e.g. --value click=1)"),
    (["--value", "like=much"], "--value like=much: 'much' is not a finite number; give "
                               "TASK=WEIGHT, e.g. like=0.5"),
    (["--top-k-label", "2", "--label-out", "top.txt"],
     "--top-k-label: which feature names a row's request? {data} records none "
     "(metadata.request_feature); give --request-feature NAME, one of cat_0, cat_1, cat_2"),
    (["--top-k-label", "2", "--label-out", "top.txt", "--request-feature", "user"],
     "--request-feature: 'user' is not a feature of the model; its features are cat_0, cat_1, "
     "cat_2"),
    (["--top-k-label", "2", "--label-out", "{data}", "--request-feature", "cat_0"],
     "predict: --label-out {data} is --data {data}, an input; write it elsewhere"),
    (["--top-k-label", "2", "--request-feature", "cat_0"],
     "--top-k-label K and --label-out FILE go together: the labels of each request's top K "
     "rows are written to FILE"),
])
def test_bad_value_or_top_k_arguments_are_one_line_errors(served, tmp_path, args, message):
    root = served["root"]
    (tmp_path / "p.csv").write_text("an earlier result\n")
    data = root / "val.csv"
    result = run_cli(["predict", "--model", str(root / "fp32.pt"), "--data", str(data), "--out",
                      str(tmp_path / "p.csv"), *(a.format(data=data) for a in args)], cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: " + message.format(data=data)]
    assert (tmp_path / "p.csv").read_text() == "an earlier result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv"]


def test_top_k_without_a_value_model_and_bad_task_labels_are_refused(served, tmp_path):
    root, lines = served["root"], served["lines"]
    result = run_cli(["predict", "--model", str(root / "int8.pt"), "--data",
                      str(root / "val.csv"), "--out", str(tmp_path / "p.csv"), "--top-k-label",
                      "1", "--label-out", str(tmp_path / "top.txt"), "--request-feature", "cat_0"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --top-k-label: ranks rows by the value model, and {root / 'int8.pt'} was "
        f"exported without one (value_model); give --value click=1,like=1,see_less=1 or other "
        f"weights"]
    bad = [lines[0], lines[1], re.sub(r"^(\d?),(\d?),", r"\1,2,", lines[2])]
    (tmp_path / "bad.csv").write_text("\n".join(bad) + "\n")
    with pytest.raises(DataError, match=r"bad.csv:3: label like is '2'; labels are 0 or 1, or "
                                        r"empty where missing"):
        predict(str(root / "fp32.pt"), str(tmp_path / "bad.csv"), str(tmp_path / "p.csv"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.csv"]
    assert json.loads((root / "fp32.json").read_text())["format"].endswith("multitask/1")


@pytest.mark.parametrize("variant", [
    ["model.mmoe.experts=2", "model.mmoe.expert_mlp=[8]"],
    ["model.interaction=dcn", "model.dcn.rank=4", "model.dcn.structure=parallel"],
    ["model.task_dot_dim=3"],
    ["model.task_dot_dim=2", "model.interaction=dcn", "model.dcn.rank=4"],
])
def test_heads_behind_experts_or_a_parallel_cross_network_are_served_exactly(tmp_path, variant):
    """The served heads (after MMoE's gates, or reading dcn parallel's cross network beside the
    trunk, or with each task's own dots added) give the trained model's probabilities, task by
    task."""
    (tmp_path / "mt.yaml").write_text(CONFIG)
    cfg = load_config(str(tmp_path / "mt.yaml"), variant)
    data = SyntheticClicks(cfg.data, TASKS)
    torch.manual_seed(0)
    model = build_model(cfg.model, data.spec, embedding_device=torch.device("cpu")).eval()
    batch, columns = data.batch("val", 0, 256), data.columns("val", 0, 256)
    with torch.no_grad():
        expected = torch.sigmoid(model(batch.dense, batch.sparse))
    unsharded = build_model(cfg.model, data.spec)
    precisions = table_precisions([p.table for p in table_order(unsharded.lookups)], "fp32", [])
    served = torch.jit.script(scoring_model(unsharded, model.state_dict(), precisions, VALUE))
    probabilities, value = served.score_with_value(torch.from_numpy(columns.dense),
                                                   torch.from_numpy(np.concatenate(columns.ids, 1)))
    assert probabilities.shape == (256, 3) and torch.allclose(probabilities, expected, atol=1e-6)
    assert torch.allclose(value, expected @ torch.tensor(VALUE), atol=1e-6)
