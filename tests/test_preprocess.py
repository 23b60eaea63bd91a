"""Criteo TSV and torchrec .npy preprocessing into split-binary datasets."""

import argparse
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo import npy_days
from dlrm_hybrid.data.criteo import input_sample, preprocess as criteo_preprocess, splits, tasks
from dlrm_hybrid.data.criteo.parse import NUM_FIELDS
from dlrm_hybrid.data.criteo.preprocess import preprocess_criteo
from dlrm_hybrid.data.criteo.preprocess_job import Job
from dlrm_hybrid.data.criteo.vocabulary import Vocabulary
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
from dlrm_hybrid.errors import DataError

PLANTED = {"wrong_field_count": 3, "bad_label": 4, "bad_numeric": 5, "bad_category": 6,
           "crlf": 7, "blank_line": 2}


@pytest.fixture
def small_tasks(monkeypatch):
    """Many tasks per file and several blocks per task, so workers and carries are exercised."""
    monkeypatch.setattr(tasks, "TASK_BYTES", 40_000)
    monkeypatch.setattr(tasks, "CHUNK_BYTES", 7_000)


def make_rows(n, seed=0):
    """Criteo rows as lists of 40 strings: some missing values, negatives, Zipf-like categories."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    ints, int_missing = rng.integers(-3, 1000, (n, 13)), rng.random((n, 13)) < 0.2
    ranks = np.exp(rng.random((n, 26)) * np.log(500)).astype(np.int64)  # log-uniform ranks
    cats = (ranks * 2654435761 + np.arange(26) * 7919) % 2**32
    cat_missing = rng.random((n, 26)) < 0.1
    return [[str(labels[r]), *("" if int_missing[r, j] else str(ints[r, j]) for j in range(13)),
             *("" if cat_missing[r, j] else f"{cats[r, j]:08x}" for j in range(26))]
            for r in range(n)]


BREAKERS = {  # kind -> ways to break a row, used in turn
    "wrong_field_count": [lambda r: r[:-1], lambda r: r + ["00000001"], lambda r: ["x"]],
    "bad_label": [lambda r, v=v: [v, *r[1:]] for v in ("2", "", "01", "-1")],
    "bad_numeric": [lambda r, v=v: r[:4] + [v] + r[5:]
                    for v in ("1.5", "+3", "-", "12a", "1" * 19)],
    "bad_category": [lambda r, v=v: r[:20] + [v] + r[21:]
                     for v in ("abcdefgz", "abc", "123456789", "abcd ef1", "-1234567", " 1234567")],
}


def plant(rows, seed=0):
    """Lines of `rows` with PLANTED bad lines of each kind at random places (crlf rows are kept),
    and the 1-based number of the first planted line."""
    rng = np.random.default_rng(seed)
    lines, planted = ["\t".join(r) + "\n" for r in rows], []
    for kind, count in PLANTED.items():
        for i in range(count):
            row = make_rows(1, seed=len(planted))[0]
            if kind == "crlf":
                planted.append("\t".join(row) + "\r\n")
            elif kind == "blank_line":
                planted.append("\n")
            else:
                planted.append("\t".join(BREAKERS[kind][i % len(BREAKERS[kind])](row)) + "\n")
            lines.insert(int(rng.integers(len(lines))), planted[-1])
    first = min(i for i, line in enumerate(lines) if any(line is p for p in planted))
    return lines, first + 1


def read_split(out, split):
    """(labels, dense, [ids per feature]) of one split of a written dataset."""
    fspec = load_feature_spec(str(out))
    files = fspec.splits[split]
    labels = np.fromfile(files.label, np.bool_)
    dense = np.fromfile(files.numerical, np.float16).reshape(len(labels), -1)
    cats = [np.fromfile(p, d) for p, d in zip(files.categorical, fspec.categorical_dtypes)]
    return labels, dense, cats


def dataset_files(out):
    return {p.relative_to(out): p.read_bytes() for p in sorted(Path(out).rglob("*"))
            if p.is_file() and p.name != criteo_preprocess.REPORT}


def test_bad_rows_are_counted_by_kind_and_skipped(tmp_path, small_tasks):
    rows = make_rows(3000)
    lines, first_bad = plant(rows)
    (tmp_path / "train.txt").write_text("".join(lines), newline="")
    report = preprocess_criteo([tmp_path / "train.txt"], tmp_path / "out", workers=2)
    assert report["bad_rows"] == PLANTED
    assert report["first_problem"].startswith(f"{tmp_path / 'train.txt'}:{first_bad}: ")
    assert report["rows_written"]["total"] == len(rows) + PLANTED["crlf"]
    saved = json.loads((tmp_path / "out" / criteo_preprocess.REPORT).read_text())
    assert saved["bad_rows"] == PLANTED and saved["peak_rss_bytes"] > 0
    assert set(saved) >= {"rows_written", "rows_per_s", "seconds", "cardinalities"}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("kind", ["bad_category", "crlf"])
def test_strict_stops_at_the_first_problem_with_file_and_line(tmp_path, small_tasks, workers, kind):
    lines = ["\t".join(r) + "\n" for r in make_rows(2000)]
    fields = lines[1500][:-1].split("\t")
    fields[14] = "xyz" if kind == "bad_category" else fields[14]
    lines[1500] = "\t".join(fields) + ("\r\n" if kind == "crlf" else "\n")
    path = tmp_path / "train.txt"
    path.write_text("".join(lines), newline="")
    with pytest.raises(DataError, match=f"^{path}:1501: .*\\({kind}\\)") as error:
        preprocess_criteo([path], tmp_path / "out", workers=workers, strict=True)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def write_day(path, c1_values, extra=None):
    """A day file whose rows differ only in C1 (hex of each value, None for missing)."""
    rows = make_rows(1)[0]
    lines = ["\t".join(rows[:14] + ["" if v is None else f"{v:08x}"] + rows[15:]) + "\n"
             for v in c1_values]
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", newline="") as f:
            f.write("".join(lines))
    else:
        path.write_text("".join(lines), newline="")
    return path


def write_day_23(folder, rows=2):
    """A small day 23 for validation and test, its C1 missing so that C1's ids stay as day 0's
    values make them."""
    return write_day(Path(folder) / "day_23", [None] * rows)


def test_ids_by_descending_frequency_with_threshold_and_table_size(tmp_path):
    a, b, c, d = 0xAAAA0000, 0x000000FF, 0x00000010, 0x12345678  # c < b: c wins their tie
    values = [b, a, c, None, a, b, d, a, c, a, None, b, c, a]  # a 5, b 3, c 3, d 1
    path = [write_day(tmp_path / "day_0", values), write_day_23(tmp_path)]
    expect = {a: 1, c: 2, b: 3, d: 0, None: 0}
    report = preprocess_criteo(path, tmp_path / "t2", frequency_threshold=2, workers=1)
    assert report["cardinalities"][0] == 4 and report["cardinalities"][1] == 2  # C2 is one value
    assert read_split(tmp_path / "t2", "train")[2][0].tolist() == [expect[v] for v in values]
    report = preprocess_criteo(path, tmp_path / "m3", max_table_size=3, workers=1)
    assert report["cardinalities"][0] == 3
    expect = {**expect, b: 0}
    assert read_split(tmp_path / "m3", "train")[2][0].tolist() == [expect[v] for v in values]
    report = preprocess_criteo(path, tmp_path / "all", workers=1)
    assert report["cardinalities"][0] == 5  # threshold 0 keeps d


def test_numericals_missing_clamped_and_log_transformed(tmp_path):
    row = make_rows(1)[0]
    row[1:14] = ["", "-5", "0", "7", "123456", "-0", "", "1", "2", "3", "4", "5", "00012"]
    (tmp_path / "day_3").write_text("\t".join(row) + "\n")
    preprocess_criteo([tmp_path / "day_3", write_day_23(tmp_path)], tmp_path / "out", workers=1)
    dense = read_split(tmp_path / "out", "train")[1][0]
    want = [np.log(max(int(v), 0) + 3) if v else 0.0 for v in row[1:14]]
    np.testing.assert_array_equal(dense, np.array(want, np.float64).astype(np.float16))


def test_criteo_1tb_days_split_day_23_first_ceil_half_validation_as_mlperf(tmp_path, capsys):
    """The MLPerf reference and torchrec: day 23's first ceil(N/2) rows are validation, the
    rest test; recorded in feature_spec.yaml, and said, with why auto chose it."""
    day0 = write_day(tmp_path / "day_0", range(100))
    day23 = write_day(tmp_path / "day_23.gz", range(100, 151))
    report = preprocess_criteo([day0, day23], tmp_path / "out", workers=2)
    assert ("\nsplit: days (auto: every input is named day_N): day 23's first half validation, "
            "its second test, the other days train\n") in capsys.readouterr().out
    assert report["rows_written"] == {"total": 151, "train": 100, "validation": 26, "test": 25}
    ids = {s: read_split(tmp_path / "out", s)[2][0].tolist()
           for s in ("train", "test", "validation")}
    # every value is seen once: ids follow the values, so they show which rows went where
    assert ids == {"train": list(range(1, 101)), "validation": list(range(101, 127)),
                   "test": list(range(127, 152))}
    assert load_feature_spec(str(tmp_path / "out")).notes == {"day_23": "validation_first",
                                                              "vocabulary": "vocabulary"}
    assert report["day_23"] == "validation_first"


def test_seeded_split_proportions_and_determinism(tmp_path, capsys):
    path = tmp_path / "train.txt"
    path.write_text("".join("\t".join(r) + "\n" for r in make_rows(6000)))
    first = preprocess_criteo([path], tmp_path / "a", workers=2, split_seed=5)["rows_written"]
    assert (f"\nsplit: hash (auto: {path} is not named day_N[.gz]): rows by a hash seeded 5: "
            f"90% train, 5% validation, 5% test\n") in capsys.readouterr().out
    assert 0.88 < first["train"] / 6000 < 0.92
    assert 0.035 < first["validation"] / 6000 < 0.065 and 0.035 < first["test"] / 6000 < 0.065
    preprocess_criteo([path], tmp_path / "b", workers=1, split_seed=5)
    preprocess_criteo([path], tmp_path / "c", workers=1, split_seed=6)
    assert dataset_files(tmp_path / "a") == dataset_files(tmp_path / "b")
    assert dataset_files(tmp_path / "a") != dataset_files(tmp_path / "c")


def test_output_is_identical_for_any_worker_count_and_task_size(tmp_path, monkeypatch):
    (tmp_path / "part_a.txt").write_text("".join(plant(make_rows(2500, seed=1), 1)[0]), newline="")
    with gzip.open(tmp_path / "part_b.gz", "wt", newline="") as f:
        f.write("".join(plant(make_rows(1500, seed=2), 2)[0]))
    inputs = [tmp_path / "part_a.txt", tmp_path / "part_b.gz"]
    preprocess_criteo(inputs, tmp_path / "one", frequency_threshold=2, workers=1)
    monkeypatch.setattr(tasks, "TASK_BYTES", 30_000)
    monkeypatch.setattr(tasks, "CHUNK_BYTES", 5_000)
    preprocess_criteo(inputs, tmp_path / "two", frequency_threshold=2, workers=2)
    assert dataset_files(tmp_path / "one") == dataset_files(tmp_path / "two")


def test_the_job_starts_its_workers_once_and_writes_beside_no_idle_one(tmp_path, small_tasks,
                                                                     monkeypatch):
    """Every phase runs on the job's own workers, started once (a spawned worker costs an
    interpreter's start); when the memory plan allows fewer writers than counted, the write pass
    runs with those alone (an idle worker would hold memory the plan gave them), same bytes."""
    import multiprocessing

    from dlrm_hybrid.data.criteo import budget
    from dlrm_hybrid.data.criteo.work import WorkFolder

    (tmp_path / "train.txt").write_text("".join("\t".join(r) + "\n" for r in make_rows(2000)))
    steps, real_commit = [], WorkFolder.commit

    def commit(self, step, record):  # in the parent, as each step's record is kept
        steps.append((step.split(".")[0], record["pid"], len(multiprocessing.active_children())))
        real_commit(self, step, record)

    monkeypatch.setattr(WorkFolder, "commit", commit)
    preprocess_criteo([tmp_path / "train.txt"], tmp_path / "a", workers=2)
    assert [phase for phase, _, _ in steps].count("count") > 2
    assert {phase for phase, _, _ in steps} == {"count", "number", "write"}
    assert len({pid for _, pid, _ in steps}) == 2 and max(alive for *_, alive in steps) == 2
    steps.clear()
    monkeypatch.setattr(budget.MemoryPlan, "lookup_workers", lambda self, values, parse: 1)
    preprocess_criteo([tmp_path / "train.txt"], tmp_path / "b", workers=2)
    writers = [alive for phase, _, alive in steps if phase == "write"]
    assert max(alive for *_, alive in steps) == 2 and len(writers) > 2 and max(writers) == 1
    assert dataset_files(tmp_path / "a") == dataset_files(tmp_path / "b")


def test_unreadable_inputs_are_one_line_errors_naming_the_file(tmp_path):
    whole = gzip.compress("".join("\t".join(r) + "\n" for r in make_rows(500)).encode())
    (tmp_path / "day_1.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=f"^{tmp_path / 'day_1.gz'}: truncated or corrupt gzip"):
        preprocess_criteo([tmp_path / "day_1.gz"], tmp_path / "out", workers=2, split="hash")
    with pytest.raises(DataError, match=f"^{tmp_path / 'nope.txt'}: cannot read"):
        preprocess_criteo([tmp_path / "nope.txt"], tmp_path / "out", workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["day_1.gz"]


@pytest.mark.parametrize("exception", [OSError, KeyboardInterrupt])
def test_an_interrupted_run_leaves_no_output_and_the_same_command_finishes_it(
        tmp_path, small_tasks, monkeypatch, exception):
    """Ctrl-C or a full disk while writing: no dataset, the counted work kept; the same command
    then redoes only what was not recorded and writes the bytes of a run never stopped."""
    (tmp_path / "train.txt").write_text("".join("\t".join(r) + "\n" for r in make_rows(2000)))
    inputs = [tmp_path / "train.txt"]
    clean = preprocess_criteo(inputs, tmp_path / "clean", workers=2)

    def interrupted(*args):
        raise exception("interrupted")

    real_write = Job.write
    monkeypatch.setattr(Job, "write", interrupted)
    with pytest.raises(exception):
        preprocess_criteo(inputs, tmp_path / "out", workers=2)
    assert only_inputs_left(tmp_path, ["train.txt", "clean", ".out.preprocess"])
    monkeypatch.setattr(Job, "write", real_write)
    again = preprocess_criteo(inputs, tmp_path / "out", workers=2)
    assert again["resumed_steps"] == len(tasks.plan_tasks([str(p) for p in inputs], 40_000)) + 1
    assert dataset_files(tmp_path / "out") == dataset_files(tmp_path / "clean")
    assert again["rows_written"] == clean["rows_written"]
    assert only_inputs_left(tmp_path, ["train.txt", "clean", "out"])


def test_dataset_reads_back_with_the_written_counts_and_rows(tmp_path):
    rows = make_rows(3000, seed=3)
    (tmp_path / "train.txt").write_text("".join("\t".join(r) + "\n" for r in rows))
    report = preprocess_criteo([tmp_path / "train.txt"], tmp_path / "out", workers=2)
    data = SplitBinaryDataset(str(tmp_path / "out"))
    written = report["rows_written"]
    assert [data.num_samples(s) for s in ("train", "val", "test")] == \
        [written["train"], written["validation"], written["test"]]
    labels, dense, cats = read_split(tmp_path / "out", "train")
    batch = data.batch("train", 10, 32)
    assert batch.dense.shape == (32, 13) and batch.valid.all()
    np.testing.assert_array_equal(batch.labels.numpy(), labels[10:42])
    np.testing.assert_array_equal(batch.dense.numpy(), dense[10:42].astype(np.float32))
    np.testing.assert_array_equal(batch.sparse["cat_5"].values().numpy(), cats[5][10:42])
    assert data.spec.cardinalities == report["cardinalities"]


def test_command_line_runs_and_rejects_bad_arguments(tmp_path, capsys):
    path, day_23 = write_day(tmp_path / "day_0", range(50)), write_day_23(tmp_path)
    parser = argparse.ArgumentParser()
    criteo_preprocess.add_arguments(parser)
    criteo_preprocess.run(parser.parse_args(["--input", str(path), str(day_23), "--output",
                                      str(tmp_path / "out"), "--workers", "2",
                                      "--frequency-threshold", "1"]))
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("done: rows=52 train=50 validation=1 test=1 wrong_field_count=0")
    for flags, key in ((["--frequency-threshold", "-1"], "--frequency-threshold"),
                       (["--max-table-size", "0"], "--max-table-size"), ([], "--output")):
        args = parser.parse_args(["--input", str(path), "--output", str(tmp_path / "out"), *flags])
        with pytest.raises(ConfigError, match=f"^{key}"):
            criteo_preprocess.run(args)


def write_npy_day(folder, day, n, rng, flat_labels):
    dense = rng.integers(0, 50, (n, 13)).astype(np.float32)
    sparse = rng.integers(0, 40, (n, 26)).astype(np.int32)
    labels = rng.integers(0, 2, n if flat_labels else (n, 1)).astype(np.int32)
    for name, array in (("dense", dense), ("sparse", sparse), ("labels", labels)):
        np.save(folder / f"day_{day}_{name}.npy", array)
    return dense, sparse, labels.reshape(-1)


@pytest.mark.parametrize("transform", ["none", "log"])
def test_npy_days_round_trip(tmp_path, transform, monkeypatch):
    monkeypatch.setattr(npy_days, "CHUNK_ROWS", 64)
    rng = np.random.default_rng(0)
    (tmp_path / "npy").mkdir()
    d0, s0, l0 = write_npy_day(tmp_path / "npy", 0, 300, rng, flat_labels=False)
    d23, s23, l23 = write_npy_day(tmp_path / "npy", 23, 201, rng, flat_labels=True)
    report = npy_days.convert_npy_days(tmp_path / "npy", tmp_path / "out", transform)
    assert report["cardinalities"] == (np.maximum(s0.max(0), s23.max(0)) + 1).tolist()
    assert report["rows_written"] == {"total": 501, "train": 300, "validation": 101, "test": 100}
    fix = (lambda d: d) if transform == "none" else (lambda d: np.log(d + 3))
    expected = {"train": (d0, s0, l0), "validation": (d23[:101], s23[:101], l23[:101]),
                "test": (d23[101:], s23[101:], l23[101:])}
    for split, (dense, sparse, labels) in expected.items():
        got_labels, got_dense, got_cats = read_split(tmp_path / "out", split)
        np.testing.assert_array_equal(got_labels, labels.astype(bool))
        np.testing.assert_array_equal(got_dense, fix(dense).astype(np.float16))
        np.testing.assert_array_equal(np.stack(got_cats, 1), sparse)


def test_npy_days_missing_file_is_a_data_error(tmp_path):
    rng = np.random.default_rng(0)
    write_npy_day(tmp_path, 0, 10, rng, flat_labels=True)
    (tmp_path / "day_0_sparse.npy").unlink()
    with pytest.raises(DataError, match="day_0_sparse.npy"):
        npy_days.convert_npy_days(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()



def test_npy_days_of_the_references_multi_hot_files_point_to_preprocess_multihot(tmp_path):
    """The MLPerf reference's materialized multi-hot days (day_N_sparse_multi_hot.npz) in place
    of day_N_sparse.npy were called a missing file; the one-hot days and `preprocess multihot`
    make the same ids."""
    rng = np.random.default_rng(0)
    write_npy_day(tmp_path, 0, 10, rng, flat_labels=True)
    (tmp_path / "day_0_sparse.npy").rename(tmp_path / "day_0_sparse_multi_hot.npz")
    with pytest.raises(DataError, match=re.escape(
            f"{tmp_path}/day_0_sparse_multi_hot.npz: the MLPerf reference's multi-hot ids, which "
            f"preprocess npy does not read; give the one-hot day_N_sparse.npy files, then "
            f"`preprocess multihot` (it builds the same ids)")):
        npy_days.convert_npy_days(tmp_path, tmp_path / "out")


def test_npy_days_of_text_values_are_a_one_line_error(tmp_path):
    """Dense values or labels saved as text were read as numbers up to the first empty string,
    which ended in numpy's 'could not convert' traceback."""
    rng = np.random.default_rng(0)
    for day in (0, 23):
        write_npy_day(tmp_path, day, 10, rng, flat_labels=True)
    for part in ("dense", "labels"):
        kept = np.load(tmp_path / f"day_0_{part}.npy")
        np.save(tmp_path / f"day_0_{part}.npy", kept.astype("S8"))
        with pytest.raises(DataError, match=rf"^{tmp_path}/day_0_{part}.npy: values of type "
                                            rf"\|S8, not numbers"):
            npy_days.convert_npy_days(tmp_path, tmp_path / "out")
        np.save(tmp_path / f"day_0_{part}.npy", kept)
    assert not (tmp_path / "out").exists()


