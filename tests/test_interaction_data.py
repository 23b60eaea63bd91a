"""`preprocess interactions` as a user meets it (MovieLens layouts, --columns, splits, bad rows),
the folder it writes read back, and the planted log's recorded ceiling."""

from __future__ import annotations

import collections
import gzip
from pathlib import Path

import numpy as np
import pytest

from conftest import done_fields, failure, read_metrics, run_cli
from dlrm_hybrid.config import DataConfig
from dlrm_hybrid.data.interactions.interaction_data import open_interactions
from dlrm_hybrid.data.interactions.planted_interactions import (planted_interactions, teacher,
                                                                teacher_scores)

# user, item, rating, timestamp. Positives (rating >= 4) per user, oldest first:
# user 1: items 1 (t 10), 2 (t 20), 4 (t 40), 5 (t 40, after 4 in the file): val 4, test 5
# user 2: items 1, 2, 6: val 2, test 6; user 3: item 1 only: all in train
ROWS = [(1, 1, 5, 10), (1, 2, 4, 20), (1, 3, 2, 30), (1, 4, 5, 40), (1, 5, 4, 40),
        (2, 6, 4, 25), (2, 1, 4, 5), (2, 2, 5, 15), (3, 1, 5, 50), (3, 2, 1, 60)]
# dense ids by positives, most first (ties: raw id order): users 1, 2, 3; items 1, 2, 4, 5, 6
USERS, ITEMS = ["1", "2", "3"], ["1", "2", "4", "5", "6"]
SPLITS = {"train": {(0, 0), (0, 1), (1, 0), (2, 0)},
          "val": [(0, 2), (1, 1)], "test": [(0, 3), (1, 4)]}


def write_layout(folder: Path, name: str) -> Path:
    """ROWS as MovieLens writes them in `name`'s layout."""
    folder.mkdir(parents=True, exist_ok=True)
    if name == "u.data":
        text = "".join(f"{u}\t{i}\t{r}\t{t}\n" for u, i, r, t in ROWS)
    elif name == "ratings.dat":  # with a byte-order mark: not part of the first user id
        text = "\ufeff" + "".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in ROWS)
    else:  # ratings.csv: a header, a byte-order mark and CRLF line ends, as Windows tools save it
        text = "\ufeffuserId,movieId,rating,timestamp\r\n" + "".join(
            f"{u},{i},{r:.1f},{t}\r\n" for u, i, r, t in ROWS)
    path = folder / name
    path.write_bytes(text.encode())
    return path


def preprocess(inputs, output: Path, *options: str):
    return run_cli(["preprocess", "interactions", "--input", *map(str, inputs),
                    "--output", str(output), *options])


def pairs(data, split: str):
    users, items = data.pairs[split]
    return list(zip(users.tolist(), items.tolist()))


def write_log(path: Path, lines) -> Path:
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@pytest.mark.parametrize("layout", ["u.data", "ratings.dat", "ratings.csv"])
def test_each_movielens_layout_gives_the_leave_last_out_dataset(tmp_path, layout):
    result = preprocess([write_layout(tmp_path / "log", layout)], tmp_path / "out")
    assert result.returncode == 0, failure(result)
    assert "done: users=3 items=5 train=4 val=2 test=2" in result.stdout
    data = open_interactions(str(tmp_path / "out"))
    assert set(pairs(data, "train")) == SPLITS["train"]
    assert pairs(data, "val") == SPLITS["val"] and pairs(data, "test") == SPLITS["test"]
    assert (tmp_path / "out" / "users.txt").read_text().split() == USERS
    assert (tmp_path / "out" / "items.txt").read_text().split() == ITEMS
    meta = data.meta
    assert meta.positive == "rating >= 4" and meta.split_rule.startswith("leave-last-out by time")
    assert meta.extra["users_all_in_train"] == 1 and meta.extra["not_positive"] == 2
    assert meta.samples == {"train": 4, "val": 2, "test": 2}


