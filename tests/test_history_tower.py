"""A user tower that reads the user's history (model.user_tower.encoder history_mean |
history_attention): a training row sees only its user's training items before it in time (no
leak: a planted one is caught), validation all of them, test those and the validation item; the
served tower reproduces the trained one from a history given at request time, for a user the
model never saw too; `ids` (the default) keeps today's features."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.batch import Batch
from dlrm_hybrid.data.interactions.interaction_data import open_interactions
from dlrm_hybrid.data.interactions.planted_interactions import planted_interactions
from dlrm_hybrid.model.two_tower import build_two_tower, split_towers
from dlrm_hybrid.serve.retrieval_export import history_tower

LENGTH = 6
USERS, ITEMS = 40, 60


def write_log(path: Path, seed: int = 0) -> None:
    """A u.data-style log (user item rating timestamp), rows in random file order, many
    timestamps tied within a user, every (user, item) once, every rating positive."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(1, USERS + 1):
        items = rng.choice(np.arange(1, ITEMS + 1), size=int(rng.integers(3, 20)), replace=False)
        times = 1000 + rng.integers(0, 8, size=len(items))  # ties
        rows += [(user, item, 5, t) for item, t in zip(items, times)]
    order = rng.permutation(len(rows))
    path.write_text("".join("%d\t%d\t%d\t%d\n" % rows[i] for i in order))


def timelines(path: Path, data) -> dict:
    """Each dense user's dense items in the split's order (timestamp, ties by file line), from
    the log itself: the reference a history must follow."""
    users = {name: i for i, name in enumerate((Path(data.root) / "users.txt").read_text().split())}
    items = {name: i for i, name in enumerate((Path(data.root) / "items.txt").read_text().split())}
    rows = [line.split("\t") for line in path.read_text().splitlines()]
    order = sorted(range(len(rows)), key=lambda r: (int(rows[r][3]), r))
    out: dict = {}
    for r in order:
        out.setdefault(users[rows[r][0]], []).append(items[rows[r][1]])
    return out


def slot_histories(columns, length: int = LENGTH) -> list:
    """Each row's history as the batch carries it: slots with an id, in slot order."""
    return [[int(columns.ids[j][row, 0]) for j in range(length) if columns.lengths[j][row]]
            for row in range(len(columns.valid))]


def leaking_rows(data, timeline: dict) -> list:
    """Training rows whose history holds their own item or one their user engaged with later."""
    users, items = data.pairs["train"]
    histories = slot_histories(data.columns("train", 0, len(users)))
    leaks = []
    for row, (user, item, history) in enumerate(zip(users, items, histories)):
        when = timeline[int(user)].index(int(item))
        if any(timeline[int(user)].index(h) >= when for h in history):
            leaks.append(row)
    return leaks


@pytest.fixture(scope="module")
def log(tmp_path_factory):
    root = tmp_path_factory.mktemp("history")
    write_log(root / "u.data")
    result = run_cli(["preprocess", "interactions", "--input", str(root / "u.data"),
                      "--output", str(root / "data")])
    assert result.returncode == 0, failure(result)
    (root / "tt.yaml").write_text(CONFIG)
    return root


CONFIG = f"""
model:
  kind: two_tower
  embedding_dim: 8
  user_tower: {{mlp: [16, 8], encoder: history_attention, history_length: {LENGTH}}}
  item_tower: {{mlp: [16, 8]}}
data: {{global_batch_size: 32}}
train: {{max_steps: 4, log_every: 4, progress_bar: false, tensorboard: false}}
"""


def history_data(root: Path, encoder: str = "history_attention"):
    cfg = load_config(str(root / "tt.yaml"), [f"data.path={root / 'data'}",
                                              f"model.user_tower.encoder={encoder}"])
    return cfg, open_interactions(cfg.data.path).for_model(cfg.model)


def test_a_training_row_sees_only_its_users_earlier_training_items(log):
    _, data = history_data(log)
    timeline = timelines(log / "u.data", data)
    users, items = data.pairs["train"]
    histories = slot_histories(data.columns("train", 0, len(users)))
    for user, item, history in zip(users, items, histories):
        mine = timeline[int(user)]
        train = [i for i in mine[:-2]] if len(mine) >= 3 else mine
        before = train[:train.index(int(item))]
        assert history == before[-LENGTH:], (user, item)
    assert leaking_rows(data, timeline) == []
    assert any(len(h) == LENGTH for h in histories) and any(not h for h in histories)


def test_a_planted_leak_is_caught(log):
    """One place later in the timeline: each row's history then holds its own item."""
    _, data = history_data(log)
    timeline = timelines(log / "u.data", data)
    data.train_position = data.train_position + 1
    data.histories = data.histories_of(LENGTH)
    assert len(leaking_rows(data, timeline)) > len(data.pairs["train"][0]) // 2


def test_validation_reads_every_training_item_and_test_the_validation_item_too(log):
    _, data = history_data(log)
    timeline = timelines(log / "u.data", data)
    users = data.pairs["test"][0].astype(np.int64)
    valid = np.ones(len(users), bool)
    for split, drop in (("val", 2), ("test", 1)):
        got = slot_histories(data.user_columns(users, valid, split))
        assert got == [timeline[int(u)][:-drop][-LENGTH:] for u in users], split


