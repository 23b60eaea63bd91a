"""The sequence model (model.kind hstu) on an interaction log a user preprocessed: its training
windows never read the future, the exported user tower gives the trained model's vectors from a
history given at request time, `retrieve` serves it, and bad histories are one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.nn.functional import normalize

from conftest import ROOT, failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.interactions.interaction_data import open_interactions
from dlrm_hybrid.model.hstu_retrieval import build_hstu
from dlrm_hybrid.serve.retrieval_export import sequence_towers
from test_history_tower import slot_histories, timelines, trained_test_users, write_log

LENGTH = 5
CONFIG = f"""
model:
  kind: hstu
  embedding_dim: 8
  hstu: {{max_length: {LENGTH}, layers: 2, heads: 2, dropout: 0.0}}
retrieval: {{uniform_negatives: 8}}
data: {{global_batch_size: 16}}
optim: {{embedding: rowwise_adagrad, embedding_lr: 0.05, dense: adam, dense_lr: 0.01}}
train: {{max_steps: 4, log_every: 4, progress_bar: false, tensorboard: false}}
"""


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("hstu_log")
    write_log(root / "u.data")
    result = run_cli(["preprocess", "interactions", "--input", str(root / "u.data"),
                      "--output", str(root / "data")])
    assert result.returncode == 0, failure(result)
    (root / "hstu.yaml").write_text(CONFIG)
    return root


def sequence_data(root):
    cfg = load_config(str(root / "hstu.yaml"), [f"data.path={root / 'data'}"])
    return cfg, open_interactions(cfg.data.path).for_model(cfg.model)


def test_each_window_reads_only_earlier_items_and_targets_the_next(log):
    cfg, data = sequence_data(log)
    timeline = timelines(log / "u.data", data)
    count = data.num_samples("train")
    columns = data.columns("train", 0, count)
    targets = columns.ids[LENGTH][:, 0]
    users = data.pairs["train"][0][data.train_rows]
    predicted = {}
    for user, history, target in zip(users, slot_histories(columns, LENGTH), targets):
        mine = timeline[int(user)]
        at = mine.index(int(target))
        assert history == mine[max(0, at - LENGTH):at]  # the items just before, in order
        predicted.setdefault(int(user), []).extend([*history[1:], int(target)])
    for user, items in predicted.items():  # all but the user's first, once each
        assert sorted(items) == sorted(timeline[user][1:len(items) + 1])
    assert count < len(data.pairs["train"][0])  # windows, not every row


def test_each_slot_carries_its_items_time_from_the_log(log):
    """The dense values are the history's times, seconds after its latest item, as the log
    has them (preprocess keeps timestamps; the pairs are unique in this log)."""
    cfg, data = sequence_data(log)
    raw_users = (log / "data/users.txt").read_text().split()
    raw_items = (log / "data/items.txt").read_text().split()
    when = {(u, i): float(t) for u, i, _, t in
            (line.split("\t") for line in (log / "u.data").read_text().splitlines())}
    for split in ("train", "test"):
        count = data.num_samples(split)
        columns = data.columns(split, 0, count)
        histories = slot_histories(columns, LENGTH)
        users = (data.pairs["train"][0][data.train_rows] if split == "train"
                 else data.pairs[split][0])
        assert columns.dense.shape == (count, LENGTH)
        for row, (user, history) in enumerate(zip(users, histories)):
            times = [when[(raw_users[user], raw_items[i])] for i in history]
            want = np.zeros(LENGTH)
            want[:len(times)] = np.array(times) - times[-1]
            np.testing.assert_array_equal(columns.dense[row], want)
    cfg.model.hstu.time_buckets = 0  # no time bias: no dense values
    assert open_interactions(cfg.data.path).for_model(cfg.model).columns(
        "train", 0, 4).dense.shape == (4, 0)


def test_the_served_tower_gives_the_trained_models_vectors(log):
    cfg, data = sequence_data(log)
    model, trained, given, counts = trained_test_users(build_hstu, cfg, data, LENGTH)
    users = np.arange(data.users)
    times = data.histories.times_before("test", users) + 7e8  # any origin: only gaps count
    assert data.meta.history_times
    tower, items = sequence_towers(model, model.state_dict(), reads_times=True)
    served_tower = torch.jit.script(tower)
    with torch.no_grad():
        served = served_tower(torch.from_numpy(given), torch.from_numpy(times))
        untimed = served_tower(torch.from_numpy(given))
    assert (counts < LENGTH).any() and (counts == LENGTH).any()
    torch.testing.assert_close(served, trained, atol=1e-5, rtol=0)
    assert not torch.allclose(untimed, served, atol=1e-6)  # the time bias is read
    table = model.embedding_bags.embedding_bags["t_item_id"].weight.detach()
    np.testing.assert_allclose(items, normalize(table, dim=1).numpy(), atol=1e-6)
    for bad, says in (([[-1, -1, -1, -1, -1]], "no items"),
                      ([[3, data.items, -1, -1, -1]], f"item ids are 0..{data.items - 1}"),
                      ([[1, 2, 3, 4, 5, 6]], f"expected [B, {LENGTH}]")):
        with pytest.raises(torch.jit.Error, match=says.replace("[", r"\[")):
            served_tower(torch.tensor(bad))


def test_trained_exported_and_served_through_the_commands(log, tmp_path):
    result = run_cli(["train", "--config", str(log / "hstu.yaml"), "--set",
                      f"data.path={log / 'data'}", "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert result.returncode == 0, failure(result)
    assert "val_hr@10=" in result.stdout and "hstu: 2 layers, 2 heads" in result.stdout
    folder = tmp_path / "served"
    result = run_cli(["export", "--checkpoint", str(tmp_path / "run/checkpoints/step_4"),
                      "--out", str(folder), "--retrieval", "--index", "flat"])
    assert result.returncode == 0, failure(result)
    from dlrm_hybrid.serve.retrieve import Retriever

    retriever = Retriever(str(folder))
    history = retriever.item_names[:LENGTH + 3]  # longer than the model reads: its last LENGTH
    result = run_cli(["retrieve", "--model", str(folder), "--history", ",".join(history),
                      "--k", "4", "--exact", "--json"])
    assert result.returncode == 0, failure(result)
    answer = json.loads(result.stdout)
    dense = np.array([retriever.item(h) for h in history])
    vector = retriever.history_vectors([dense[-LENGTH:]])[0]  # no times given: gaps of 0 s
    scores = retriever.item_vectors @ vector
    scores[dense] = -np.inf
    assert answer["items"] == [retriever.item_name(int(i))
                               for i in np.argsort(-scores, kind="stable")[:4]]
    # a known user: the tower reads that user's training items with their times
    cfg, data = sequence_data(log)
    user = int(data.pairs["test"][0][0])
    seen, when = data.histories.timeline("val", user), data.histories.timeline_times("val")
    assert np.allclose(retriever.user_vectors(np.array([user])),
                       retriever.history_vectors([seen], [when[data.histories.indptr[user]:
                                                               data.histories.indptr[user + 1]]]),
                       atol=1e-6)
    assert not np.allclose(retriever.user_vectors(np.array([user])),
                           retriever.history_vectors([seen]), atol=1e-7)
    result = run_cli(["export", "--checkpoint", str(tmp_path / "run/checkpoints/step_4"),
                      "--out", str(tmp_path / "ranker")])
    assert result.returncode == 2
    assert "is a hstu (retrieval) model; add --retrieval" in result.stderr


def test_a_user_without_training_items_is_a_one_line_error_in_serving(log, tmp_path):
    """A time split leaves a user who came after the cut with no training items: the sequence
    model has no history to read for `--user` (a traceback from the scripted tower before);
    `--history` serves the user."""
    lines = (log / "u.data").read_text() + "999\t1\t5\t1006\n999\t2\t5\t1007\n"
    (tmp_path / "u.data").write_text(lines)
    for args in (["preprocess", "interactions", "--input", str(tmp_path / "u.data"), "--output",
                  str(tmp_path / "data"), "--split", "time", "--cut", "1006,1007"],
                 ["train", "--config", str(log / "hstu.yaml"), "--set",
                  f"data.path={tmp_path / 'data'}", "--set", f"train.run_dir={tmp_path / 'run'}"],
                 ["export", "--checkpoint", str(tmp_path / "run/checkpoints/step_4"), "--out",
                  str(tmp_path / "served"), "--retrieval"]):
        result = run_cli(args)
        assert result.returncode == 0, failure(result)
    ask = ["retrieve", "--model", str(tmp_path / "served"), "--user", "999", "--k", "3"]
    result = run_cli(ask)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
    assert result.stderr.startswith("error: retrieve: user '999' has no training items"), \
        result.stderr
    result = run_cli([*ask, "--history", "1"])
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 3, failure(result)


@pytest.mark.parametrize("setting, says", [
    ("model.hstu.heads=3", "does not divide model.embedding_dim 8"),
    ("model.hstu.dropout=1", "model.hstu.dropout: 1.0 is not in [0, 1)"),
    ("model.embedding_dim=10", "not a multiple of 4"),
    ("model.hstu.max_length=0", "model.hstu.max_length"),
    ("model.hstu.in_batch_negatives=false --set retrieval.uniform_negatives=0",
     "leaves the softmax no candidates"),
])
def test_settings_that_cannot_work_are_one_line_errors(log, setting, says):
    sets = [arg for one in setting.split(" --set ") for arg in ("--set", one)]
    result = run_cli(["plan", "--config", str(log / "hstu.yaml"), "--set",
                      f"data.path={log / 'data'}", *sets])
    assert result.returncode == 2 and says in result.stderr, (setting, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("per_user, says", [
    (2, "data.interactions_per_user: 2 leaves the planted log no training engagements (each "
        "user's last two are val and test); use 4 or more"),
    (3, "planted interactions: the train split has no samples and training reads it (hstu "
        "trains on users with two or more training engagements); set "
        "data.interactions_per_user to 4 or more")])
def test_planted_users_with_one_training_engagement_name_the_setting_to_raise(tmp_path,
                                                                              per_user, says):
    """hstu trains on users with two or more training engagements, so 3 per user leaves none
    (the planted log is no folder to preprocess again)."""
    result = run_cli(["train", "--config", str(ROOT / "configs/hstu_demo.yaml"), "--set",
                      f"data.interactions_per_user={per_user}", "--set",
                      f"train.run_dir={tmp_path}"])
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [f"error: {says}"]


def test_plan_reports_the_sequence_model_without_torch_state(log):
    result = run_cli(["plan", "--config", str(log / "hstu.yaml"), "--set",
                      f"data.path={log / 'data'}", "--world-size", "2"])
    assert result.returncode == 0, failure(result)
    assert (f"sequence: the user's last {LENGTH} items looked up in t_item_id"
            in result.stdout)
    assert "hstu positions" in result.stdout and "hstu layer 2" in result.stdout
