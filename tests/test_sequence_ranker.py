"""The ranker's sequence feature (model.sequence hstu, DLRMv3's shape): each ranking row's history
is its user's engagements strictly before it, with their actions; HSTU reads the history and
then the candidate, as written by hand; the history's padding is never read; settings it cannot
run with, and a dataset that does not match, are refused in one line."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import failure, run_cli
from dlrm_hybrid.data.interactions.ranking_history import engagement_histories
from dlrm_hybrid.model.hstu import HSTU
from dlrm_hybrid.model.sequence_feature import SequenceFeature

# user, item, rating, timestamp: ties in time are kept in file order (a's i1 before its i2)
LOG = [("a", "i1", 5, 10), ("a", "i2", 2, 10), ("a", "i3", 4, 20), ("a", "i4", 1, 30),
       ("a", "i5", 5, 40), ("b", "i2", 5, 5), ("b", "i1", 3, 7), ("b", "i6", 4, 7),
       ("c", "i3", 2, 1), ("c", "i4", 5, 2), ("c", "i5", 5, 3), ("c", "i6", 1, 4)]
SLOTS = 2


def expected_history(user: str, item: str) -> list:
    """(item, action) of the user's last SLOTS engagements before (user, item), by time then
    file order; action 1 + watched (1) + liked (2, rating >= 4)."""
    order = sorted(range(len(LOG)), key=lambda r: (LOG[r][3], r))
    mine = [r for r in order if LOG[r][0] == user]
    at = next(k for k, r in enumerate(mine) if LOG[r][1] == item)
    return [(LOG[r][1], 2 + 2 * (LOG[r][2] >= 4)) for r in mine[max(0, at - SLOTS):at]]


def rows_of(folder: str, split: str) -> list:
    """(user, item, watched, [(history item, action)...]) of each row of a split, raw ids."""
    from pathlib import Path

    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    users = (Path(folder) / "users.txt").read_text().split()
    items = (Path(folder) / "items.txt").read_text().split()
    data = SplitBinaryDataset(folder)
    data.use_tasks(["watched"], folder)
    c = data.columns(split, 0, data.num_samples(split))
    names = data.spec.feature_names
    column = {n: c.ids[f][:, 0] for f, n in enumerate(names)}
    out = []
    for k in range(len(c.labels)):
        history = [(items[column[f"user_history{j}"][k]], int(column[f"user_action{j}"][k]))
                   for j in range(SLOTS) if column[f"user_action{j}"][k]]
        assert all(column[f"user_action{j}"][k] == 0 for j in range(len(history), SLOTS))
        out.append((users[column["user_id"][k]], items[column["item_id"][k]],
                    int(c.labels[k, 0]), history))
    return out


@pytest.fixture(scope="module")
def ranking(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_ranker")
    (root / "log.csv").write_text("".join(",".join(map(str, r)) + "\n" for r in LOG))
    result = run_cli(["preprocess", "interactions", "--input", str(root / "log.csv"),
                      "--columns", "user,item,rating,timestamp", "--labels",
                      "watched,liked:rating>=4", "--ranking-negatives", "2", "--history",
                      str(SLOTS), "--output", str(root / "ranking")])
    assert result.returncode == 0, failure(result)
    return str(root / "ranking")


def test_each_row_carries_its_users_engagements_before_it_with_their_actions(ranking):
    for split in ("train", "val", "test"):
        rows = rows_of(ranking, split)
        engaged = {(u, i): h for u, i, watched, h in rows if watched}
        for user, item, watched, history in rows:
            if watched:
                assert history == expected_history(user, item), (split, user, item)
            elif split != "train":  # a request: its engagement, then its negatives
                assert history == [h for (u, _), h in engaged.items() if u == user][-1]
            else:  # shuffled: some engagement of the user's
                assert history in [h for (u, _), h in engaged.items() if u == user]
        assert sum(w for _, _, w, _ in rows) == len(engaged)
    assert len({(u, i) for s in ("train", "val", "test") for u, i, w, _ in rows_of(ranking, s)
                if w}) == len(LOG)  # rows out = rows in


def test_the_served_history_is_each_users_latest(ranking):
    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    features = RankingFeatures(ranking)
    names = features.names
    items = np.arange(3)
    for user in ("a", "b", "c"):
        dense, ids = features.rows(features.user_of[user], items)
        want = expected_history(user, [r[1] for r in LOG if r[0] == user][-1])
        last = [r for r in sorted(enumerate(LOG), key=lambda e: (e[1][3], e[0]))
                if r[1][0] == user][-1][1]  # the latest engagement joins the history
        want = (want + [(last[1], 2 + 2 * (last[2] >= 4))])[-SLOTS:]
        for j, (item, action) in enumerate(want):
            assert (ids[:, names.index(f"user_history{j}")] == features.item_of[item]).all()
            assert (ids[:, names.index(f"user_action{j}")] == action).all()
        assert (ids[:, names.index("item_id")] == items).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 6), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 2 ** 31))
def test_histories_match_the_log_read_row_by_row(rows, users, length, labels, seed):
    rng = np.random.default_rng(seed)
    user = rng.integers(-1, users, rows)  # -1: a row in no split
    position = rng.permutation(rows)
    item = rng.integers(0, 9, rows)
    values = rng.integers(0, 2, (rows, labels)).astype(np.float32)
    histories = engagement_histories(position, user, item, values, users)
    kept = np.flatnonzero(user >= 0)
    got_items, got_actions = histories.before(kept, user[kept], length)
    for k, r in enumerate(kept):
        earlier = sorted((position[q], q) for q in kept if user[q] == user[r]
                         and position[q] < position[r])
        want = [q for _, q in earlier][-length:]
        n = len(want)
        assert list(got_items[k, :n]) == list(item[want])
        assert list(got_actions[k, :n]) == [1 + int(values[q] @ (1 << np.arange(labels)))
                                            for q in want]
        assert not got_actions[k, n:].any() and not got_items[k, n:].any()
    for u in range(users):
        mine = [q for _, q in sorted((position[q], q) for q in kept if user[q] == u)][-length:]
        latest_items, latest_actions = histories.latest(u, length)
        assert list(latest_items[:len(mine)]) == list(item[mine])
        assert (latest_actions[:len(mine)] > 0).all() and not latest_actions[len(mine):].any()


KEYS = ["user_id", "item_id", "user_history0", "user_history1", "user_history2", "user_action0",
        "user_action1", "user_action2"]


def feature(seed: int = 0) -> SequenceFeature:
    torch.manual_seed(seed)
    cfg = SimpleNamespace(layers=2, heads=1, attention_dim=0, linear_dim=0, dropout=0.0, attention_chunk=0,
                          checkpoint_layers=False)
    module = SequenceFeature(KEYS, ["user_id", "item_id", "user_action0"], "item_id",
                             KEYS[2:5], KEYS[5:], 8, cfg)
    with torch.no_grad():  # trained-like weights: the reference's init barely mixes positions
        module.candidate.normal_()
        for layer in module.hstu.layers:
            layer.uvqk.normal_(0.0, 0.5)
    return module.eval()


def test_hstu_reads_the_history_with_actions_then_the_candidate_as_written():
    module = feature()
    slots = torch.randn(3, len(KEYS), 8)
    actions = torch.tensor([[2, 4, 3], [3, 0, 0], [0, 0, 0]])
    with torch.no_grad():
        out = module(slots, actions)
    assert out.shape == (3, 3, 8)
    torch.testing.assert_close(out[:, :2], slots[:, :2])  # user and item vectors, as looked up
    hstu: HSTU = module.hstu
    for b, count in enumerate((3, 1, 0)):
        sequence = [slots[b, 2 + j] + slots[b, 5 + j] for j in range(count)]
        sequence.append(slots[b, 1] + module.candidate)
        with torch.no_grad():
            want = hstu(torch.stack(sequence)[None], torch.tensor([count + 1]))[0, count]
        torch.testing.assert_close(out[b, 2], want)


def test_the_padding_is_never_read_and_the_history_is():
    module = feature()
    slots = torch.randn(2, len(KEYS), 8)
    actions = torch.tensor([[2, 0, 0], [4, 2, 0]])
    with torch.no_grad():
        before = module(slots, actions)
        padded = slots.clone()
        padded[0, [3, 4, 6, 7]] = torch.randn(4, 8)  # row 0's empty slots' vectors
        padded[1, [4, 7]] = torch.randn(2, 8)
        torch.testing.assert_close(module(padded, actions), before)
        read = slots.clone()
        read[1, 2] += torch.randn(8)  # row 1's oldest item
        changed = module(read, actions)
    assert not torch.allclose(changed[1, 2], before[1, 2])
    torch.testing.assert_close(changed[0], before[0])


def plan(data: str, *sets: str):
    args = ["plan", "--config", "configs/multitask_demo.yaml", "--world-size", "2", "--set",
            "model.tasks=[{name: watched}]", "--set", "value_model={}", "--set",
            "data.label_missing=0"]
    for s in (f"data.path={data}" if data else "", *sets):
        if s:
            args += ["--set", s]
    return run_cli(args)


@pytest.mark.parametrize("data,sets,says", [
    ("", ["model.sequence=hstu"], "model.sequence: hstu reads each row's history"),
    ("history", [], "the dataset carries each row's history"),
    ("plain", ["model.sequence=hstu"], "the dataset has no history with actions"),
    ("history", ["model.sequence=hstu", "model.interaction=fm"], "model.interaction: 'fm'"),
    ("history", ["model.sequence=hstu", "parallel.exchange=des", "model.interaction=cat"],
     "parallel.exchange: 'des'"),
    ("history", ["model.sequence=hstu", "parallel.dense=fsdp"], "parallel.dense: 'fsdp'"),
    ("history", ["model.sequence=hstu", "model.hstu.heads=3"], "model.hstu.heads: 3"),
])
def test_what_the_sequence_feature_cannot_run_with_is_one_line(ranking, tmp_path, data, sets,
                                                               says):
    folders = {"history": ranking, "plain": str(tmp_path / "plain"), "": ""}
    if data == "plain":
        result = run_cli(["preprocess", "interactions", "--input", f"{ranking}/../log.csv",
                          "--columns", "user,item,rating,timestamp", "--labels", "watched",
                          "--output", folders["plain"]])
        assert result.returncode == 0, failure(result)
    result = plan(folders[data], *sets)
    assert result.returncode == 2, failure(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], result.stderr


def test_a_bad_history_argument_or_a_history_out_of_order_is_one_line(ranking, tmp_path):
    result = run_cli(["preprocess", "interactions", "--input", f"{ranking}/../log.csv",
                      "--columns", "user,item,rating,timestamp", "--history", "2",
                      "--output", str(tmp_path / "r")])
    assert result.returncode == 2 and "--history: for a ranking dataset" in result.stderr
    result = run_cli(["preprocess", "interactions", "--input", f"{ranking}/../log.csv",
                      "--columns", "user,item,rating,timestamp", "--labels", "watched",
                      "--history", "-1", "--output", str(tmp_path / "r")])
    assert result.returncode == 2 and "--history: the slots" in result.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("damage", ["garbage", "no_times", "short"])
def test_a_damaged_timelines_file_is_one_line(ranking, tmp_path, damage):
    import shutil

    from dlrm_hybrid.errors import DataError
    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    folder = tmp_path / "ranking"
    shutil.copytree(ranking, folder)
    path = folder / "timelines.npz"
    with np.load(path) as f:
        arrays = dict(f)
    if damage == "garbage":
        path.write_bytes(b"not a zip")
    elif damage == "no_times":
        np.savez(path, **{k: v for k, v in arrays.items() if k != "times"})
    else:
        np.savez(path, **{**arrays, "items": arrays["items"][:-1]})
    with pytest.raises(DataError, match="timelines"):
        RankingFeatures(str(folder))


@pytest.mark.parametrize("sets", [[], ["model.interaction=dcn", "model.hstu.heads=2"]])
def test_the_plans_dense_units_count_the_models_parameters(ranking, sets):
    """`plan`'s dense part (what the planner reserves per rank) is the built model's, the
    sequence feature's HSTU and candidate marker included."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.configured_spec import data_spec
    from dlrm_hybrid.model.dlrm import build_model
    from dlrm_hybrid.parallel.dense_memory import model_dense_units

    cfg = load_config("configs/multitask_demo.yaml", [
        f"data.path={ranking}", "model.sequence=hstu", "model.tasks=[{name: watched}]",
        "value_model={}", "data.label_missing=0", *sets])
    spec = data_spec(cfg.data, cfg.model)
    model = build_model(cfg.model, spec)
    dense = sum(p.numel() for name, p in model.named_parameters()
                if not name.startswith("embedding_bags"))
    assert sum(u.count for u in model_dense_units(cfg.model, spec)) == dense
    assert any(name.startswith("sequence.hstu") for name, _ in model.named_parameters())