def test_a_folder_without_timeline_positions_serves_ids_only(log, tmp_path):
    import shutil

    shutil.copytree(log / "data", tmp_path / "old")
    (tmp_path / "old" / "train_position.npy").unlink()
    old = open_interactions(str(tmp_path / "old"))
    assert old.train_position is None
    ids = old.for_model(load_config(str(log / "tt.yaml"), ["model.user_tower.encoder=ids"]).model)
    assert ids.spec.feature_names == ["user_id", "item_id"] and ids.columns("train", 0, 4).ids
    result = run_cli(["train", "--config", str(log / "tt.yaml"), "--set",
                      f"data.path={tmp_path / 'old'}", "--set", f"train.run_dir={tmp_path / 'r'}"])
    assert result.returncode != 0
    assert "has no train_position.npy" in result.stderr and "preprocess the log again" in result.stderr


def trained_test_users(build, cfg, data, length: int):
    """(a model `build` makes, its tables uniform in +-0.5; the test users' vectors as training
    computes them; their histories as a served tower takes them, [users, length] with -1 past
    each end; their lengths)."""
    torch.manual_seed(0)
    model = build(cfg, data.spec, embedding_device=torch.device("cpu")).eval()
    for table in model.embedding_bags.parameters():
        torch.nn.init.uniform_(table, -0.5, 0.5)
    users = np.arange(data.users)
    columns = data.user_columns(users, np.ones(len(users), bool), "test")
    batch = Batch.from_columns(columns, data.spec.feature_names)
    with torch.no_grad():
        trained, _ = split_towers(model(batch.dense, batch.sparse))
    slots, counts = data.histories.before("test", users)
    given = np.where(np.arange(length)[None, :] < counts[:, None], slots, -1)
    return model, trained, given, counts


@pytest.mark.parametrize("encoder", ["history_mean", "history_attention"])
def test_the_served_tower_reproduces_the_trained_one_from_a_given_history(log, encoder):
    cfg, data = history_data(log, encoder)
    model, trained, given, counts = trained_test_users(build_two_tower, cfg, data, LENGTH)
    served_tower = torch.jit.script(history_tower(model, model.state_dict()))
    with torch.no_grad():
        served = served_tower(torch.from_numpy(given))
    assert (counts == 0).sum() == 0 and (counts < LENGTH).any()
    assert torch.allclose(served, trained, atol=1e-5)
    assert not torch.allclose(served[0], served[1], atol=1e-3)  # histories matter
    with pytest.raises(torch.jit.Error, match="items come first"):
        served_tower(torch.tensor([[-1, 3, -1, -1, -1, -1]]))


def test_retrieve_answers_a_user_the_model_never_saw_from_a_history(log, tmp_path):
    result = run_cli(["train", "--config", str(log / "tt.yaml"), "--set",
                      f"data.path={log / 'data'}", "--set", f"train.run_dir={tmp_path / 'run'}"])
    assert result.returncode == 0, failure(result)
    assert "val_recall@10=" in result.stdout
    folder = tmp_path / "served"
    result = run_cli(["export", "--checkpoint", str(tmp_path / "run/checkpoints/step_4"), "--out",
                      str(folder), "--retrieval", "--index", "flat"])
    assert result.returncode == 0, failure(result)
    from dlrm_hybrid.serve.retrieve import Retriever

    retriever = Retriever(str(folder))
    history = retriever.item_names[5:8]  # raw item ids, oldest first
    result = run_cli(["retrieve", "--model", str(folder), "--history", ",".join(history),
                      "--k", "5", "--exact", "--json"])
    assert result.returncode == 0, failure(result)
    answer = json.loads(result.stdout)
    assert answer["by"] == "history tower" and answer["user"] is None
    dense = np.array([retriever.item(h) for h in history])
    vector = retriever.history_vectors([dense])[0]
    scores = retriever.item_vectors @ vector
    scores[dense] = -np.inf
    best = np.argsort(-scores, kind="stable")[:5]
    assert answer["items"] == [retriever.item_name(int(i)) for i in best]
    # a known user: the tower reads that user's training items in time order
    cfg, data = history_data(log)
    user = int(data.pairs["test"][0][0])
    seen = data.histories.timeline("val", user)
    assert np.allclose(retriever.user_vectors(np.array([user])),
                       retriever.history_vectors([seen]), atol=1e-6)
    result = run_cli(["retrieve", "--model", str(folder), "--k", "5"])
    assert result.returncode == 2 and "give --user or --users" in result.stderr


def test_history_settings_that_cannot_work_are_one_line_errors(log):
    for setting, says in (("model.user_tower.embedding_dim=16", "reads the item table"),
                          ("model.user_tower.attention_heads=3", "does not divide"),
                          ("model.user_tower.features=[user_id]", "reads the user's history"),
                          ("model.item_tower.encoder=history_mean", "model.item_tower")):
        result = run_cli(["plan", "--config", str(log / "tt.yaml"), "--set", setting])
        assert result.returncode == 2 and says in result.stderr, (setting, result.stderr)
    result = run_cli(["plan", "--config", str(log / "tt.yaml"), "--world-size", "2"])
    assert result.returncode == 0, failure(result)
    assert (f"user tower: no tables of its own, the last {LENGTH} items of the user's history "
            f"looked up in t_item_id") in result.stdout


def test_the_ids_tower_keeps_the_users_features():
    cfg = load_config(None, ["model.kind=two_tower", "data.users=50", "data.items=40"])
    data = planted_interactions(cfg.data).for_model(cfg.model)
    assert data.histories is None
    assert data.spec.feature_names == ["user_id", "user_segment", "item_id", "item_category"]
    model = build_two_tower(cfg, data.spec)
    assert model.history is None and [t.name for t in model.embedding_bags.embedding_bag_configs()] \
        == ["t_user_id", "t_user_segment", "t_item_id", "t_item_category"]