def test_several_inputs_are_one_log_and_a_time_cut_splits_it_globally(tmp_path):
    first = write_log(tmp_path / "a.csv", [",".join(map(str, r)) for r in ROWS[:5]])
    second = write_log(tmp_path / "b.csv", [",".join(map(str, r)) for r in ROWS[5:]])
    result = preprocess([first, second], tmp_path / "out", "--columns", "user,item,rating,timestamp",
                        "--split", "time", "--cut", "20,40")
    assert result.returncode == 0, failure(result)
    data = open_interactions(str(tmp_path / "out"))
    # before 20 train; [20, 40) val; from 40 test (user order, then time, then file order)
    assert set(pairs(data, "train")) == {(0, 0), (1, 0), (1, 1)}
    assert pairs(data, "val") == [(0, 1), (1, 4)]
    assert pairs(data, "test") == [(0, 2), (0, 3), (2, 0)]
    assert data.meta.split_rule == "time cut: train before 20 <= validation < 40 <= test"
    assert data.meta.source == [str(first), str(second)]


def test_side_columns_become_tower_features_from_each_ones_latest_row(tmp_path):
    """With a time cut, each one's latest row before T1, the table every split reads (a later
    row is the future of the validation or test period); one without such a row is unknown, a
    value of its own."""
    log = write_log(tmp_path / "log.tsv", [
        "user\titem\ttimestamp\tage\tgenre",  # a header: the timestamp column reads its name
        "a\tx\t3\t20\tdrama", "a\ty\t1\t18\tcomedy",  # user a's latest row (t 3) says 20
        "b\tx\t2\t30\tdrama", "c\ty\t5\t30\tcomedy", "b\tz\t9\t31\tdrama"])
    columns = ["--columns", "user,item,timestamp,user:age,item:genre"]
    result = preprocess([log], tmp_path / "out", *columns, "--split", "time", "--cut", "4,6")
    assert result.returncode == 0, failure(result)
    data = open_interactions(str(tmp_path / "out"))
    assert data.meta.positive == "every row"
    assert data.spec.feature_names == ["user_id", "user_age", "item_id", "item_genre"]
    assert data.meta.user_side == {"age": 3} and data.meta.item_side == {"genre": 3}
    # users a, b, c (2, 2, 1 rows); before t 4: ages 20, 30 (not b's 31 at t 9), c unknown
    assert data.user_side[:, 0].tolist() == [0, 1, 2]  # one user each: the values' order
    # items x, y, z; before t 4: drama, comedy (not y's t 5 row, also comedy), z unknown
    assert data.item_side[:, 0].tolist() == [1, 0, 2]  # comedy < drama < unknown
    assert (tmp_path / "out" / "users.txt").read_text().split() == ["a", "b", "c"]


def test_leave_last_out_side_features_come_from_before_each_users_held_out_rows(tmp_path):
    """A user's validation and test rows, and its rows after them, are the held-out period:
    its side features and those of items come from the rows before (a row-level side column
    such as the device would otherwise give training the test row's value)."""
    log = write_log(tmp_path / "log.tsv", [
        "user\titem\ttimestamp\tdevice\tgenre",
        "a\tx\t1\tphone\tdrama", "a\ty\t2\tphone\tdrama",  # a's train rows
        "a\tx\t3\tweb\tnoir", "a\tz\t4\tweb\tnoir",  # a's validation and test rows
        "b\ty\t5\tphone\tdrama", "b\tx\t6\tphone\tdrama", "b\tx\t7\tphone\tdrama",
        "b\ty\t8\ttv\tcomedy", "b\tx\t9\ttv\tthriller"])  # b: t 8 val, t 9 test
    result = preprocess([log], tmp_path / "out", "--columns",
                        "user,item,timestamp,user:device,item:genre")
    assert result.returncode == 0, failure(result)
    data = open_interactions(str(tmp_path / "out"))
    assert data.meta.samples == {"train": 5, "val": 2, "test": 2}
    # both users' rows before their held-out ones say phone (their latest rows: web, tv)
    assert data.meta.user_side == {"device": 1} and data.user_side[:, 0].tolist() == [0, 0]
    # x and y: drama before (latest: thriller, comedy); z only in a test row: unknown
    items = (tmp_path / "out" / "items.txt").read_text().split()
    genre = {item: data.item_side[items.index(item), 0] for item in items}
    assert data.meta.item_side == {"genre": 2}
    assert genre["x"] == genre["y"] != genre["z"]