def test_npy_days_command_writes_nonfinite_dense_as_zero(tmp_path, capsys):
    dense, _, _ = write_npy_day(tmp_path, 0, 20, np.random.default_rng(1), flat_labels=True)
    write_npy_day(tmp_path, 23, 4, np.random.default_rng(2), flat_labels=True)
    dense[3, 1] = -np.inf  # torchrec's log(x + 3) for x = -3
    np.save(tmp_path / "day_0_dense.npy", dense)
    parser = argparse.ArgumentParser()
    npy_days.add_arguments(parser)
    npy_days.run(parser.parse_args(["--input", str(tmp_path), "--output", str(tmp_path / "out")]))
    assert "warning: 1 dense values" in capsys.readouterr().out
    assert read_split(tmp_path / "out", "train")[1][3, 1] == 0
    assert json.loads((tmp_path / "out" / criteo_preprocess.REPORT).read_text())["nonfinite_dense"] == 1


# ---- every split must get rows: training evaluates on validation, eval on test -------------

def only_inputs_left(folder, names):
    return sorted(p.name for p in Path(folder).iterdir()) == sorted(names)


def test_day_files_without_day_23_are_refused_before_reading(tmp_path, monkeypatch):
    """They once gave empty validation and test splits, and training crashed at its first
    evaluation."""
    days = [write_day(tmp_path / "day_0.gz", range(40)), write_day(tmp_path / "day_1.gz", range(9))]
    monkeypatch.setattr(input_sample, "read_lines", None)  # nothing may be read
    with pytest.raises(ConfigError, match=r"^--input: no day_23 among days 0,1, .*add "
                                          r"day_23\.gz or use --split hash") as error:
        preprocess_criteo(days, tmp_path / "out", workers=1)
    assert "\n" not in str(error.value) and only_inputs_left(tmp_path, ["day_0.gz", "day_1.gz"])
    with pytest.raises(ConfigError, match="^--input: only day_23, .*train would be empty"):
        preprocess_criteo([write_day_23(tmp_path)], tmp_path / "out", workers=1)


