"""`preprocess impressions` (data/interactions/impression_dataset.py): every impression is one
row with its label and raw ids back through the saved vocabulary, its dense features are
`features_before`'s and read nothing at or after the row's time, the splits follow time with
requests whole, a bad log is one line with nothing written, and a DLRM trains and predicts on
the result through the CLI."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import failure, run_cli
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.interactions.impression_dataset import read_vocabulary
from dlrm_hybrid.serve.impressions import (QUERY_KINDS, Impressions, concat, read_impressions,
                                           write_impressions)
from dlrm_hybrid.serve.memboost import POSITIONS
from dlrm_hybrid.serve.memboost_features import features_before

SPLITS = ("train", "validation", "test")
RANKER = """
model: {embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}
data: {global_batch_size: 32}
optim: {embedding: rowwise_adagrad, embedding_lr: 0.1, dense: adagrad, dense_lr: 0.05}
train: {max_steps: 12, log_every: 12, eval_every: 0, progress_bar: false}
checkpoint: {resume: none}
"""


def tiny_log(seed: int = 0, requests: int = 60, first: int = 0, per: int = 4,
             queries: int = 6) -> Impressions:
    """`requests` requests at times first, first + 1, ... of a few users and item queries over
    10 items, a fifth in random order; position 60 sometimes (past POSITIONS); engagements 0,
    0.5, 1 or 2 (a weighted sum: any above 0 is a click)."""
    rng = np.random.default_rng(seed)
    parts = []
    for r in range(first, first + requests):
        q = int(rng.integers(queries))
        kind, query = ("item", f"{q},{q + 1}") if q % 3 == 0 else ("user", f"u{q}")
        items = rng.choice(10, per, replace=False)
        positions = np.arange(1, per + 1)
        if r % 7 == 0:
            positions[-1] = 60
        n = per
        parts.append(Impressions(
            np.full(n, f"r{r}"), np.full(n, float(r)), np.full(n, QUERY_KINDS.index(kind), np.int8),
            np.full(n, query), np.array([f"i{i}" for i in items]), positions.astype(np.int32),
            np.full(n, rng.random() < 0.2), (rng.random(n) < 0.4) * rng.choice([0.5, 1, 2], n)))
    return concat(parts)


def preprocess(tmp_path: Path, logs, *args: str, out: str = "data", ok: bool = True):
    paths = []
    for n, log in enumerate(logs):
        paths += ["--impressions", str(tmp_path / f"log{n}.tsv")]
        write_impressions(paths[-1], log)
    result = run_cli(["preprocess", "impressions", *paths, "--output", str(tmp_path / out),
                      *args])
    if ok:
        assert result.returncode == 0, failure(result)
    return result


def read_split(folder: Path, split: str):
    """(labels, dense [N, 3] float16, categorical [N, 3]) of one split."""
    fspec = load_feature_spec(str(folder))
    files = fspec.splits[split]
    labels = np.fromfile(files.label, np.int8)
    dense = np.fromfile(files.numerical, np.float16).reshape(-1, fspec.spec.num_dense)
    cats = np.stack([np.fromfile(p, d) for p, d in zip(files.categorical,
                                                      fspec.categorical_dtypes)], 1)
    return labels, dense, cats.astype(np.int64)


def raw_rows(folder: Path):
    """Every row of every split as (split, kind, query, item, position id, label, features)."""
    queries, items = read_vocabulary(str(folder))
    query_of = {v: k for k, v in queries.items()}
    item_of = {v: k for k, v in items.items()}
    rows = []
    for split in SPLITS:
        labels, dense, cats = read_split(folder, split)
        for label, d, (q, i, p) in zip(labels.tolist(), dense.tolist(), cats.tolist()):
            rows.append((split, *query_of[q], item_of[i], p, label, tuple(d)))
    return rows


def expected_rows(log: Impressions, prior: float = 1.0):
    """The log's rows as raw_rows gives them, without the split, features from features_before."""
    dense = features_before(log, log.kind, log.query, log.item, log.time, prior)
    dense = dense.astype(np.float16).astype(np.float64)
    return Counter((QUERY_KINDS[k], q, i, min(p, POSITIONS) - 1, int(c > 0), tuple(d))
                   for k, q, i, p, c, d in zip(log.kind.tolist(), log.query.tolist(),
                                               log.item.tolist(), log.position.tolist(),
                                               log.clicked.tolist(), dense.tolist()))


