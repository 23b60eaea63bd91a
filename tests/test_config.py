"""Config loading, overrides, and the one-line errors (exit code 2) a user sees for bad input."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from dlrm_hybrid.config import ConfigError, parse_bytes
from dlrm_hybrid.config_loading import load_config


def test_every_shipped_config_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(str(path), world_size=2)


def test_overrides_are_typed_and_nested():
    cfg = load_config(str(ROOT / "configs/demo.yaml"),
                      ["train.max_steps=40", "data.cardinalities=[7, 8]", "data.hotness=[1]",
                       "optim.dense_lr=1"])
    assert cfg.train.max_steps == 40
    assert cfg.data.cardinalities == [7, 8]
    assert cfg.optim.dense_lr == 1.0 and isinstance(cfg.optim.dense_lr, float)
    assert load_config(None, ["optim.eps=1e-6"]).optim.eps == 1e-6  # a string to YAML 1.1


@pytest.mark.parametrize("override, world, needle", [
    ("train.max_stepz=3", 1, "train.max_stepz: unknown key"),
    ("bogus.key=3", 1, "bogus: unknown key"),
    ("train.max_steps=abc", 1, "train.max_steps: expected int"),
    ("data.cardinalities=5", 1, "data.cardinalities: expected a list"),
    ("data.global_batch_size=1000", 3, "data.global_batch_size: 1000 is not divisible by the world size 3"),
    ("model.embedding_dim=32", 1, "model.embedding_dim: 32 must equal the bottom MLP output"),
    ("parallel.backend=mpi", 1, "parallel.backend: 'mpi' is not one of"),
    ("parallel.memory_per_rank=lots", 1, "parallel.memory_per_rank: 'lots' is not a size"),
    ("model.top_mlp=[1]", 1, "model.top_mlp: [1] has no hidden layer"),
    ("model.dcn.layers=0", 1, "model.dcn.layers: must be positive"),
    ("optim.dense_lr=-0.1", 1, "optim.dense_lr: expected a finite number of at least 0, got -0.1"),
    ("optim.embedding_lr=.nan", 1, "optim.embedding_lr: expected a finite number of at least 0"),
    ("optim.eps=-1e-8", 1, "optim.eps: expected a finite number of at least 0, got -1e-08"),
    ("optim.decay_power=.inf", 1, "optim.decay_power: expected a finite number, got inf"),
])
def test_bad_values_raise_one_named_error(override, world, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_config(str(ROOT / "configs/demo.yaml"), [override], world_size=world)


def test_cat_interaction_does_not_need_matching_dims():
    cfg = load_config(None, ["model.interaction=cat", "model.embedding_dim=4"])
    assert cfg.model.embedding_dim == 4


@pytest.mark.parametrize("override, needle", [
    ("train.max_stepz=3", "train.max_stepz: unknown key"),
    ("train.max_steps=abc", "train.max_steps: expected int, got 'abc'"),
    ("data.global_batch_size=1001", "data.global_batch_size: 1001 is not divisible by the world size 2"),
    ("model.embedding_dim=32", "model.embedding_dim: 32 must equal the bottom MLP output"),
    ("model.compositional=[{features: [cat_0]", "--set model.compositional: '[{features: [cat_0]' "
                                                "is not a valid YAML value"),
])
def test_cli_reports_bad_config_in_one_line_with_exit_code_2(override, needle):
    # WORLD_SIZE as torchrun sets it: the divisibility check sees 2 ranks without starting them.
    result = run_cli(["train", "--config", "configs/demo.yaml", "--set", override],
                     extra_env={"WORLD_SIZE": "2"})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]


@pytest.mark.parametrize("command", ["train", "plan"])
def test_embedding_dim_not_a_multiple_of_4_is_a_config_error_not_a_torchrec_crash(tmp_path, command):
    """With `cat` no MLP width pins the dim; fbgemm asserts it inside torchrec (a traceback)."""
    run_dir = tmp_path / "run"
    result = run_cli([command, "--config", "configs/demo.yaml", "--set", "model.interaction=cat",
                      "--set", "model.embedding_dim=6", "--set", f"train.run_dir={run_dir}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == ("error: model.embedding_dim: 6 is not a multiple of 4, which "
                                     "fbgemm's embedding tables need (CPU and GPU); use 4 or 8")
    assert not run_dir.exists()


def test_cli_names_a_missing_config_file(tmp_path: Path):
    result = run_cli(["train", "--config", str(tmp_path / "nope.yaml")])
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "nope.yaml" in result.stderr


def test_a_key_given_twice_is_refused_not_the_first_dropped(tmp_path: Path):
    """YAML keeps the last of two equal keys: a second `model:` section appended at the end
    would silently drop every setting of the first."""
    config = tmp_path / "twice.yaml"
    config.write_text("model:\n  embedding_dim: 32\n  bottom_mlp: [64, 32]\n"
                      "data:\n  global_batch_size: 64\nmodel:\n  interaction: dot\n")
    with pytest.raises(ConfigError, match=f"^config file {config}: not valid YAML \\('model' "
                                          f"given twice \\(line 6\\)\\)$"):
        load_config(str(config))


def test_a_config_that_is_not_text_is_one_named_error(tmp_path: Path):
    binary = tmp_path / "model.pt"
    binary.write_bytes(b"PK\x03\x04\xb7\x00")
    with pytest.raises(ConfigError, match=f"^config file {binary}: not text"):
        load_config(str(binary))


def test_parse_bytes():
    assert parse_bytes("80GiB", "k") == 80 * 2**30
    assert parse_bytes("1.5MB", "k") == 1_500_000
    assert parse_bytes("auto", "k", allow_auto=True) is None


def test_configuration_doc_documents_every_config_key():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()  # the README links it
    def keys(tree: dict, prefix: str = ""):
        for key, value in tree.items():
            if isinstance(value, dict) and value:  # a section (data.cost_model is an empty map)
                yield from keys(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    missing = [key for key in keys(load_config(None).to_dict()) if f"`{key}`" not in doc]
    assert not missing, f"docs/configuration.md lacks {missing}"


def test_configuration_doc_gives_each_key_its_default():
    """The table's default column is what a config that leaves the key out gets."""
    import yaml

    defaults = load_config(None).to_dict()
    wrong = []
    for key, cell in re.findall(r"^\| `([\w.]+)` \| ([^|]*) \|", (ROOT / "docs" / "configuration.md")
                                .read_text(), re.M):
        value = defaults
        for part in key.split("."):
            value = value[part]
        written = yaml.safe_load(cell)
        if written != value and not (isinstance(value, float) and float(written) == value):
            wrong.append(f"{key}: doc {cell.strip()}, code {value!r}")
    assert not wrong, wrong


def test_forcing_nccl_without_gpus_is_a_one_line_error(tmp_path):
    """Said before torchrec, fbgemm and torch's compiler are imported (seconds a rank of a
    launch that fails here would spend on them): a fresh interpreter, its imports listed."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "dlrm_hybrid", "train",
                             "--set", "parallel.backend=nccl", "--set", f"train.run_dir={tmp_path}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    heavy = imported & {"torchrec", "fbgemm_gpu", "torch._dynamo"}
    assert not heavy, sorted(heavy)
    said = [line for line in result.stderr.splitlines() if not line.startswith("import time:")]
    assert said == ["error: parallel.backend: nccl needs one GPU per local rank, found 0 GPUs "
                    "for 1 ranks; use fewer ranks or parallel.backend=gloo"]