def test_min_count_and_bad_rows_account_for_every_row(tmp_path):
    rng = np.random.default_rng(0)
    rows = [(f"u{u}", f"i{i}", int(r), t) for t, (u, i, r) in enumerate(zip(
        rng.zipf(1.5, 400) % 30, rng.zipf(1.3, 400) % 40, rng.integers(1, 6, 400)))]
    lines = [f"{u},{i},{r},{t}" for u, i, r, t in rows]
    lines[10:10] = ["u1,i2,4", ",i3,5,7", "u4,i5,five,8"]  # one bad row of each kind
    log = write_log(tmp_path / "log.csv", lines)
    result = preprocess([log], tmp_path / "out", "--columns", "user,item,rating,timestamp",
                        "--min-count", "5", "--skip-bad-rows", "--positive", "rating>3")
    assert result.returncode == 0, failure(result)
    data = open_interactions(str(tmp_path / "out"))
    extra = data.meta.extra
    positives = [(u, i) for u, i, r, _ in rows if r > 3]
    users = collections.Counter(u for u, _ in positives)
    items = collections.Counter(i for _, i in positives)
    kept = [(u, i) for u, i in positives if users[u] >= 5 and items[i] >= 5]
    assert (extra["wrong_field_count"], extra["empty_id"], extra["bad_number"]) == (1, 1, 1)
    assert extra["not_positive"] == len(rows) - len(positives)
    assert extra["below_min_count"] == len(positives) - len(kept)
    assert extra["dropped_users"] == len(users) - len({u for u, _ in kept})
    assert extra["dropped_items"] == len(items) - len({i for _, i in kept})
    written = sum(data.meta.samples.values())
    assert written == len(kept)
    assert extra["rows"] == 403 == written + 3 + extra["not_positive"] + extra["below_min_count"]
    # ids by decreasing count of kept positives
    counts = collections.Counter(u for u, _ in kept)
    raw_users = (tmp_path / "out" / "users.txt").read_text().split()
    raw_items = (tmp_path / "out" / "items.txt").read_text().split()
    assert [counts[u] for u in raw_users] == sorted(counts.values(), reverse=True)
    # train: all but each user's last two (timestamps are file order), stored shuffled
    left = {u: n - 2 if n >= 3 else n for u, n in counts.items()}
    oldest_first = []
    for u, i in kept:
        if left[u] > 0:
            oldest_first.append((u, i))
        left[u] -= 1
    stored = [(raw_users[u], raw_items[i]) for u, i in pairs(data, "train")]
    assert sorted(stored) == sorted(oldest_first) and stored != oldest_first


@pytest.mark.parametrize("line, message", [
    ("2,1,4", "3 fields, the layout has 4 (user,item,rating,timestamp)"),
    ("2,,4,5", "the item id is empty"),
    ("2,1,x,5", "the rating is 'x', not a finite number")])
def test_a_bad_row_is_named_by_file_and_line(tmp_path, line, message):
    log = write_log(tmp_path / "log.csv", ["user,item,rating,timestamp", "1,1,5,1", "1,2,5,2",
                                           line, "1,3,5,3"])
    result = preprocess([log], tmp_path / "out", "--columns", "user,item,rating,timestamp")
    assert result.returncode == 2
    assert f"error: {log}:4: {message}; correct the line, or pass --skip-bad-rows" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_an_empty_split_is_refused_and_nothing_is_written(tmp_path):
    log = write_layout(tmp_path / "log", "u.data")
    result = preprocess([log], tmp_path / "out", "--min-count", "2")  # 2 positives per user left
    assert result.returncode == 2
    assert "error: the val split is empty (leave-last-out" in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    result = preprocess([log], tmp_path / "out", "--split", "time", "--cut", "100,200")
    assert "error: the val split is empty (time cut" in result.stderr


