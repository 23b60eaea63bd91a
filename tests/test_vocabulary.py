"""Criteo's value -> id dictionaries kept with a dataset (`vocabulary/cat_<i>.bin`), and
`predict --raw-criteo DATASET`, which scores raw Criteo rows through them exactly as the same rows
preprocessed into DATASET score."""

from __future__ import annotations

import gzip
import random
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import pytest

from conftest import ROOT, failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.criteo.vocabulary import DTYPE, FOLDER, KEY, Vocabulary
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.serve.predict import predict
from dlrm_hybrid.serve.export import export_model
from dlrm_hybrid.serve.raw_rows import raw_criteo_chunks
from dlrm_hybrid.train.loop import train

THRESHOLD = 2
TEST_ROWS = 60  # day_23's second half: the dataset's test split, the rows scored
RARE = [f"{0xdead0000 + f:08x}" for f in range(26)]  # once in all input: below THRESHOLD, id 0


def criteo_vocabulary(paths: Sequence[Path], threshold: int,
                      max_table_size: Optional[int] = None) -> List[np.ndarray]:
    """Per feature, the values `preprocess criteo` keeps, in id order, by its documented rule
    read off the raw text: counted at least `threshold` times, most frequent first, ties smaller
    value first, at most max_table_size - 1 of them."""
    counts = [Counter() for _ in range(26)]
    for path in paths:
        for line in path.read_text().splitlines():
            for f, value in enumerate(line.split("\t")[14:]):
                if value:
                    counts[f][int(value, 16)] += 1
    kept = [sorted((v for v, n in c.items() if n >= max(threshold, 1)), key=lambda v: (-c[v], v))
            for c in counts]
    return [np.array(k[:None if max_table_size is None else max_table_size - 1], np.uint32)
            for k in kept]


def criteo_line(rng: random.Random, label: bool = True) -> str:
    ints = ["" if rng.random() < 0.1 else str(rng.randint(-3, 400)) for _ in range(13)]
    cats = ["" if rng.random() < 0.1 else f"{rng.choice(range(30)) * 2654435761 % 2**32:08x}"
            for _ in range(26)]
    return "\t".join([str(rng.randint(0, 1))] * label + ints + cats)


@pytest.fixture(scope="module")
def criteo_model(tmp_path_factory, process_group):
    """day_0 and day_23 of raw rows, the dataset `preprocess criteo` makes of them (day_23's
    second half its test split; a row of values seen once, a row of empty fields and a CRLF row
    among them) with its vocabulary, and a tiny model trained on it and exported in this process
    (the CLI's way is tested elsewhere; here it would cost seconds)."""
    root = tmp_path_factory.mktemp("criteo")
    rng = random.Random(0)
    (root / "day_0").write_text("".join(criteo_line(rng) + "\n" for _ in range(300)))
    day_23 = [criteo_line(rng) + "\n" for _ in range(2 * TEST_ROWS)]
    day_23[TEST_ROWS + 3] = "\t".join(["1", *day_23[TEST_ROWS + 3].split("\t")[1:14], *RARE]) + "\n"
    day_23[TEST_ROWS + 5] = "0" + "\t" * 39 + "\n"
    day_23[TEST_ROWS + 8] = day_23[TEST_ROWS + 8][:-1] + "\r\n"
    (root / "day_23").write_text("".join(day_23), newline="")
    dataset = root / "dataset"
    result = run_cli(["preprocess", "criteo", "--input", str(root / "day_0"), str(root / "day_23"),
                      "--output", str(dataset), "--frequency-threshold", str(THRESHOLD),
                      "--workers", "1"])
    assert result.returncode == 0, failure(result)
    expected = criteo_vocabulary([root / "day_0", root / "day_23"], THRESHOLD)
    assert [v.tolist() for v in Vocabulary.load(str(dataset)).values] == \
        [v.tolist() for v in expected]
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [
        f"data.path={dataset}", "data.global_batch_size=64", "train.max_steps=2",
        "train.progress_bar=false", f"train.run_dir={root / 'run'}", "checkpoint.resume=none",
        "model.embedding_dim=4", "model.bottom_mlp=[8, 4]", "model.top_mlp=[8, 1]"])
    train(cfg, process_group)
    export_model(str(root / "run" / "checkpoints" / "step_2"), str(root / "model.pt"))
    test_rows = "".join(day_23[TEST_ROWS:])
    with gzip.open(root / "test_rows.tsv.gz", "wt", newline="") as f:
        f.write(test_rows)
    return {"root": root, "dataset": dataset, "model": root / "model.pt", "rows": test_rows}


