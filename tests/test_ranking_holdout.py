"""`preprocess interactions --labels ... --holdout DIR`: the validation and test pairs of DIR (the
retrieval dataset of the same log) are in no split of the ranking dataset and never a negative."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import done_fields, failure, run_cli

# user, item, rating, timestamp: six users rate 7 of the items i0..i9 each, 4 of them >= 4 (the
# retrieval dataset's positives: its validation and test are each user's last two); user a's
# last positive is `solo`, an item no one else rated.
RATINGS = (5, 4, 2, 4, 1, 5, 3)
LOG = [(u, f"i{(n + 3 * k) % 10}", RATINGS[k], 10 * k + n)
       for n, u in enumerate("abcdef") for k in range(7)] + [("a", "solo", 5, 999)]
LABELS = ("--labels", "watched,liked:rating>=4", "--ranking-negatives", "4")


def write_log(path, rows) -> str:
    path.write_text("".join(",".join(map(str, row)) + "\n" for row in rows))
    return str(path)


def preprocess(log: str, out, *more: str):
    return run_cli(["preprocess", "interactions", "--input", log, "--columns",
                    "user,item,rating,timestamp", "--output", str(out), *more])


def split_pairs(folder: str, split: str):
    """((user, item) raw ids of each engagement, of each negative) of a split, in row order."""
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    users = (Path(folder) / "users.txt").read_text().split()
    items = (Path(folder) / "items.txt").read_text().split()
    data = SplitBinaryDataset(folder)
    data.use_tasks(list(data.label_names), folder)
    c = data.columns(split, 0, data.num_samples(split))
    pairs = [(users[u], items[i]) for u, i in zip(c.ids[0][:, 0], c.ids[1][:, 0])]
    engaged = c.labels[:, 0] == 1
    return ([p for p, e in zip(pairs, engaged) if e], [p for p, e in zip(pairs, engaged) if not e])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The log, its retrieval dataset and its ranking dataset with --holdout."""
    root = tmp_path_factory.mktemp("holdout")
    log = write_log(root / "log.csv", LOG)
    result = preprocess(log, root / "retrieval")
    assert result.returncode == 0, failure(result)
    result = preprocess(log, root / "ranking", *LABELS, "--holdout", str(root / "retrieval"))
    assert result.returncode == 0, failure(result)
    return root, result.stdout


def held_pairs(retrieval: Path) -> set:
    """The (user, item) raw ids of a retrieval dataset's validation and test pairs."""
    users = (retrieval / "users.txt").read_text().split()
    items = (retrieval / "items.txt").read_text().split()
    return {(users[u], items[i]) for s in ("val", "test")
            for u, i in zip(np.load(retrieval / f"{s}_user.npy"),
                            np.load(retrieval / f"{s}_item.npy"))}


def test_held_out_pairs_are_in_no_split_and_train_negatives_do_not_mark_them(made):
    """Held pairs are in no split and never a validation or test negative; train negatives are
    never a train engagement, and draw an evaluation item (a held pair, the dataset's own
    validation and test) as often as any other item: never drawing them would mark each
    user's evaluation items as the ones a trained ranker never saw as negatives (a leak)."""
    root, stdout = made
    held = held_pairs(root / "retrieval")
    assert len(held) == 12 and ("a", "solo") in held  # each user's last two positives
    engagements, negatives = {}, {}
    for split in ("train", "val", "test"):
        engagements[split], negatives[split] = split_pairs(str(root / "ranking"), split)
    everything = [p for rows in engagements.values() for p in rows]
    assert sorted(everything) == sorted((u, i) for u, i, _, _ in LOG if (u, i) not in held)
    logged = {(u, i) for u, i, _, _ in LOG}
    assert not (held | logged) & set(negatives["val"] + negatives["test"])
    train_negatives = set(negatives["train"])
    assert not set(engagements["train"]) & train_negatives
    evaluation = held | set(engagements["val"]) | set(engagements["test"])
    catalogue = {i for _, i, _, _ in LOG}
    others = {(u, i) for u in "abcdef" for i in catalogue} - logged
    drawn = {name: len(pairs & train_negatives) / len(pairs)
             for name, pairs in (("evaluation", evaluation), ("others", others))}
    assert drawn["others"] > 0.5 and abs(drawn["evaluation"] - drawn["others"]) < 0.2, drawn
    assert sum(map(len, negatives.values())) == 4 * len(everything)
    done = done_fields(stdout)  # rows out = rows in - held-out rows
    assert (done["rows"], done["kept"], done["held_out"]) == (len(LOG), len(LOG) - 12, 12)
    meta = yaml.safe_load((root / "ranking" / "feature_spec.yaml").read_text())["metadata"]
    assert meta["holdout"]["rows"] == 12 and meta["rows"]["held_out"] == 12
    assert meta["holdout"]["dataset"] == str(root / "retrieval")
    assert "12 held out" in stdout


def test_the_rows_left_are_split_leave_last_out_and_every_item_keeps_an_id(made):
    root, _ = made
    held = held_pairs(root / "retrieval")
    left = [(t, u, i) for u, i, _, t in LOG if (u, i) not in held]
    for split, place in (("test", -1), ("val", -2)):  # each user's last, and last but one, left
        got, _ = split_pairs(str(root / "ranking"), split)
        assert sorted(got) == [(u, sorted((t, i) for t, v, i in left if v == u)[place][1])
                               for u in "abcdef"]
    assert "solo" in (root / "ranking" / "items.txt").read_text().split()  # rated only in test


@pytest.fixture(scope="module")
def other_logs(made, tmp_path_factory):
    """Retrieval datasets of other logs: other user names; the same names, other pairs."""
    root = tmp_path_factory.mktemp("other")
    logs = {"names": [(u.upper(), i, r, t) for u, i, r, t in LOG],
            "pairs": [(u, f"i{(int(i[1:]) + 2) % 10}" if i != "solo" else i, r, t)
                      for u, i, r, t in LOG]}
    for name, rows in logs.items():
        result = preprocess(write_log(root / f"{name}.csv", rows), root / name)
        assert result.returncode == 0, failure(result)
    return root


@pytest.mark.parametrize("holdout, labels, says", [
    ("nowhere", True, "--holdout {}: not found; give the retrieval dataset"),
    ("ranking", True, "--holdout {}: not a retrieval dataset (no interactions.yaml)"),
    ("names", True, "--holdout {}: user 'A' of its validation/test pairs is not in this log"),
    ("pairs", True, "--holdout {}: 11 of its 12 validation/test pairs are not rows of this log"),
    ("retrieval", False, "--holdout: for a ranking dataset; give --labels too")])
def test_bad_holdout_is_one_line(made, other_logs, tmp_path, holdout, labels, says):
    root, _ = made
    folder = next((str(base / holdout) for base in (root, other_logs)
                   if (base / holdout).exists()), str(root / holdout))
    result = preprocess(str(root / "log.csv"), tmp_path / "out", *(LABELS if labels else ()),
                        "--holdout", folder)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {says.format(folder)}"), result.stderr
    assert not (tmp_path / "out").exists()