def test_one_requests_candidates_in_one_pass_score_as_each_alone():
    """Rows sharing a history (one request's candidates) run the history once with every
    candidate after it (DLRMv3's layout): each candidate's vector is the one it gets alone."""
    module = feature()
    slots = torch.randn(1, len(KEYS), 8).repeat(5, 1, 1)
    slots[:, 1] = torch.randn(5, 8)  # five candidates
    slots[:, 0] = torch.randn(5, 8)  # a user vector each: not part of the history
    for actions in ([[2, 4, 3]], [[3, 0, 0]], [[0, 0, 0]]):
        actions = torch.tensor(actions).repeat(5, 1)
        with torch.no_grad():
            together = module(slots, actions)
            alone = torch.cat([module(slots[k:k + 1], actions[k:k + 1]) for k in range(5)])
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
    module.train()  # training (dropout's masks per row) runs each row on its own
    assert module(slots, actions).shape == (5, 3, 8)


def test_plan_offers_no_dense_mode_the_sequence_ranker_cannot_run_with(ranking):
    result = plan(ranking, "model.sequence=hstu", "parallel.reserve_per_rank=1KiB")
    assert result.returncode == 0, failure(result)
    assert "other modes per rank: none (this model's dense part runs under ddp only)" in \
        result.stdout
    assert "dense part does not fit in parallel.reserve_per_rank 1KiB: raise" in result.stdout
    assert "fsdp" not in result.stdout