def test_day_files_split_by_hash_when_asked(tmp_path):
    days = [write_day(tmp_path / "day_0", range(300)), write_day(tmp_path / "day_1", range(9))]
    written = preprocess_criteo(days, tmp_path / "out", workers=2, split="hash")["rows_written"]
    assert written["total"] == 309 and min(written.values()) > 0
    with pytest.raises(ConfigError, match="^--split days: .*train.txt is not named day_N"):
        preprocess_criteo([*days, tmp_path / "train.txt"], tmp_path / "other", split="days")


@pytest.mark.parametrize("rows, split, empty", [(5, "hash", "validation and test splits"),
                                               (20, "hash", "validation split"),
                                               (1, "days", "test split")])
def test_inputs_too_small_for_every_split_are_refused_and_leave_nothing(tmp_path, rows, split,
                                                                        empty):
    """A seeded 90/5/5 split of 5 or 20 rows, or a day 23 of one row (all of it validation)."""
    inputs = [write_day(tmp_path / "day_0", range(20)), write_day_23(tmp_path, rows)]
    with pytest.raises(DataError, match=f"^--input: the {empty} would be empty .*; give more "
                                        f"rows$"):
        preprocess_criteo(inputs if split == "days" else inputs[1:], tmp_path / "out",
                          workers=1, split=split)
    assert only_inputs_left(tmp_path, ["day_0", "day_23"])