@pytest.mark.parametrize("command", [["interactions", "--input", "log.csv"],
                                     ["impressions", "--impressions", "log.tsv"],
                                     ["yambda", "--generate", "100"],
                                     ["first-stage", "--retrieval", "r", "--ranking", "k",
                                      "--labels", "l.txt"]])
def test_a_negative_seed_is_one_line_before_any_reading(tmp_path, command):
    """It was numpy's traceback once the log was read."""
    result = run_cli(["preprocess", *command, "--output", str(tmp_path / "out"), "--seed", "-1"],
                     cwd=tmp_path)
    assert (result.returncode, result.stderr.strip().splitlines()) == \
        (2, ["error: --seed: 0 or more, got -1"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("delimiter", ['"', "a\nb"])
def test_a_delimiter_the_reader_cannot_take_is_one_line(tmp_path, delimiter):
    """A quote (the fields' quote character) or a line break was csv's or numpy's traceback."""
    log = write_log(tmp_path / "log.csv", ["u1,i1,5,1", "u1,i2,5,2", "u1,i3,5,3"])
    result = preprocess([log], tmp_path / "out", "--columns", "user,item,rating,timestamp",
                        "--delimiter", delimiter)
    assert (result.returncode, result.stderr.strip().splitlines()) == \
        (2, [f"error: --delimiter: {delimiter!r} holds a quote or a line break; give the "
             f"character(s) between fields, e.g. ',' or '::' or tab"])
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_not_overwritten(tmp_path):
    log = write_layout(tmp_path / "log", "u.data")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = preprocess([log], tmp_path / "out")
    assert result.returncode == 2 and "already exists" in result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_the_planted_ceiling_is_the_teachers_exact_ranking():
    cfg = DataConfig(users=60, items=50, interactions_per_user=8, seed=3)
    data = planted_interactions(cfg)
    u, v, log_pop, _, _ = teacher(cfg)
    scores = teacher_scores(cfg, u, v, log_pop)
    for split, seen in (("val", ("train",)), ("test", ("train", "val"))):
        ranks = []
        for user, target in zip(*data.pairs[split]):
            earlier = {i for s in seen for uu, i in zip(*data.pairs[s]) if uu == user}
            ranks.append(sum(scores[user, j] > scores[user, target]
                             for j in range(cfg.items) if j not in earlier))
        ranks = np.array(ranks)
        prefix = "val_" if split == "val" else ""
        for k in (10, 50):
            assert data.meta.extra[f"ceiling_{prefix}recall@{k}"] == round((ranks < k).mean(), 4)
        ndcg = np.where(ranks < 10, 1 / np.log2(ranks + 2.0), 0).mean()
        assert data.meta.extra[f"ceiling_{prefix}ndcg@10"] == round(ndcg, 4)
        assert data.meta.extra[f"ceiling_{prefix}mrr"] == round((1 / (ranks + 1.0)).mean(), 4)
    assert 0 < data.meta.extra["ceiling_recall@10"] < 1


def test_a_preprocessed_log_trains_checkpoints_and_resumes_only_on_itself(tmp_path):
    """A run on a `preprocess interactions` folder checkpoints (its identity is the log's),
    resumes on the same log, and refuses another log of the same shape."""
    rng = np.random.default_rng(0)

    def log(path: Path, seed_shift: int) -> Path:
        rows = [f"{u}\t{(u * 7 + k * 3 + seed_shift) % 40}\t5\t{k}" for u in range(30)
                for k in range(6)]
        rng.shuffle(rows)
        return write_log(path, rows)

    for name, shift in (("a", 0), ("b", 1)):
        result = preprocess([log(tmp_path / f"{name}.tsv", shift)], tmp_path / name,
                            "--columns", "user,item,rating,timestamp")
        assert result.returncode == 0, failure(result)
    settings = ["--set", "model.kind=two_tower", "--set", "data.global_batch_size=16",
                "--set", f"data.path={tmp_path / 'a'}", "--set", f"train.run_dir={tmp_path / 'run'}",
                "--set", "train.log_every=1", "--set", "model.embedding_dim=8",
                "--set", "model.user_tower.mlp=[8]", "--set", "model.item_tower.mlp=[8]"]
    first = run_cli(["train", *settings, "--set", "train.max_steps=3"])
    assert first.returncode == 0, failure(first)
    assert (tmp_path / "run" / "checkpoints" / "step_3").is_dir()
    assert "val_recall@10=" in first.stdout.strip().splitlines()[-1]
    again = run_cli(["train", *settings, "--set", "train.max_steps=5"])
    assert again.returncode == 0, failure(again)
    assert "(step 3)" in again.stdout and done_fields(again.stdout)["steps"] == 5
    other = run_cli(["train", *settings, "--set", "train.max_steps=7",
                     "--set", f"data.path={tmp_path / 'b'}"])
    assert other.returncode == 2 and "other file contents" in other.stderr, failure(other)


def test_synth_writes_the_planted_log_training_generates(tmp_path):
    data_cfg = DataConfig(users=50, items=40, interactions_per_user=5)
    result = run_cli(["synth", "--set", "model.kind=two_tower", "--set", "data.users=50",
                      "--set", "data.items=40", "--set", "data.interactions_per_user=5",
                      "--output", str(tmp_path / "log")])
    assert result.returncode == 0, failure(result)
    written, planted = open_interactions(str(tmp_path / "log")), planted_interactions(data_cfg)
    for split in ("train", "val", "test"):
        assert pairs(written, split) == pairs(planted, split)
    assert (written.item_side == planted.item_side).all()
    assert (written.user_side == planted.user_side).all()
    assert written.meta.extra == planted.meta.extra


def test_predict_and_bench_point_a_two_tower_user_to_their_tools(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    (served / "retrieval.yaml").write_text("dim: 8\n")
    result = run_cli(["predict", "--model", str(served), "--data", str(tmp_path / "x"),
                      "--out", str(tmp_path / "p.txt")])
    assert result.returncode == 2 and "retrieve --model" in result.stderr, failure(result)
    result = run_cli(["bench", "--config", "configs/two_tower_demo.yaml"])
    assert result.returncode == 2 and "benchmarks/retrieval.py" in result.stderr, failure(result)


@pytest.mark.parametrize("header", ["user_id,item_id", "userId,movieId", "customer_id,product_id",
                                    "uid,iid"])
def test_a_header_of_id_columns_is_skipped(tmp_path, header):
    rows = [f"u{u},i{(u + k) % 5}" for u in range(4) for k in range(3)]
    log = write_log(tmp_path / "log.csv", [header, *rows])
    result = preprocess([log], tmp_path / "out", "--columns", "user,item")
    assert result.returncode == 0, failure(result)
    data = open_interactions(str(tmp_path / "out"))
    assert data.meta.extra["rows"] == len(rows) == sum(data.meta.samples.values())
    for name, ids in (("users.txt", [f"u{u}" for u in range(4)]),
                      ("items.txt", [f"i{i}" for i in range(5)])):
        assert sorted((tmp_path / "out" / name).read_text().split()) == ids
    # without the header, the same rows: the first row is no header (ids are not names)
    result = preprocess([write_log(tmp_path / "rows.csv", rows)], tmp_path / "plain",
                        "--columns", "user,item")
    assert result.returncode == 0, failure(result)
    assert open_interactions(str(tmp_path / "plain")).meta.extra["rows"] == len(rows)


@pytest.mark.parametrize("text", ["", "\n\n", "user_id,item_id\n", "\ufeffuser,item\r\n"])
@pytest.mark.parametrize("labels", [[], ["--labels", "watched"]])
def test_an_empty_or_header_only_log_is_one_line(tmp_path, text, labels):
    log = tmp_path / "log.csv"
    log.write_bytes(text.encode())
    result = preprocess([log], tmp_path / "out", "--columns", "user,item", *labels)
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [
        f"error: {log}: no rows to read (empty, or a header line only); give a log of "
        f"interactions"]
    assert not list(tmp_path.glob("out*"))


def test_a_log_of_bad_rows_only_is_one_line(tmp_path):
    log = write_log(tmp_path / "log.csv", ["user,item,rating,timestamp", "u1,i1,x,1", "u2,i2"])
    result = preprocess([log], tmp_path / "out", "--columns", "user,item,rating,timestamp",
                        "--skip-bad-rows")
    assert result.returncode == 2 and "error: " + f"{log}: no rows to read (2 bad rows skipped)" \
        in result.stderr, failure(result)
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("name", ["ml-latest-small-ratings.csv", "ratings_2024.csv", "log.txt"])
def test_movielens_ratings_csv_is_told_by_its_header_under_any_name(tmp_path, name):
    written = write_layout(tmp_path / "log", "ratings.csv")
    renamed = written.rename(written.with_name(name))
    result = preprocess([renamed], tmp_path / "out")
    assert result.returncode == 0, failure(result)
    assert "done: users=3 items=5 train=4 val=2 test=2" in result.stdout
    data = open_interactions(str(tmp_path / "out"))
    assert set(pairs(data, "train")) == SPLITS["train"] and pairs(data, "test") == SPLITS["test"]


@pytest.mark.parametrize("header, sep", [("user,item,rating,timestamp", ","),
                                         ("timestamp\tuser_id\trating\titem_id", "\t"),
                                         ("User;Item;_;rating;timestamp", ";")])
def test_a_header_that_names_the_roles_is_the_roles(tmp_path, header, sep):
    """No --columns needed: each column's name is its role (a role, `_`, or an id column
    named as ids are), in the header's order."""
    roles = [{"user_id": "user", "item_id": "item"}.get(n, n.lower())
             for n in header.split(sep)]
    values = [{"user": u, "item": i, "rating": r, "timestamp": t, "_": "x"}
              for u, i, r, t in ROWS]
    log = write_log(tmp_path / "log.txt", [header] + [sep.join(str(v[role]) for role in roles)
                                                      for v in values])
    result = preprocess([log], tmp_path / "out")
    assert result.returncode == 0, failure(result)
    assert "done: users=3 items=5 train=4 val=2 test=2" in result.stdout
    data = open_interactions(str(tmp_path / "out"))
    assert set(pairs(data, "train")) == SPLITS["train"]
    assert pairs(data, "val") == SPLITS["val"] and pairs(data, "test") == SPLITS["test"]


@pytest.mark.parametrize("name, text", [
    ("ratings.csv", "user,item,score\n1,2,5\n"),  # MovieLens' name, another header
    ("log.csv", "user,rating,timestamp\n1,5,7\n"),  # a header of roles, but no item column
    ("ratings.csv", "1,2,5,7\n"),  # MovieLens' name, no header
    ("u.data", "1,2,5,7\n"),  # u.data's name, commas
    ("ratings.dat", "1::2::5\n"),  # ratings.dat's name, three fields
    ("ml-1m.dat", "1::2::5::7\n")])  # four numbers: a name of MovieLens' needed to say whose
def test_a_file_that_is_not_movielens_is_refused_whatever_its_name(tmp_path, name, text):
    log = tmp_path / name
    log.write_text(text)
    result = preprocess([log], tmp_path / "out")
    assert result.returncode == 2, failure(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {log}: not a MovieLens ratings file") and "--columns" in line
    assert not list(tmp_path.glob("out*"))


@pytest.mark.parametrize("raw, why", [
    (b"caf\xe9", "the user id b'caf\\xe9' is not UTF-8 text"),
    ("a\u2028b".encode(), "the user id 'a\\u2028b' holds a line break (U+2028)"),
    ("a\u0085b".encode(), "the user id 'a\\x85b' holds a line break (U+0085)"),
    (b"a\x0cb", "the user id 'a\\x0cb' holds a line break (U+000C)"),
    (b"a\rb", "the user id 'a\\rb' holds a line break (U+000D)")])  # once csv's traceback
def test_an_id_that_cannot_be_kept_exactly_is_refused_naming_its_line(tmp_path, raw, why):
    """users.txt/items.txt hold one id a line as UTF-8: an id that is not UTF-8 would be
    replaced (two such ids collide), one with a line break would split. Other ids are kept
    exactly, whatever their script."""
    kept = ["café", "日本", "a b", "Ω"]
    rows = [f"{u},i{k},5,{k}".encode() for u in kept for k in range(3)]
    log = tmp_path / "log.csv"
    log.write_bytes(b"\n".join([*rows[:4], raw + b",i1,5,9", *rows[4:]]) + b"\n")
    result = preprocess([log], tmp_path / "out", "--columns", "user,item,rating,timestamp")
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [
        f"error: {log}:5: {why}" + (" (save the log as UTF-8)" if "UTF-8" in why else "")
        + "; correct the line, or pass --skip-bad-rows to leave out such lines (counted)"]
    assert not list(tmp_path.glob("out*"))
    result = preprocess([log], tmp_path / "out", "--columns", "user,item,rating,timestamp",
                        "--skip-bad-rows")
    assert result.returncode == 0, failure(result)
    data = open_interactions(str(tmp_path / "out"))
    assert data.meta.extra["bad_id"] == 1 and data.meta.extra["rows"] == len(rows) + 1
    assert sum(data.meta.samples.values()) == len(rows)
    users = (tmp_path / "out" / "users.txt").read_bytes().decode("utf-8").split("\n")
    assert sorted(users) == sorted(["", *kept])  # each exactly, one a line


def test_mac_line_ends_are_lines_and_a_carriage_return_within_or_an_archive_is_named(tmp_path):
    """Classic Mac OS line ends (some spreadsheets still save CSV so) were csv's traceback."""
    plain = write_layout(tmp_path / "a", "ratings.csv")
    (tmp_path / "b").mkdir()
    mac = tmp_path / "b" / "ratings.csv"
    mac.write_bytes(plain.read_bytes().replace(b"\r\n", b"\r"))
    for log, out in ((plain, "plain"), (mac, "mac")):
        assert preprocess([log], tmp_path / out).returncode == 0
    assert [pairs(open_interactions(str(tmp_path / "mac")), s) for s in SPLITS] == \
        [pairs(open_interactions(str(tmp_path / "plain")), s) for s in SPLITS]
    packed = tmp_path / "ratings.csv.gz"  # once a line of binary named as a bad user id
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    result = preprocess([packed], tmp_path / "out", "--skip-bad-rows")
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [
        f"error: {packed}: a gzip archive, not a text log; extract the log from it and give "
        f"that"])
    side = tmp_path / "side.csv"  # a carriage return inside a line: a bad row, named
    side.write_bytes(b"u1,i1,a\rb,1\nu1,i2,c,2\nu1,i3,c,3\n")
    result = preprocess([side], tmp_path / "out", "--columns", "user,item,item:genre,timestamp")
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [
        f"error: {side}:1: the item:genre value 'a\\rb' holds a line break (U+000D); correct "
        f"the line, or pass --skip-bad-rows to leave out such lines (counted)"])


def test_a_partial_folder_is_removed_only_when_a_stopped_run_made_it(tmp_path):
    log = write_layout(tmp_path / "log", "u.data")
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    result = preprocess([log], tmp_path / "out")
    assert result.returncode == 2, failure(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {partial}: exists and is not a stopped preprocess "
                           f"interactions's work") and "move or remove it" in line
    assert [p.name for p in partial.iterdir()] == ["notes.txt"] and not (tmp_path / "out").exists()
    (partial / ".dlrm_hybrid_partial").write_text("export --retrieval\n")  # another command's
    assert preprocess([log], tmp_path / "out").returncode == 2 and partial.exists()
    (partial / ".dlrm_hybrid_partial").write_text("preprocess interactions\n")  # a stopped run's
    result = preprocess([log], tmp_path / "out")
    assert result.returncode == 0, failure(result)
    assert not partial.exists() and not (tmp_path / "out" / ".dlrm_hybrid_partial").exists()


# The issue's log: u1 watches a again after b and c, so a is in u1's train and test split
REWATCH = ["u1,a,5,1", "u1,b,5,2", "u1,c,5,3", "u1,a,5,4",
           "u2,b,5,1", "u2,c,5,2", "u2,d,5,3", "u2,e,5,4"]
TINY_TWO_TOWER = ["--set", "model.kind=two_tower", "--set", "model.embedding_dim=4",
                  "--set", "model.user_tower.mlp=[4]", "--set", "model.item_tower.mlp=[4]",
                  "--set", "train.log_every=1", "--set", "optim.embedding=sgd",
                  "--set", "train.eval_every=0"]


def test_a_held_out_item_the_user_engaged_with_before_is_not_one_to_find(tmp_path):
    """Serving never returns a user's earlier items, so evaluation does not count a re-watch:
    u1's test item a is in its train split, and only u2 is evaluated on test."""
    result = preprocess([write_log(tmp_path / "log.csv", REWATCH)], tmp_path / "data",
                        "--columns", "user,item,rating,timestamp")
    assert result.returncode == 0, failure(result)
    assert "train=4 val=2 test=2" in result.stdout
    run = tmp_path / "run"
    result = run_cli(["train", *TINY_TWO_TOWER, "--set", f"data.path={tmp_path / 'data'}",
                      "--set", "data.global_batch_size=4", "--set", "train.max_steps=1",
                      "--set", f"train.run_dir={run}"])
    assert result.returncode == 0, failure(result)
    [evaluation] = [e for e in read_metrics(run) if "val_mrr" in e]
    assert evaluation["users"] == 2  # validation: c and d are new to u1 and u2
    result = run_cli(["eval", "--checkpoint", str(run / "checkpoints" / "step_1"),
                      "--split", "test"])
    assert result.returncode == 0, failure(result)
    assert " users=1" in result.stdout.strip().splitlines()[-1], result.stdout


def test_every_training_row_is_read_once_an_epoch(tmp_path):
    """10 training rows, each the only engagement of its item, in global batches of 4: in 5
    steps (2 epochs) every row is trained, and each again after step 1 (no row is left in an
    epoch's partial last batch). An item's table row moves only in a step whose batch holds it."""
    import torch

    from dlrm_hybrid.train.inference import read_model_state

    rows = [f"u{u},{item},5,{t}" for u in range(10)
            for t, item in enumerate((f"own{u}", "shared_val", "shared_test"))]
    result = preprocess([write_log(tmp_path / "log.csv", rows)], tmp_path / "data",
                        "--columns", "user,item,rating,timestamp")
    assert result.returncode == 0 and "train=10 val=10 test=10" in result.stdout, failure(result)
    run = tmp_path / "run"
    result = run_cli(["train", *TINY_TWO_TOWER, "--set", f"data.path={tmp_path / 'data'}",
                      "--set", "data.global_batch_size=4", "--set", "train.max_steps=5",
                      "--set", "checkpoint.every=1", "--set", "checkpoint.keep=5",
                      "--set", "retrieval.logq=false", "--set", f"train.run_dir={run}"])
    assert result.returncode == 0, failure(result)
    first, last = (read_model_state(run / "checkpoints" / f"step_{s}") for s in (1, 5))
    [key] = [k for k in first if "item_id" in k and k.endswith("weight")]
    moved = (first[key] != last[key]).any(dim=1)
    own = torch.arange(2, 12)  # the 10 training items (ids 0, 1: the shared ones, 10 each)
    assert moved[own].all(), moved