def predict_cli(model: dict, data: Path, out: Path, *flags: str):
    return run_cli(["predict", "--model", str(model["model"]), "--data", str(data),
                    "--out", str(out), "--batch-size", "16", *flags])


def test_raw_criteo_rows_score_exactly_as_the_same_rows_preprocessed(criteo_model, tmp_path):
    model, dataset = criteo_model["model"], criteo_model["dataset"]
    preprocessed = predict_cli(criteo_model, dataset, tmp_path / "split.txt", "--split", "test")
    assert preprocessed.returncode == 0, failure(preprocessed)
    raw = predict_cli(criteo_model, criteo_model["root"] / "test_rows.tsv.gz",
                      tmp_path / "raw.txt", "--raw-criteo", str(dataset))
    assert raw.returncode == 0, failure(raw)
    assert (tmp_path / "raw.txt").read_bytes() == (tmp_path / "split.txt").read_bytes()
    assert raw.stdout == preprocessed.stdout.replace("split.txt", "raw.txt")  # labels: AUC, loss
    scores = np.loadtxt(tmp_path / "raw.txt")
    assert len(scores) == TEST_ROWS and len(np.unique(scores)) > TEST_ROWS // 2

    unlabelled = tmp_path / "rows.txt"  # and in this process, whose threads may differ
    unlabelled.write_text("".join(line.split("\t", 1)[1] + "\n"
                                  for line in criteo_model["rows"].splitlines()))
    assert predict(str(model), str(unlabelled), str(tmp_path / "bare.txt"), batch_size=16,
                   raw_criteo=str(dataset)) == {"samples": TEST_ROWS}
    predict(str(model), str(dataset), str(tmp_path / "here.txt"), batch_size=16)
    assert (tmp_path / "bare.txt").read_bytes() == (tmp_path / "here.txt").read_bytes()
    vocabulary = Vocabulary.load(str(dataset))
    assert all(int(v, 16) not in vocabulary.values[f] for f, v in enumerate(RARE))


def test_a_malformed_raw_row_is_an_error_naming_its_line_and_nothing_is_written(criteo_model,
                                                                               tmp_path):
    rows = criteo_model["rows"].splitlines()
    out, data = tmp_path / "p.txt", tmp_path / "rows.tsv"
    out.write_text("an earlier result\n")
    data.write_text("\n".join(rows[:30] + [""] + rows[30:31] + [spoil(rows[31], 30, "0000000g")])
                    + "\n")  # line 33, in the third chunk of 16 lines
    result = predict_cli(criteo_model, data, out, "--raw-criteo", str(criteo_model["dataset"]))
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [
        f"error: {data}:33: a categorical field (C1..C26) is not empty or 8 hex digits; give raw "
        f"Criteo rows, one per line"])
    cases = [  # the file's lines -> the error after "<file>:"
        (rows[:20] + [rows[20].rsplit("\t", 1)[0]],
         "21: not 40 tab-separated fields (label, I1..I13, C1..C26); give raw Criteo rows"),
        ([r.split("\t", 1)[1] for r in rows[:17]] + [rows[17]],
         "18: not 39 tab-separated fields (I1..I13, C1..C26) as line 1; give raw Criteo rows"),
        (rows[:2] + ["7" + rows[2][1:]], "3: label is not 0 or 1; give raw Criteo rows"),
        ([r.split("\t", 1)[1] for r in rows[:5]] + [spoil(rows[5], 4, "1.5").split("\t", 1)[1]],
         "6: an integer field (I1..I13) is not an integer of at most 18 characters; give raw"),
        (["", "1,2,3"], "2: 1 tab-separated fields; raw Criteo rows have 40 (label, I1..I13, "
                        "C1..C26) or 39 (no label)"),
    ]
    for lines, message in cases:
        data.write_text("\n".join(lines) + "\n")
        with pytest.raises(DataError, match=f"^{re.escape(f'{data}:{message}')}"):
            predict(str(criteo_model["model"]), str(data), str(out), batch_size=16,
                    raw_criteo=str(criteo_model["dataset"]))
    not_gzip = tmp_path / "rows.tsv.gz"
    not_gzip.write_text(criteo_model["rows"])
    with pytest.raises(DataError, match=f"^{re.escape(str(not_gzip))}: not readable \\(Not a "
                                        f"gzipped file .*\\); give a Criteo TSV file, plain or .gz"):
        predict(str(criteo_model["model"]), str(not_gzip), str(out),
                raw_criteo=str(criteo_model["dataset"]))
    assert out.read_text() == "an earlier result\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.txt", "rows.tsv", "rows.tsv.gz"]