def test_empty_inputs_are_a_one_line_error_and_leave_nothing(tmp_path):
    """Empty files once crashed with an IndexError before any check."""
    (tmp_path / "a.tsv").write_bytes(b"")
    (tmp_path / "b.tsv").write_bytes(b"")
    inputs = [tmp_path / "a.tsv", tmp_path / "b.tsv"]
    with pytest.raises(DataError, match=f"^--input: {tmp_path / 'a.tsv'}, {tmp_path / 'b.tsv'}: "
                                        f"empty; give Criteo TSV files with rows$"):
        preprocess_criteo(inputs, tmp_path / "out", workers=1)
    assert only_inputs_left(tmp_path, ["a.tsv", "b.tsv"])


def test_day_files_are_written_in_day_order_whatever_the_order_given(tmp_path):
    """`--input day_*.gz` lists day_10 before day_2: train (read in order by MLPerf's schedule)
    once followed the list, as `preprocess npy` never did."""
    days = [write_day(tmp_path / f"day_{d}", [d] * 3) for d in (1, 10, 2)]
    preprocess_criteo([*days, write_day_23(tmp_path)], tmp_path / "out", workers=2)
    _, _, cats = read_split(tmp_path / "out", "train")
    values = Vocabulary.load(str(tmp_path / "out")).values[0]
    assert [int(values[i - 1]) for i in cats[0]] == [1] * 3 + [2] * 3 + [10] * 3


