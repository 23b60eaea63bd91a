"""Yambda's input (data/yambda/): the listen_plus label on hand-made rows, the split global in
time, each row's history strictly before it with its actions, rows out = listens in, bad parquet
refused in one line with nothing written, bad rows counted, the generator's files and dtypes,
multi_event and the per-event files giving the same dataset, and the ranker training on a
generated log with model.sequence=hstu."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import failure, run_cli
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.yambda.events import EVENT_FILES
from dlrm_hybrid.data.yambda.preprocess import partitions_for
from dlrm_hybrid.data.yambda.rules import action_bits, listen_plus

# uid, item_id, timestamp (days: --time-unit 86400), event_type, played_ratio_pct; the log ends
# at day 9, so day 9 is test and day 8 validation (--val-days 1 --test-days 1). Not in time order;
# ties kept in file order (user 1's listen of 11 before its like at day 0; user 2's like of 12
# before its listen at day 3)
LOG = [(2, 14, 9, "listen", 55), (1, 13, 4, "listen", 75), (1, 10, 0, "listen", 49),
       (1, 11, 0, "listen", 50), (1, 11, 0, "like", None), (2, 12, 3, "like", None),
       (2, 10, 1, "listen", 100), (1, 12, 2, "dislike", None), (2, 12, 3, "listen", 0),
       (1, 10, 8, "listen", 20), (2, 11, 5, "like", None), (1, 11, 6, "unlike", None),
       (2, 13, 7, "listen", 60), (2, 12, 8, "undislike", None), (1, 14, 9, "listen", 99),
       (1, 15, 9, "like", None)]
BITS = {"like": 2, "dislike": 4, "unlike": 8, "undislike": 16}
SLOTS = 3
DAYS = ["--time-unit", "86400", "--val-days", "1", "--test-days", "1"]


def multi_event(rows, **overrides) -> pa.Table:
    columns = {"uid": pa.array([r[0] for r in rows], pa.uint32()),
               "item_id": pa.array([r[1] for r in rows], pa.uint32()),
               "timestamp": pa.array([r[2] for r in rows], pa.uint32()),
               "is_organic": pa.array([1] * len(rows), pa.uint8()),
               "event_type": pa.array([r[3] for r in rows], pa.string()),
               "played_ratio_pct": pa.array([r[4] for r in rows], pa.uint16()),
               "track_length_seconds": pa.array([200 if r[3] == "listen" else None
                                                 for r in rows], pa.uint32())}
    columns.update(overrides)
    return pa.table({k: v for k, v in columns.items() if v is not None})


def preprocess(log_dir: Path, out: Path, *extra: str):
    return run_cli(["preprocess", "yambda", "--input", str(log_dir), "--output", str(out),
                    *extra])


def read_rows(folder: Path) -> dict:
    """split -> (user raw, item raw, label, time, [(history item raw, action)...]) per row."""
    fspec = load_feature_spec(str(folder))
    users = (folder / "users.txt").read_text().split()
    items = (folder / "items.txt").read_text().split()
    names = fspec.notes["categorical_features"]
    out = {}
    for split, files in fspec.splits.items():
        cats = {n: np.fromfile(p, d) for n, p, d in zip(names, files.categorical,
                                                        fspec.categorical_dtypes)}
        labels = np.fromfile(files.labels[0], np.int8)
        times = np.fromfile(folder / split / "timestamp.bin", np.uint32)
        slots = sum(n.startswith("user_history") for n in names)
        out[split] = [(int(users[cats["user_id"][k]]), int(items[cats["item_id"][k]]),
                       int(labels[k]), int(times[k]),
                       [(int(items[cats[f"user_history{j}"][k]]), int(cats[f"user_action{j}"][k]))
                        for j in range(slots) if cats[f"user_action{j}"][k]])
                      for k in range(len(labels))]
    return out


def expected_history(row: int) -> list:
    """(item, action) of the user's last SLOTS events before LOG[row], by time then file order."""
    order = sorted(range(len(LOG)), key=lambda r: (LOG[r][2], r))
    mine = [r for r in order if LOG[r][0] == LOG[row][0]]
    earlier = mine[:mine.index(row)][-SLOTS:]
    return [(LOG[r][1], 1 + (BITS.get(LOG[r][3], 0) if LOG[r][3] != "listen"
                             else int(LOG[r][4] >= 50))) for r in earlier]


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory):
    root = tmp_path_factory.mktemp("yambda")
    (root / "log").mkdir()
    pq.write_table(multi_event(LOG), root / "log" / "multi_event.parquet")
    result = preprocess(root / "log", root / "data", "--history", str(SLOTS), *DAYS)
    assert result.returncode == 0, failure(result)
    return read_rows(root / "data"), result.stdout