def test_every_impression_is_one_row_with_its_label_ids_and_features_before_it(tmp_path):
    """Two logs and a clicks file: rows out = rows in, each with its raw ids (vocabulary), its
    label (clicked > 0, the clicks joined) and features_before's features at --prior 2."""
    early, late = tiny_log(0, 40), tiny_log(1, 20, first=40)
    (tmp_path / "clicks.tsv").write_text(f"r41\t{late.item[4]}\n")
    clicked = late.clicked.copy()
    clicked[4] += 1
    joined = Impressions(late.request, late.time, late.kind, late.query, late.item,
                         late.position, late.random, clicked)
    done = preprocess(tmp_path, [early, late], "--clicks", str(tmp_path / "clicks.tsv"),
                      "--prior", "2")
    assert "done: rows=240 train=192 validation=24 test=24" in done.stdout
    got = raw_rows(tmp_path / "data")
    want = expected_rows(concat([early, joined]), prior=2.0)
    assert Counter(r[1:] for r in got) == want
    assert sum(1 for r in got if r[-1][1] > 0) > 100  # most rows have a pair history
    assert {r[4] for r in got} >= {0, 1, 2, POSITIONS - 1}  # position 60 in the last bucket


def test_no_feature_reads_an_impression_at_or_after_its_row(tmp_path):
    """Every impression from the first test request's time on clicked, at reversed positions,
    in random order: train and validation are the same bytes, and so are the first test
    request's features; its labels change (the change is seen)."""
    log = tiny_log(2, 50)
    preprocess(tmp_path, [log], out="before")
    cut = 45.0  # 50 requests: train 0-39, validation 40-44, test 45-49
    later = log.time >= cut
    changed = Impressions(log.request, log.time, log.kind, log.query, log.item,
                          np.where(later, 61 - log.position, log.position).astype(np.int32),
                          log.random | later, np.where(later, 1.0, log.clicked))
    (tmp_path / "changed").mkdir()
    preprocess(tmp_path / "changed", [changed], out="after")
    before, after = tmp_path / "before", tmp_path / "changed" / "after"
    for split in ("train", "validation"):
        for a, b in zip(read_split(before, split), read_split(after, split)):
            assert np.array_equal(a, b), split
    assert read_vocabulary(str(before)) == read_vocabulary(str(after))
    (l0, d0, c0), (l1, d1, c1) = read_split(before, "test"), read_split(after, "test")
    first = [d[np.argsort(c[:4, 1])] for d, c in ((d0, c0), (d1, c1))]  # by item: the
    assert np.array_equal(*first) and (first[0] != 0).any()  # positions were changed
    assert not np.array_equal(l0, l1)


def test_splits_follow_time_and_keep_requests_whole(tmp_path):
    """Each request its own query (its number): a request's rows are in one split, in a row,
    in position order; train's requests are all earlier than validation's, validation's than
    test's; 0.2 and 0.1 of 30 requests."""
    rng = np.random.default_rng(3)
    times = rng.permutation(30).astype(float)  # the file's order is not time's
    parts = [Impressions(np.full(3, f"r{n}"), np.full(3, t), np.zeros(3, np.int8),
                         np.full(3, f"{int(t)}"), np.array(["a", "b", "c"]),
                         np.array([3, 1, 2], np.int32), np.zeros(3, bool), np.zeros(3))
             for n, t in enumerate(times)]
    done = preprocess(tmp_path, [concat(parts)], "--val-fraction", "0.2", "--test-fraction",
                      "0.1")
    assert "done: rows=90 train=63 validation=18 test=9" in done.stdout
    queries, _ = read_vocabulary(str(tmp_path / "data"))
    time_of = {v: int(k[1]) for k, v in queries.items()}
    spans = []
    for split in SPLITS:
        _, _, cats = read_split(tmp_path / "data", split)
        requests = [time_of[q] for q in cats[::3, 0]]
        assert cats[:, 0].tolist() == np.repeat(cats[::3, 0], 3).tolist()
        assert cats[:, 2].tolist() == [0, 1, 2] * len(requests)
        spans.append(requests)
    assert sorted(spans[0]) == list(range(21)) and spans[0] != list(range(21))  # shuffled
    assert spans[1] == list(range(21, 27)) and spans[2] == list(range(27, 30))