def test_an_input_given_twice_is_refused_before_reading(tmp_path, monkeypatch):
    """`--input day_*.gz day_23.gz` once wrote day 23 twice; a file twice under a hash split put
    copies of a row in train and in test."""
    days = [write_day(tmp_path / "day_0", range(9)), write_day(tmp_path / "day_0.gz", range(9)),
            write_day_23(tmp_path)]
    (tmp_path / "link").symlink_to(days[0])
    monkeypatch.setattr(input_sample, "read_lines", None)  # nothing may be read
    for inputs, split, says in (
            ([days[0], days[2], tmp_path / "." / "day_0"], "hash", "the same file; give each file"),
            ([days[0], tmp_path / "link"], "hash", "the same file; give each file"),
            ([days[0], days[2], days[1]], "auto", "both day 0; give each day once")):
        with pytest.raises(ConfigError, match=f"^--input: {days[0]} and .* are {says}"):
            preprocess_criteo(inputs, tmp_path / "out", workers=1, split=split)
    assert only_inputs_left(tmp_path, ["day_0", "day_0.gz", "day_23", "link"])


def test_a_byte_order_mark_is_dropped_and_its_row_kept(tmp_path, small_tasks):
    """A file saved by an editor that starts it with a UTF-8 BOM: the first row is a row (it was
    once skipped as a bad label), every other task of the file unchanged."""
    lines = ["\t".join(r) + "\n" for r in make_rows(3000, seed=5)]
    (tmp_path / "plain.txt").write_text("".join(lines))
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + "".join(lines).encode())
    plain = preprocess_criteo([tmp_path / "plain.txt"], tmp_path / "a", workers=2)
    bom = preprocess_criteo([tmp_path / "bom.txt"], tmp_path / "b", workers=2)
    assert bom["rows_written"] == plain["rows_written"] == {**bom["rows_written"], "total": 3000}
    assert bom["first_problem"] is None and not any(bom["bad_rows"].values())
    assert dataset_files(tmp_path / "a") == dataset_files(tmp_path / "b")