def test_listen_plus_is_a_listen_played_at_least_half():
    kind = np.array([0, 0, 0, 1, 2])  # listen, listen, listen, like, dislike
    played = np.array([49, 50, 100, 90, 90])
    assert listen_plus(kind, played, 50).tolist() == [False, True, True, False, False]
    bits = action_bits(np.array([0, 0, 1, 2, 3, 4]), np.array([0, 1, 0, 0, 0, 0], bool))
    assert (1 + bits @ (1 << np.arange(5))).tolist() == [1, 2, 3, 5, 9, 17]


def test_each_listen_is_one_row_with_its_label_and_history_before_it(hand_made):
    rows, _ = hand_made
    listens = [r for r in range(len(LOG)) if LOG[r][3] == "listen"]
    got = [row for split in ("train", "validation", "test") for row in rows[split]]
    assert len(got) == len(listens)  # rows out = listens in
    by_key = {(u, i, t): (label, history) for u, i, label, t, history in got}
    for r in listens:
        uid, item, when, _, played = LOG[r]
        assert by_key[(uid, item, when)] == (int(played >= 50), expected_history(r)), LOG[r]


def test_the_split_is_global_in_time(hand_made):
    rows, stdout = hand_made
    times = {split: [t for _, _, _, t, _ in rows[split]] for split in rows}
    assert set(times["test"]) == {9} and set(times["validation"]) == {8}
    assert max(times["train"]) < min(times["validation"]) <= max(times["validation"]) < \
        min(times["test"])
    for split in times:  # each split in time order, for a loader that streams it
        assert times[split] == sorted(times[split])
    assert "done: events=16 kept=16 skipped=0 train=6 validation=1 test=2" in stdout


def test_listens_in_the_30_minutes_before_validation_and_test_are_in_no_split(tmp_path):
    """Yambda's Global Temporal Split in its own units (seconds) and defaults (one day of test,
    one of validation, 30-minute gaps), on the seconds around each cut."""
    day, gap, end = 86400, 1800, 10 * 86400  # the last listen at end - 1
    test, val = end - day, end - day - gap - day
    times = [0, val - gap - 1, val - gap, val - 1, val, test - gap - 1, test - gap, test - 1,
             test, end - 1]
    (tmp_path / "log").mkdir()
    pq.write_table(multi_event([(1, 10 + k, t, "listen", 80) for k, t in enumerate(times)]),
                   tmp_path / "log" / "multi_event.parquet")
    result = preprocess(tmp_path / "log", tmp_path / "data")
    assert result.returncode == 0, failure(result)
    rows = read_rows(tmp_path / "data")
    assert [t for _, _, _, t, _ in rows["train"]] == [0, val - gap - 1]
    assert [t for _, _, _, t, _ in rows["validation"]] == [val, test - gap - 1]
    assert [t for _, _, _, t, _ in rows["test"]] == [test, end - 1]
    assert "gaps       4 listens between the splits, in none" in result.stdout
    report = json.loads((tmp_path / "data" / "preprocess_report.json").read_text())
    assert report["listens_in_gaps"] == 4 and sum(report["rows"].values()) + 4 == len(times)


