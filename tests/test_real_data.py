"""End to end on raw Criteo-format logs: preprocess (with planted bad rows), then train and
evaluate on the result with either loader."""

import json
import random

import pytest

from conftest import read_metrics, run_cli, train_with_each_loader

PLANTED = {"wrong_field_count": 3, "bad_label": 2, "bad_category": 4, "bad_numeric": 5,
           "crlf": 6, "blank_line": 7}


def criteo_line(rng: random.Random) -> str:
    hot = lambda k: f"{rng.choice(range(k)) * 2654435761 % 2**32:08x}"  # noqa: E731
    ints = ["" if rng.random() < 0.1 else str(rng.randint(-2, 500)) for _ in range(13)]
    cats = ["" if rng.random() < 0.05 else hot(rng.choice([5, 50, 500])) for _ in range(26)]
    label = "1" if int(cats[0] or "0", 16) % 3 == 0 or rng.random() < 0.1 else "0"
    return "\t".join([label, *ints, *cats])


def spoiled(rng: random.Random, field: int, value: str) -> str:
    fields = criteo_line(rng).split("\t")
    fields[field] = value
    return "\t".join(fields) + "\n"


@pytest.fixture(scope="module")
def raw_tsv(tmp_path_factory):
    """4,000 good rows with the planted bad ones spread through them."""
    rng = random.Random(0)
    lines = [criteo_line(rng) + "\n" for _ in range(4000)]
    bad = (["\t".join(criteo_line(rng).split("\t")[:30]) + "\n"] * PLANTED["wrong_field_count"]
           + [spoiled(rng, 0, "2")] * PLANTED["bad_label"]
           + [spoiled(rng, 39, "zzzzzzzz")] * PLANTED["bad_category"]
           + [spoiled(rng, 1, "1.5")] * PLANTED["bad_numeric"]
           + [criteo_line(rng) + "\r\n" for _ in range(PLANTED["crlf"])]
           + ["\n"] * PLANTED["blank_line"])
    for line in bad:
        lines.insert(rng.randrange(len(lines)), line)
    path = tmp_path_factory.mktemp("raw") / "train.txt"
    path.write_text("".join(lines))
    return path


@pytest.fixture(scope="module")
def preprocessed(raw_tsv, tmp_path_factory):
    out = tmp_path_factory.mktemp("pre") / "criteo"
    result = run_cli(["preprocess", "criteo", "--input", str(raw_tsv), "--output", str(out),
                      "--frequency-threshold", "2", "--workers", "2"])
    assert result.returncode == 0, result.stderr
    return out, result


def test_preprocess_counts_every_planted_bad_row(preprocessed):
    out, result = preprocessed
    report = json.loads((out / "preprocess_report.json").read_text())
    assert report["bad_rows"] == PLANTED
    assert report["rows_written"]["total"] == 4000 + PLANTED["crlf"]  # CRLF rows are kept
    assert report["rows_per_s"] > 0 and report["peak_rss_bytes"] > 0
    assert "rows/s" in result.stdout


def test_strict_mode_names_the_first_bad_line(raw_tsv, tmp_path):
    result = run_cli(["preprocess", "criteo", "--input", str(raw_tsv), "--output",
                      str(tmp_path / "strict"), "--strict", "--workers", "2"])
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    first_bad = next(i for i, text in enumerate(raw_tsv.read_bytes().split(b"\n"), start=1)
                     if text.count(b"\t") != 39 or text.endswith(b"\r") or text.startswith(b"2")
                     or b"zzzz" in text or b"\t1.5\t" in text)
    assert line.startswith(f"error: {raw_tsv}:{first_bad}: ")
    assert not (tmp_path / "strict").exists()


def test_train_and_evaluate_with_either_loader_gives_the_same_losses(preprocessed, tmp_path,
                                                                     process_group):
    out, _ = preprocessed
    runs = train_with_each_loader(out, tmp_path, process_group, batch=128, steps=30)
    for loader in ("torch", "dali"):  # the loader that fed the steps, as the run recorded it
        assert [e["loader"] for e in read_metrics(tmp_path / loader) if "loader" in e] == [loader]
    torch_run, dali_run = runs["torch"], runs["dali"]
    assert len(torch_run.losses) == 30 and torch_run.losses[-1] < torch_run.losses[0]
    assert 0.5 < torch_run.metrics["val_auc"] <= 1 and "oracle_auc" not in torch_run.metrics
    assert dali_run.losses == torch_run.losses and dali_run.metrics == torch_run.metrics