def test_a_dataset_without_a_matching_vocabulary_is_refused_in_one_line(criteo_model, tmp_path):
    rows = tmp_path / "rows.tsv"
    rows.write_text(criteo_model["rows"])
    cardinalities = Vocabulary.load(str(criteo_model["dataset"])).cardinalities
    none = tmp_path / "none"
    shutil.copytree(criteo_model["dataset"], none)
    fspec = load_feature_spec(str(none))
    del fspec.notes[KEY]
    fspec.save()
    other = write_dataset(tmp_path / "other", [*cardinalities[:3], cardinalities[3] + 1,
                                               *cardinalities[4:]])
    for dataset, message in [
            (none, f"{none}: has no vocabulary (feature_spec.yaml's metadata names none): it was "
                   f"written by `preprocess npy`, `synth` or an older `preprocess criteo`; "
                   f"preprocess the raw Criteo files again"),
            (other, f"--raw-criteo: {other}'s vocabulary gives cat_3 {cardinalities[3] + 1} ids, "
                    f"the model's table for cat_3 has {cardinalities[3]}; give the dataset the "
                    f"model was trained on")]:
        with pytest.raises(DataError, match=f"^{re.escape(message)}$"):
            predict(str(criteo_model["model"]), str(rows), str(tmp_path / "p.txt"),
                    raw_criteo=str(dataset))
        assert not (tmp_path / "p.txt").exists()


def test_rows_are_located_by_their_line_across_blank_lines_and_chunks(criteo_model, tmp_path):
    rows = [line.split("\t", 1)[1] for line in criteo_model["rows"].splitlines()]  # no label
    data = tmp_path / "rows.tsv"
    data.write_text("\n\n" + "\n".join(rows[:3]) + "\n\n" + "\n".join(rows[3:9]))  # no final \n
    features = [{"name": f"cat_{i}", "cardinality": c}
                for i, c in enumerate(Vocabulary.load(str(criteo_model["dataset"])).cardinalities)]
    chunks = list(raw_criteo_chunks(data, str(criteo_model["dataset"]), 13, features, 4))
    assert [[chunk.locate(i) for i in range(len(chunk.dense))] for chunk in chunks] == [
        [f"{data}:{line}" for line in lines] for lines in ([3, 4], [5, 7, 8], [9, 10, 11, 12])]
    for labelled in (False, True):  # a byte-order mark first: dropped, its row scored
        lines = criteo_model["rows"].splitlines()[:5]
        data.write_bytes(b"\xef\xbb\xbf" + "".join(
            (line if labelled else line.split("\t", 1)[1]) + "\n" for line in lines).encode())
        chunks = list(raw_criteo_chunks(data, str(criteo_model["dataset"]), 13, features, 4))
        assert [len(chunk.dense) for chunk in chunks] == [4, 1]
        assert (chunks[0].labels is not None) == labelled


def test_raw_rows_need_a_criteo_shaped_model():
    features = [{"name": f"cat_{i}", "cardinality": 10} for i in range(8)]
    with pytest.raises(DataError, match=r"^--raw-criteo: the model takes 13 dense values and 8 "
                                        r"categorical features, raw Criteo rows have 13 and 26"):
        raw_criteo_chunks(Path("rows.tsv"), "dataset", 13, features, 16)


def spoil(row: str, field: int, value: str) -> str:
    fields = row.split("\t")
    fields[field] = value
    return "\t".join(fields)