def test_bad_rows_are_counted_and_skipped(tmp_path):
    rows = LOG + [(3, 10, 2, "listen", 70), (3, 11, 3, "listen", 70), (3, 12, 4, "skip", None),
                  (4, 10, 5, "listen", None), (5, 10, 5, "listen", 70), (6, 10, 5, "like", 0),
                  (7, 10, 5, "listen", 70)]
    items = [r[1] for r in LOG] + [None, 11, 12, 10, None, -1, 10]  # two problems: counted once
    uids = [r[0] for r in LOG] + [3, None, 3, 4, None, 6, 7]
    organic = [1] * (len(rows) - 1) + [300]  # beyond is_organic's uint8: once stored as 44
    (tmp_path / "log").mkdir()
    pq.write_table(multi_event(rows, item_id=pa.array(items, pa.int64()),
                               uid=pa.array(uids, pa.uint32()),
                               is_organic=pa.array(organic, pa.int16())),
                   tmp_path / "log" / "multi_event.parquet")
    result = preprocess(tmp_path / "log", tmp_path / "data", *DAYS)
    assert result.returncode == 0, failure(result)
    import json

    report = json.loads((tmp_path / "data" / "preprocess_report.json").read_text())
    assert report["bad_rows"] == {"null_uid": 2, "null_item_id": 1, "null_timestamp": 0,
                                  "null_played_ratio": 1, "unknown_event_type": 1,
                                  "out_of_range": 2}
    assert report["events_read"] == len(rows) and report["events_kept"] == len(LOG)
    assert sum(report["rows"].values()) == sum(r[3] == "listen" for r in LOG)