def test_command_line_refuses_days_without_day_23_in_one_line_with_exit_2(tmp_path):
    from conftest import run_cli

    day = write_day(tmp_path / "day_0.gz", range(10))
    result = run_cli(["preprocess", "criteo", "--input", str(day), "--output",
                      str(tmp_path / "out")], timeout=120)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: --input: no day_23 among days 0, ") and "--split hash" in line
    assert only_inputs_left(tmp_path, ["day_0.gz"])


def test_npy_days_without_day_23_are_refused_and_hash_split_on_request(tmp_path):
    rng = np.random.default_rng(4)
    (tmp_path / "npy").mkdir()
    for day, rows in ((0, 300), (1, 100)):
        write_npy_day(tmp_path / "npy", day, rows, rng, flat_labels=True)
    with pytest.raises(ConfigError, match=r"^--input: no day_23 among days 0,1, .*add "
                                          r"day_23_\{dense,sparse,labels\}\.npy or use --split"):
        npy_days.convert_npy_days(tmp_path / "npy", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    report = npy_days.convert_npy_days(tmp_path / "npy", tmp_path / "out", split="hash",
                                       split_seed=3)
    assert report["rows_written"]["total"] == 400 and min(report["rows_written"].values()) > 0
    codes = splits.split_codes(splits.SplitRule("hash", 3), np.arange(400))
    assert [report["rows_written"][s] for s in ("train", "validation", "test")] == \
        np.bincount(codes, minlength=3).tolist()  # global row numbers across days


def test_npy_day_23_of_one_row_is_refused(tmp_path):
    rng = np.random.default_rng(5)
    write_npy_day(tmp_path, 0, 30, rng, flat_labels=True)
    write_npy_day(tmp_path, 23, 1, rng, flat_labels=True)
    with pytest.raises(DataError, match="^--input: the test split would be empty"):
        npy_days.convert_npy_days(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_require_samples_names_the_dataset_and_the_empty_split(tmp_path):
    from dlrm_hybrid.config import DataConfig
    from dlrm_hybrid.data.source import require_samples
    from dlrm_hybrid.data.interactions.planted_interactions import planted_interactions
    from dlrm_hybrid.data.spec import DataSpec
    from dlrm_hybrid.data.synthetic import SyntheticClicks

    with SplitBinaryWriter(str(tmp_path / "only_train"), DataSpec(2, [5], [1])) as writer:
        writer.write("train", np.ones(4), np.zeros((4, 2)), [np.arange(4)[:, None]])
    data = SplitBinaryDataset(str(tmp_path / "only_train"))
    require_samples(data, ["train"], "training")
    with pytest.raises(DataError, match=f"^{tmp_path / 'only_train'}: the validation split has "
                                        f"no samples and training reads it; .*day_23"):
        require_samples(data, ["train", "val"], "training")
    synthetic = SyntheticClicks(DataConfig(cardinalities=[5], val_samples=0))
    require_samples(synthetic, ["train"], "eval")
    with pytest.raises(DataError, match="^synthetic data: the test split has no samples and "
                                        "eval reads it; set data.val_samples above 0$"):
        require_samples(synthetic, ["test"], "eval")
    interactions = planted_interactions(DataConfig())
    interactions.pairs.pop("test")
    with pytest.raises(DataError, match="^planted interactions: the test split has no samples "
                                        "and eval reads it "):
        require_samples(interactions, ["train", "test"], "eval")


# ---- temporary folders of killed runs --------------------------------------------------------

def test_a_killed_writers_partial_folder_is_removed_by_the_next_run(tmp_path):
    """SIGKILL leaves `.NAME.partial-...` behind (nothing can clean up); the next writer of NAME
    removes it, but never the folder of a live process or of another host."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from dlrm_hybrid.data.spec import DataSpec\n"
        "from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter\n"
        "w = SplitBinaryWriter(sys.argv[1], DataSpec(13, [5] * 26, [1] * 26))\n"
        "print('writing', flush=True)\n"
        "time.sleep(60)\n"), str(tmp_path / "out")], stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[1])
    assert child.stdout.readline() == "writing\n"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    (killed,) = tmp_path.glob(".out.partial-*")
    assert killed.name.endswith(f"-{child.pid}") and (killed / "train").is_dir()
    host = socket.gethostname()
    survivors = [f".out.partial-{os.getpid()}",  # an older version's name, a live process
                 f".out.partial-{host}-{os.getppid()}",  # a live process
                 f".out.partial-other-host-{child.pid}",  # dead here, alive there maybe
                 f".other.partial-{host}-{child.pid}"]  # another output's
    for name in survivors:
        (tmp_path / name).mkdir()
    (tmp_path / "npy").mkdir()
    rng = np.random.default_rng(0)
    for day, n in ((0, 20), (23, 10)):
        write_npy_day(tmp_path / "npy", day, n, rng, flat_labels=True)
    npy_days.convert_npy_days(tmp_path / "npy", tmp_path / "out")
    assert not killed.exists() and (tmp_path / "out" / "feature_spec.yaml").exists()
    assert only_inputs_left(tmp_path, ["npy", "out", *survivors])


# ---- the commands as a user runs them, with their defaults -----------------------------------

def test_criteo_command_reports_rows_stripped_of_trailing_empty_fields_and_pads_them(tmp_path):
    """An editor that trims trailing whitespace leaves rows ending in empty fields with 37-39
    fields: the default run says so (not just wrong_field_count); --pad-short-rows reads them as
    they were, so the dataset is the one the untrimmed file gives."""
    from conftest import failure, run_cli

    rows = make_rows(1000, seed=7)
    for r in rows[::2]:
        r[-1 - int(r[0] == "1"):] = [""] * (1 + int(r[0] == "1"))  # empty C25..C26 or C26
    lines = ["\t".join(r) + "\n" for r in rows]
    lines[10] = "\t".join(rows[10] + ["00000001"]) + "\n"  # 41 fields
    lines[11] = "\t".join(rows[11][:20] + ["abc"]) + "\n"  # cut inside a field: not padded
    trimmed = [line.rstrip() + "\n" for line in lines]
    short = [len(line.split("\t")) for i, line in enumerate(trimmed) if i != 11 and
             len(line.split("\t")) < NUM_FIELDS]
    assert 400 < len(short) < 600 and min(short) <= 37 and max(short) == 39
    for folder, text in (("untrimmed", lines), ("trimmed", trimmed)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "day_0").write_text("".join(text[:900]))
        (tmp_path / folder / "day_23").write_text("".join(text[900:]))
    inputs = [str(tmp_path / "trimmed" / day) for day in ("day_0", "day_23")]
    result = run_cli(["preprocess", "criteo", "--input", *inputs, "--output",
                      str(tmp_path / "default")])
    assert result.returncode == 0, failure(result)
    note = (f"{len(short)} of the {len(short) + 2} wrong_field_count rows have "
            f"{min(short)}-{max(short)} fields and are short only by trailing fields, as when a "
            f"tool strips trailing whitespace (the tabs of empty last fields); --pad-short-rows "
            f"reads the missing fields as empty and keeps these rows")
    assert note in result.stdout.splitlines()
    report = json.loads((tmp_path / "default" / criteo_preprocess.REPORT).read_text())
    assert report["short_rows"] == {"rows": len(short), "min_fields": min(short),
                                    "max_fields": 39, "padded": False, "note": note}
    assert report["rows_written"]["total"] == 1000 - 2 - len(short)
    result = run_cli(["preprocess", "criteo", "--input", *inputs, "--output",
                      str(tmp_path / "padded"), "--pad-short-rows"])
    assert result.returncode == 0, failure(result)
    assert f"{len(short)} rows of {min(short)}-39 fields were short only by trailing fields " \
           f"and were read with those fields empty (--pad-short-rows)" in result.stdout
    preprocess_criteo([tmp_path / "untrimmed" / day for day in ("day_0", "day_23")],
                      tmp_path / "expected", workers=1)
    assert dataset_files(tmp_path / "padded") == dataset_files(tmp_path / "expected")
    assert read_split(tmp_path / "padded", "validation")[0].size == 50  # day 23: 100 rows


def test_npy_then_multihot_commands_with_their_defaults(tmp_path):
    """`preprocess npy` and `preprocess multihot` as the MLPerf recipe runs them, defaults only
    (multihot's `--rows input` once always failed)."""
    from conftest import failure, run_cli
    from dlrm_hybrid.data.criteo.multi_hot import MLPERF_HOTNESS

    rng = np.random.default_rng(8)
    (tmp_path / "npy").mkdir()
    write_npy_day(tmp_path / "npy", 0, 40, rng, flat_labels=True)
    _, s23, l23 = write_npy_day(tmp_path / "npy", 23, 11, rng, flat_labels=False)
    result = run_cli(["preprocess", "npy", "--input", str(tmp_path / "npy"), "--output",
                      str(tmp_path / "one_hot")])
    assert result.returncode == 0, failure(result)
    assert result.stdout.strip().splitlines()[-1].startswith(
        "done: rows=51 train=40 validation=6 test=5")
    result = run_cli(["preprocess", "multihot", "--input", str(tmp_path / "one_hot"),
                      "--output", str(tmp_path / "multi_hot")])
    assert result.returncode == 0, failure(result)
    one_hot, multi_hot = (SplitBinaryDataset(str(tmp_path / name))
                          for name in ("one_hot", "multi_hot"))
    assert multi_hot.spec.hotness == MLPERF_HOTNESS
    assert multi_hot.spec.cardinalities == one_hot.spec.cardinalities  # --rows input
    assert load_feature_spec(str(tmp_path / "multi_hot")).notes == {"day_23": "validation_first"}
    validation = multi_hot.columns("val", 0, 6)
    np.testing.assert_array_equal(validation.labels, l23[:6])
    np.testing.assert_array_equal(np.stack([ids[:, 0] for ids in validation.ids], 1), s23[:6])
    assert all(ids.shape == (6, h) for ids, h in zip(validation.ids, MLPERF_HOTNESS))