@pytest.mark.parametrize("text, says", [
    ("r1\t1\tuser\tu1\ta\tx\t0\t0\n", "log0.tsv row 3 column position: 'x' is not"),
    ("r0\t0\tuser\tu1\ta\t2\t0\t0\n", "log0.tsv row 3 column position: request 'r0' shows two"),
    ("r1\t1\tuser\tu1\ta\t1\t0\tNaN\n", "log0.tsv row 3 column clicked"),
])
def test_a_bad_log_is_one_line_and_nothing_is_written(tmp_path, text, says):
    (tmp_path / "log0.tsv").write_text(
        "request\ttime\tquery_kind\tquery\titem\tposition\trandom\tclicked\n"
        "r0\t0\tuser\tu1\tb\t2\t0\t1\n" + text)
    result = run_cli(["preprocess", "impressions", "--impressions", str(tmp_path / "log0.tsv"),
                      "--output", str(tmp_path / "data")])
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log0.tsv"]


def test_the_same_log_twice_an_output_over_an_input_and_no_train_are_refused(tmp_path):
    log = tiny_log(4, 10)
    write_impressions(str(tmp_path / "a.tsv"), log)
    (tmp_path / "b.tsv").write_bytes((tmp_path / "a.tsv").read_bytes())
    flags = ["preprocess", "impressions", "--impressions", str(tmp_path / "a.tsv")]
    for args, says in (
            (["--impressions", str(tmp_path / "b.tsv"), "--output", str(tmp_path / "d")],
             "b.tsv row 2 column request: request 'r0' is in"),
            (["--output", str(tmp_path / "a.tsv")], "--output"),
            (["--impressions", str(tmp_path / "a.tsv"), "--output", str(tmp_path / "d")],
             "a.tsv row 2 column request: request 'r0' is in"),  # once every row twice
            (["--output", str(tmp_path / "d"), "--val-fraction", "0.5", "--test-fraction",
              "0.5"], "leave no request for train"),
            (["--output", str(tmp_path / "d"), "--test-fraction", "0.01"],  # once an empty test
             "--test-fraction 0.01 of 10 requests is none; give a larger share")):
        result = run_cli(flags + args)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.tsv", "b.tsv"]
    assert read_impressions(str(tmp_path / "a.tsv")).clicked.tolist() == log.clicked.tolist()


def test_a_dlrm_trains_on_it_and_predict_scores_its_test_split(tmp_path):
    preprocess(tmp_path, [tiny_log(5, 60)])
    (tmp_path / "r.yaml").write_text(RANKER)
    for args in (["train", "--config", str(tmp_path / "r.yaml"), "--set",
                  f"data.path={tmp_path / 'data'}", "--set", f"train.run_dir={tmp_path / 'run'}"],
                 ["export", "--checkpoint", str(tmp_path / "run/checkpoints/step_12"), "--out",
                  str(tmp_path / "M.pt")],
                 ["predict", "--model", str(tmp_path / "M.pt"), "--data", str(tmp_path / "data"),
                  "--split", "test", "--out", str(tmp_path / "p.csv")]):
        result = run_cli(args)
        assert result.returncode == 0, failure(result)
    assert "samples=24 auc=" in result.stdout
    scores = np.loadtxt(tmp_path / "p.csv")
    assert scores.shape == (24,) and ((scores > 0) & (scores < 1)).all()