def add_vocabulary(dataset: str, values: Sequence[np.ndarray]) -> Vocabulary:
    """Give an existing dataset the vocabulary `values` (per feature, kept values in id order)
    and name it in its feature_spec.yaml."""
    vocabulary = Vocabulary([np.asarray(v).astype(DTYPE) for v in values])
    vocabulary.save(dataset)
    fspec = load_feature_spec(dataset)
    fspec.notes[KEY] = FOLDER
    fspec.save()
    return vocabulary


def write_dataset(path: Path, cardinalities: Sequence[int],
                  vocabulary: Optional[Sequence[np.ndarray]] = None) -> Path:
    """A split-binary dataset of 4 rows with these tables; with `vocabulary` when given, else
    one of values 0x100 * id."""
    spec = DataSpec(13, list(cardinalities), [1] * len(cardinalities))
    with SplitBinaryWriter(str(path), spec) as writer:
        for split in ("train", "validation", "test"):
            writer.write(split, np.zeros(4), np.zeros((4, 13)),
                         [np.zeros((4, 1), np.int64) for _ in cardinalities])
    add_vocabulary(str(path), vocabulary if vocabulary is not None else
                   [np.arange(1, c) * 0x100 for c in cardinalities])
    return path


def test_ids_are_positions_in_the_files_and_unknown_or_missing_values_map_to_0(tmp_path):
    values = [np.array([0xFFFFFFFF, 7, 0x00000010], np.uint32), np.array([], np.uint32),
              np.array([5], np.uint32)]
    dataset = write_dataset(tmp_path / "d", [4, 1, 2], values)
    assert (dataset / "vocabulary" / "cat_0.bin").read_bytes() == bytes.fromhex(
        "ffffffff" "07000000" "10000000")  # little-endian uint32, id order
    vocabulary = Vocabulary.load(str(dataset))
    assert vocabulary.cardinalities == [4, 1, 2]
    cats = np.array([[7, 3, 5], [-1, -1, -1], [0xFFFFFFFF, 5, 6], [16, 0, 4], [8, 0, 5]])
    assert vocabulary.map(cats).tolist() == [[2, 0, 1], [0, 0, 0], [1, 0, 0], [3, 0, 0],
                                             [0, 0, 1]]
    assert vocabulary.map(cats).dtype == np.uint32
    keys, ids = vocabulary.lookup_tables()[0]
    assert keys.tolist() == [7, 16, 0xFFFFFFFF] and ids.tolist() == [2, 3, 1]
    assert vocabulary.save(str(tmp_path / "copy")) == 4 * 4
    assert (tmp_path / "copy" / "vocabulary" / "cat_0.bin").read_bytes() == \
        (dataset / "vocabulary" / "cat_0.bin").read_bytes()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "vocabulary" / "cat_1.bin").unlink(),
     r"vocabulary/cat_1.bin: missing; the dataset's vocabulary is incomplete: preprocess the raw "
     r"Criteo files again$"),
    (lambda d: (d / "vocabulary" / "cat_0.bin").write_bytes(bytes(8)),
     r"vocabulary/cat_0.bin: 8 bytes, expected 4 x 3 \(feature_spec.yaml gives cat_0 4 ids, id 0 "
     r"having no value\); the vocabulary does not belong to this dataset"),
    (lambda d: (d / "vocabulary" / "cat_0.bin").write_bytes(bytes(13)),
     r"vocabulary/cat_0.bin: 13 bytes, expected 4 x 3"),
    (lambda d: (d / "vocabulary" / "cat_2.bin").write_bytes(bytes.fromhex("0a000000" * 3)),
     r"vocabulary/cat_2.bin: value 0000000a is listed twice; the vocabulary is corrupt"),
    (lambda d: (d / "feature_spec.yaml").unlink(),
     r"d: not a dataset \(no feature_spec.yaml\); give the folder `preprocess criteo` wrote$"),
])
def test_a_vocabulary_that_does_not_fit_its_dataset_is_a_one_line_error(tmp_path, damage,
                                                                          message):
    dataset = write_dataset(tmp_path / "d", [4, 3, 4])
    assert Vocabulary.load(str(dataset)).cardinalities == [4, 3, 4]
    damage(dataset)
    with pytest.raises(DataError, match=message):
        Vocabulary.load(str(dataset))