BAD = {
    "missing column": (lambda d: pq.write_table(multi_event(LOG, is_organic=None),
                                                d / "multi_event.parquet"),
                       "has no column is_organic"),
    "wrong type": (lambda d: pq.write_table(multi_event(
        LOG, timestamp=pa.array([str(r[2]) for r in LOG])), d / "multi_event.parquet"),
        "column timestamp is string, not an integer"),
    "empty file": (lambda d: (d / "multi_event.parquet").write_bytes(b""), "is empty (0 bytes)"),
    "not parquet": (lambda d: (d / "multi_event.parquet").write_text("uid,item_id\n1,2\n"),
                    "is not a parquet file"),
    "no listens file": (lambda d: pq.write_table(multi_event(LOG), d / "likes.parquet"),
                        "has neither multi_event.parquet nor listens.parquet"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_parquet_is_one_line_and_nothing_is_written(tmp_path, case):
    make, message = BAD[case]
    (tmp_path / "log").mkdir()
    make(tmp_path / "log")
    result = preprocess(tmp_path / "log", tmp_path / "data", *DAYS)
    assert result.returncode == 2, failure(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]  # no output, no partial


def test_a_memory_limit_sets_the_partitions_and_too_small_a_one_is_refused(tmp_path):
    assert partitions_for(1000, 512 << 20) == 1  # fits: in memory
    assert partitions_for(10 ** 6, (256 + 100) << 20) == 2  # 200 MB of events, 100 MiB a share
    (tmp_path / "log").mkdir()
    pq.write_table(multi_event(LOG), tmp_path / "log" / "multi_event.parquet")
    result = preprocess(tmp_path / "log", tmp_path / "data", *DAYS, "--memory-limit", "300M")
    assert result.returncode == 2 and "--memory-limit: 300M leaves under 64 MiB" in \
        result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


@pytest.mark.parametrize("options, message", [
    (["--partitions", "-1"], "--partitions: 0 (as --memory-limit needs) or more"),
    (["--listen-plus", "101"], "--listen-plus: a played_ratio_pct in 0..100"),
    (["--history", "-1"], "--history: the slots of each row's history"),
    (["--generate", "10"], "--generate: writes a new log to --output and reads none")])
def test_bad_options_are_one_line_and_nothing_is_written(tmp_path, options, message):
    (tmp_path / "log").mkdir()
    pq.write_table(multi_event(LOG), tmp_path / "log" / "multi_event.parquet")
    result = preprocess(tmp_path / "log", tmp_path / "data", *DAYS, *options)
    assert result.returncode == 2 and f"error: {message}" in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


def test_an_empty_split_is_refused_before_writing(tmp_path):
    (tmp_path / "log").mkdir()
    pq.write_table(multi_event(LOG), tmp_path / "log" / "multi_event.parquet")
    result = preprocess(tmp_path / "log", tmp_path / "data", "--time-unit", "86400",
                        "--test-days", "0.5", "--val-days", "0.4")
    assert result.returncode == 2 and "no listen falls in validation" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("yambda_generated")
    result = run_cli(["preprocess", "yambda", "--generate", "20000", "--users", "200",
                      "--items", "400", "--days", "10", "--seed", "3", "--output",
                      str(root / "log")])
    assert result.returncode == 0, failure(result)
    return root


def test_the_generator_writes_yambdas_files_and_dtypes(generated, tmp_path):
    log = generated / "log"
    multi = pq.read_table(log / "multi_event.parquet")
    assert multi.num_rows == 20000
    assert sum(pq.read_metadata(log / f"{f}.parquet").num_rows for f in EVENT_FILES) == 20000
    yambda = {"uid": pa.uint32(), "item_id": pa.uint32(), "timestamp": pa.uint32(),
              "is_organic": pa.uint8(), "played_ratio_pct": pa.uint16(),
              "track_length_seconds": pa.uint32(), "event_type": pa.string()}  # as assumed
    assert {f.name: f.type for f in multi.schema} == yambda
    listens = pq.read_table(log / "listens.parquet")
    assert listens.column_names == ["uid", "item_id", "timestamp", "is_organic",
                                    "played_ratio_pct", "track_length_seconds"]
    assert pq.read_table(log / "likes.parquet").column_names == ["uid", "item_id", "timestamp",
                                                                 "is_organic"]
    import pyarrow.compute as pc

    other = multi.filter(pc.not_equal(multi.column("event_type"), "listen"))
    assert other.column("played_ratio_pct").null_count == other.num_rows
    again = run_cli(["preprocess", "yambda", "--generate", "20000", "--users", "200", "--items",
                     "400", "--days", "10", "--seed", "3", "--output", str(tmp_path / "again")])
    assert again.returncode == 0 and pq.read_table(tmp_path / "again" /
                                                   "multi_event.parquet").equals(multi)


def test_the_planted_listen_plus_rates_are_the_generators_option():
    """--plus-rates BASE TASTE MOOD: the defaults draw what they drew before the option; the
    rates decide listen+ (all, none, or only in the user's taste); a bad triple is one line."""
    from dlrm_hybrid.data.yambda.synthetic import LISTEN_PLUS, generate
    from dlrm_hybrid.errors import UserError

    def plus(rates=None):
        log = generate(5000, 50, 200, 10, 5.0, 1, *([rates] if rates else []))["listen"]
        return log, log["played_ratio_pct"] >= LISTEN_PLUS

    default, rate = plus()
    assert 0.6 < rate.mean() < 0.8
    assert all(np.array_equal(default[c], plus((0.25, 0.45, 0.2))[0][c]) for c in default)
    assert plus((1.0, 0.0, 0.0))[1].all() and not plus((0.0, 0.0, 0.0))[1].any()
    log, taste = plus((0.0, 1.0, 0.0))  # listen+ exactly in the user's two genres (of 10)
    genre = (log["item_id"].astype(np.int64) - 1000) // 3 // 20
    per_user = [set(genre[(log["uid"] == u) & taste]) for u in np.unique(log["uid"])]
    assert max(map(len, per_user)) <= 2 and 0.5 < taste.mean() < 1.0
    with pytest.raises(UserError, match="^--plus-rates: three probabilities"):
        generate(100, 5, 20, 2, 1.0, 0, (0.5, 0.4, 0.2))
    # nan passed every comparison and wrote a log without listen+; inf days was a traceback,
    # and days past uint32's seconds (136 years) wrapped the timestamps
    with pytest.raises(UserError, match="^--plus-rates: three probabilities"):
        generate(100, 5, 20, 2, 1.0, 0, (float("nan"), 0.0, 0.0))
    for days in (float("inf"), float("nan"), 50_000.0):
        with pytest.raises(UserError, match=r"^preprocess yambda --generate: .* days > 0"):
            generate(100, 5, 20, 2, days, 0)


def test_multi_event_and_the_per_event_files_give_the_same_dataset(generated, tmp_path):
    (tmp_path / "split").mkdir()
    for name in EVENT_FILES:
        (tmp_path / "split" / f"{name}.parquet").write_bytes(
            (generated / "log" / f"{name}.parquet").read_bytes())
    for source, out in ((generated / "log", tmp_path / "a"), (tmp_path / "split", tmp_path / "b")):
        result = preprocess(source, out, "--history", "4")
        assert result.returncode == 0, failure(result)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.bin"))
    assert len(files) > 10
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_partitions_spilled_to_disk_give_the_in_memory_bytes(generated, tmp_path):
    for out, extra in ((tmp_path / "memory", []), (tmp_path / "spilled", ["--partitions", "3"])):
        result = preprocess(generated / "log", out, "--history", "4", *extra)
        assert result.returncode == 0, failure(result)
    assert "3 partitions by user, spilled" in result.stdout
    files = sorted(p.relative_to(tmp_path / "memory") for p in (tmp_path / "memory").rglob("*")
                   if p.suffix in (".bin", ".txt", ".npz"))  # the bytes a resume's identity reads
    assert len(files) > 10 and Path("timelines.npz") in files
    for f in files:
        assert (tmp_path / "memory" / f).read_bytes() == (tmp_path / "spilled" / f).read_bytes(), f
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory", "spilled"]  # work removed


def test_the_merge_of_small_blocks_gives_the_rows_in_time_order(tmp_path):
    from dlrm_hybrid.cli import _parser
    from dlrm_hybrid.data.yambda import bounded
    from dlrm_hybrid.data.yambda.events import read_events
    from dlrm_hybrid.data.yambda.preprocess import build
    from dlrm_hybrid.data.yambda.synthetic import write_log

    write_log(str(tmp_path / "log"), 20000, users=50, items=400, days=0.05, seed=1)  # ties
    args = _parser().parse_args(["preprocess", "yambda", "--input", str(tmp_path / "log"),
                                 "--output", str(tmp_path / "out"), "--history", "3",
                                 "--val-days", "0.01", "--test-days", "0.01",
                                 "--gap-minutes", "1"])
    in_memory = build(read_events(args.input), args)
    held = list(in_memory.chunks())
    (tmp_path / "held").mkdir()
    (tmp_path / "spilled").mkdir()
    in_memory.save_timelines(tmp_path / "held")
    _, made, _ = bounded.prepare(args, 5, 1)  # 256-row blocks, a user range at a time
    try:
        spilled = list(made.chunks())
        made.save_timelines(tmp_path / "spilled")
    finally:
        made.close()
    with np.load(tmp_path / "held" / "timelines.npz") as a, \
            np.load(tmp_path / "spilled" / "timelines.npz") as b:
        for key in ("items", "actions", "times", "starts"):
            assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), key
    order = ["train", "validation", "test"]
    names = [c[0] for c in spilled]
    assert len(names) > 10 and names == sorted(names, key=order.index)  # many blocks, in order
    for k, name in enumerate(("label", "dense", "cats", "times"), start=1):
        for split in ("train", "validation", "test"):
            a = np.concatenate([np.stack(c[k], 1) if name == "cats" else c[k]
                                for c in held if c[0] == split])
            b = np.concatenate([np.stack(c[k], 1) if name == "cats" else c[k]
                                for c in spilled if c[0] == split])
            assert np.array_equal(a.astype(np.float64), b.astype(np.float64)), (name, split)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", "log", "spilled"]  # no work


def test_the_ranker_trains_on_a_generated_log_with_the_sequence_feature(generated):
    data = generated / "data"
    result = preprocess(generated / "log", data, "--history", "8")
    assert result.returncode == 0, failure(result)
    result = run_cli(["train", "--config", "configs/multitask_demo.yaml", "--set",
                      f"data.path={data}", "--set", "model.sequence=hstu", "--set",
                      "model.embedding_dim=8", "--set", "model.bottom_mlp=[16,8]", "--set",
                      "model.top_mlp=[16,1]", "--set", "model.tasks=[{name: click}]", "--set",
                      "value_model={}", "--set", "data.label_missing=0", "--set",
                      "data.global_batch_size=128", "--set", "train.max_steps=20", "--set",
                      "train.eval_every=20", "--set", "train.progress_bar=false", "--set",
                      f"train.run_dir={generated / 'run'}", "--set", "checkpoint.resume=none"])
    assert result.returncode == 0, failure(result)
    assert "sequence: HSTU over the user's last 8 engagements" in result.stdout
    assert "val_auc_click=" in result.stdout.splitlines()[-1]
