"""Commands as a user runs them, with their defaults: a tiny dataset written by `synth`, trained
on for two steps, evaluated and exported; and `predict`/`export` refusing to write over what
they read; `bench` with every default. (The other commands run through the CLI beside their
code's tests: plan in test_plan.py, preprocess in test_preprocess.py, predict in test_serving.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ROOT, done_fields, failure, read_metrics, run_cli

TINY = """\
model: {embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1]}
data: {global_batch_size: 64, num_dense: 3, cardinalities: [50, 20, 7], hotness: [1, 2, 1],
       train_samples: 512, val_samples: 128}
train: {max_steps: 2, log_every: 1, progress_bar: false}
"""


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{dataset, run, checkpoint, model} and the commands' outputs: `synth`, then `train` on its
    files, then `export` of the checkpoint, each with its defaults."""
    root = tmp_path_factory.mktemp("cli")
    (root / "tiny.yaml").write_text(TINY)
    paths = {"dataset": root / "data", "run": root / "run", "model": root / "model.pt",
             "checkpoint": root / "run" / "checkpoints" / "step_2"}
    paths["synth"] = run_cli(["synth", "--config", str(root / "tiny.yaml"),
                              "--output", str(paths["dataset"])])
    assert paths["synth"].returncode == 0, failure(paths["synth"])
    paths["train"] = run_cli(["train", "--config", str(root / "tiny.yaml"), "--set",
                              f"data.path={paths['dataset']}", "--set", f"train.run_dir={paths['run']}"])
    assert paths["train"].returncode == 0, failure(paths["train"])
    paths["export"] = run_cli(["export", "--checkpoint", str(paths["checkpoint"]),
                               "--out", str(paths["model"])])
    assert paths["export"].returncode == 0, failure(paths["export"])
    return paths


def test_synth_writes_a_dataset_that_train_reads(made):
    assert made["synth"].stdout.strip() == (f"wrote {made['dataset']}: train 512, validation 128, "
                                            f"test 128")
    done = done_fields(made["train"].stdout)
    assert done["steps"] == 2 and 0.5 < done["oracle_auc"] < 1  # true_prob read from the files
    assert [m["step"] for m in read_metrics(made["run"]) if "loss" in m] == [1, 2]
    assert f"path: {made['dataset']}" in (made["run"] / "config.yaml").read_text()


def test_synth_over_an_existing_file_is_a_one_line_error(made, tmp_path):
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    result = run_cli(["synth", "--config", str(made["dataset"].parent / "tiny.yaml"),
                      "--output", str(taken)])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --output: {taken} exists and is not empty; choose a new folder"]
    assert taken.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "notes.txt"]


def test_eval_scores_the_test_split_by_default(made):
    result = run_cli(["eval", "--checkpoint", str(made["checkpoint"])])
    assert result.returncode == 0, failure(result)
    (last,) = result.stdout.strip().splitlines()  # its result alone: no placement table
    assert last.startswith(f"eval: checkpoint={made['checkpoint']} step=2 split=test test_auc=")
    assert " samples=128 " in last  # the test split's rows


def test_export_writes_the_model_and_its_description_beside_it(made):
    assert made["model"].stat().st_size > 0
    assert made["model"].with_suffix(".json").stat().st_size > 0
    assert made["export"].stdout.startswith(f"wrote {made['model']} (")


def assert_refused(result, kept: Path, before: bytes, *named: str) -> None:
    """Exit 2, one line naming the output and the input (`named`), the input's bytes unchanged."""
    assert result.returncode == 2, failure(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(text in lines[0] for text in named), lines
    assert kept.read_bytes() == before


def test_predict_refuses_an_out_that_is_its_model_spelled_relative(made):
    model = made["model"]
    before = model.read_bytes()
    relative = os.path.relpath(model, ROOT)  # run_cli runs in ROOT
    result = run_cli(["predict", "--model", str(model), "--data", str(made["dataset"]),
                      "--out", relative])
    assert_refused(result, model, before, f"--out {relative} is --model {model}")


def test_predict_refuses_an_out_that_is_its_models_description(made):
    """model.json, the description `export` wrote beside model.pt, is part of the model."""
    description = made["model"].with_suffix(".json")
    before = description.read_bytes()
    result = run_cli(["predict", "--model", str(made["model"]), "--data", str(made["dataset"]),
                      "--out", str(description)])
    assert_refused(result, description, before, f"--out {description} is --model's description")


def test_export_refuses_a_description_over_a_checkpoint_file(made, tmp_path):
    """--out LINK/meta.pt, LINK a symlink to the checkpoint: its description LINK/meta.json
    would replace the checkpoint's meta.json."""
    link = tmp_path / "link"
    link.symlink_to(made["checkpoint"], target_is_directory=True)
    meta = made["checkpoint"] / "meta.json"
    before = meta.read_bytes()
    result = run_cli(["export", "--checkpoint", str(made["checkpoint"]),
                      "--out", str(link / "meta.pt")])
    assert_refused(result, meta, before, f"{link / 'meta.json'} would replace a file inside "
                   f"--checkpoint {made['checkpoint']}")
    assert not (made["checkpoint"] / "meta.pt").exists()


def test_export_state_dict_refuses_to_replace_a_checkpoint_file(made):
    weights = made["checkpoint"] / "__0_0.distcp"
    before = weights.read_bytes()
    relative = os.path.relpath(weights, ROOT)
    result = run_cli(["export", "--state-dict", "--checkpoint", str(made["checkpoint"]),
                      "--out", relative])
    assert_refused(result, weights, before, f"--out {relative} would replace a file inside "
                   f"--checkpoint {made['checkpoint']}")


@pytest.mark.parametrize("out, error", [
    ("missing/weights.pt", "--out: folder {tmp}/missing does not exist; create it first"),
    ("folder", "--out: {tmp}/folder is a folder; give a file name in it")])
def test_export_state_dict_to_a_path_it_cannot_write_is_one_line(made, tmp_path, out, error):
    (tmp_path / "folder").mkdir()
    result = run_cli(["export", "--state-dict", "--checkpoint", str(made["checkpoint"]),
                      "--out", str(tmp_path / out)])
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [f"error: {error.format(tmp=tmp_path)}"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["folder"]


def test_bench_runs_with_every_default():
    result = run_cli(["bench"])
    assert result.returncode == 0, failure(result)
    last = dict(item.split("=", 1) for item in result.stdout.strip().splitlines()[-1].split()[1:])
    assert last["precision"] == "fp32" and float(last["samples_per_s"]) > 0
    assert float(last["baseline_samples_per_s"]) > 0
