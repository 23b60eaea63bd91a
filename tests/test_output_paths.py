"""No command writes over one of its inputs, however the paths are spelled: the rule, then each
writing command refusing through the CLI (predict and export: test_cli.py, which has their
model and checkpoint)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import ROOT, failure, run_cli
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import refuse_overwriting_inputs


@pytest.fixture
def data(tmp_path):
    """An input folder with a file two levels down, and a file beside it."""
    (tmp_path / "data" / "test").mkdir(parents=True)
    (tmp_path / "data" / "test" / "label.bin").write_bytes(b"\x01\x00")
    (tmp_path / "model.pt").write_bytes(b"weights")
    return tmp_path


def refusal(out: str, source: str) -> str:
    with pytest.raises(UserError) as e:
        refuse_overwriting_inputs([("--out", out)], [("--in", source)], "cmd")
    return str(e.value)


@pytest.mark.parametrize("spelling", ["relative", "dotted", "symlink", "hard link"])
def test_an_output_that_is_an_input_is_refused_however_spelled(data, spelling, monkeypatch):
    monkeypatch.chdir(data)
    out = {"relative": "model.pt", "dotted": f"../{data.name}/./model.pt",
           "symlink": "link.pt", "hard link": "hard.pt"}[spelling]
    if spelling == "symlink":
        os.symlink("model.pt", "link.pt")
    if spelling == "hard link":
        os.link("model.pt", "hard.pt")
    assert refusal(out, str(data / "model.pt")) == \
        f"cmd: --out {out} is --in {data / 'model.pt'}, an input; write it elsewhere"


def test_a_folder_output_holding_an_input_is_refused(data):
    assert " holds --in " in refusal(str(data), str(data / "data" / "test" / "label.bin"))


@pytest.mark.parametrize("spelling", ["path", "symlink", "hard link"])
def test_an_existing_file_inside_an_input_folder_is_refused(data, spelling):
    inside = data / "data" / "test" / "label.bin"
    out = {"path": inside, "symlink": data / "link", "hard link": data / "hard"}[spelling]
    if spelling == "symlink":
        out.symlink_to(inside)
    if spelling == "hard link":
        os.link(inside, out)
    assert " would replace a file inside --in " in refusal(str(out), str(data / "data"))


def test_new_outputs_and_unset_or_missing_paths_pass(data):
    refuse_overwriting_inputs(
        [("--out", str(data / "data" / "new.txt")), ("--plot", None), ("--o", "")],
        [("--model", str(data / "model.pt")), ("--data", str(data / "data")), ("--config", None),
         ("--gone", str(data / "gone"))], "cmd")
    refuse_overwriting_inputs([("--out", str(data / "model.pt"))],
                              [("--gone", str(data / "gone"))], "cmd")


def assert_refused(args, kept: Path, *named: str) -> None:
    """Through the CLI: exit 2, one line naming both paths, `kept`'s bytes unchanged."""
    before = kept.read_bytes()
    result = run_cli(args)
    assert result.returncode == 2, failure(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and all(text in lines[0] for text in named), lines
    assert kept.read_bytes() == before


def test_plan_out_spelled_relative_is_refused_over_its_config(tmp_path):
    config = tmp_path / "demo.yaml"
    config.write_bytes((ROOT / "configs/demo.yaml").read_bytes())
    relative = os.path.relpath(config, ROOT)  # run_cli runs in ROOT
    assert_refused(["plan", "--config", str(config), "--out", relative], config,
                   f"plan: --out {relative} is --config {config}")


def test_plan_plot_through_a_symlink_is_refused_over_its_cardinalities(tmp_path):
    """matplotlib writes through the link: the old code replaced the rows with a PNG."""
    rows, link = tmp_path / "rows.txt", tmp_path / "rows.png"
    rows.write_text("1000, 2000\n")
    link.symlink_to(rows)
    assert_refused(["plan", "--cardinalities", str(rows), "--set", "data.hotness=[1]",
                    "--plot", str(link)], rows, f"plan: --plot {link} is --cardinalities {rows}")


def test_synth_output_through_a_symlink_is_refused_over_its_config(tmp_path):
    config, link = tmp_path / "tiny.yaml", tmp_path / "data"
    config.write_text("data: {cardinalities: [5], hotness: [1], train_samples: 10}\n")
    link.symlink_to(config)
    assert_refused(["synth", "--config", str(config), "--output", str(link)], config,
                   f"synth: --output {link} is --config {config}")


def test_preprocess_criteo_output_holding_an_input_is_refused(tmp_path):
    day = tmp_path / "raw" / "day_0"
    day.parent.mkdir()
    day.write_text("1\t" + "\t" * 38 + "\n")
    parent = f"{day.parent}/../raw/"
    assert_refused(["preprocess", "criteo", "--input", str(day), "--output", parent], day,
                   f"preprocess criteo: --output {parent} holds --input {day}")


@pytest.mark.parametrize("format", ["npy", "multihot"])
def test_preprocess_output_that_is_its_input_folder_is_refused(tmp_path, format):
    (tmp_path / "in").mkdir()
    kept = tmp_path / "in" / "feature_spec.yaml"
    kept.write_text("feature_spec: {}\n")
    (tmp_path / "link").symlink_to(tmp_path / "in", target_is_directory=True)
    assert_refused(["preprocess", format, "--input", str(tmp_path / "in"), "--output",
                    str(tmp_path / "link")], kept,
                   f"preprocess {format}: --output {tmp_path / 'link'} is --input {tmp_path / 'in'}")


def test_train_refuses_a_run_directory_whose_config_yaml_is_its_config(tmp_path):
    """An experiment folder holding its own config.yaml and `train.run_dir: .`: the run would
    write its resolved config over the hand-written one (a run's own config.yaml, beside its
    metrics.jsonl, is a record the run may rewrite on resume)."""
    config = tmp_path / "config.yaml"
    config.write_text("# tuned by hand\ndata: {global_batch_size: 64, train_samples: 256}\n"
                      f"train: {{max_steps: 1, run_dir: {tmp_path}}}\n")
    before = config.read_bytes()
    result = run_cli(["train", "--config", str(config)])
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [
        f"error: train.run_dir: {tmp_path} holds --config {config}, and a run writes its "
        f"resolved config.yaml there; keep yours elsewhere, or use another train.run_dir"]
    assert config.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [
        "config.yaml"]


@pytest.mark.parametrize("command", [
    ["preprocess", "criteo", "--input", "{log}", "--workers", "1"],
    ["preprocess", "interactions", "--input", "{log}", "--columns", "user,item"],
    ["preprocess", "impressions", "--impressions", "{log}"],
    ["preprocess", "yambda", "--input", "{folder}"],
    ["preprocess", "yambda", "--generate", "10"],
    ["synth", "--set", "data.train_samples=10"],
    ["synth", "--config", "configs/two_tower_demo.yaml"]])
def test_an_output_under_a_file_is_one_line_before_any_work(tmp_path, command):
    """`--output notes.txt/data` (a typo) was a NotADirectoryError traceback, some after the
    whole input was read."""
    (tmp_path / "notes.txt").write_text("kept\n")
    (tmp_path / "log").write_text("u1,i1\n")
    (tmp_path / "folder").mkdir()
    out = tmp_path / "notes.txt" / "data"
    args = [a.format(log=tmp_path / "log", folder=tmp_path / "folder") for a in command]
    result = run_cli([*args, "--output", str(out)])
    assert (result.returncode, result.stderr.strip().splitlines()) == (2, [
        f"error: --output: {out} cannot be made: {tmp_path / 'notes.txt'} is a file; choose a "
        f"folder"]), failure(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "log", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "kept\n"
