"""The checkpoint reader: real checkpoints load as before, while a crafted `.metadata` or
non-tensor entry is a one-line DataError and its payload never runs (issue 11, B9)."""

import os
import pickle
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from shared_runs import DEMO_STEPS
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.train.checkpoint_reader import SafeFileSystemReader, checkpoint_reader
from dlrm_hybrid.train.loop import train



class Payload:
    """Pickles as a call of `fn(arg)`: what a crafted checkpoint would plant."""

    def __init__(self, fn, arg):
        self.fn, self.arg = fn, arg

    def __reduce__(self):
        return self.fn, (self.arg,)


def load_keys(keys, **where):
    with warnings.catch_warnings():  # "no process group: loading in one process" (intended)
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(keys=keys, **where)


@pytest.fixture(scope="module")
def trained(demo_checkpoint):
    """A checkpoint this program wrote (sharded tables, fused optimizer state): the session's
    shared demo run (shared_runs.py), read only; tests that change it copy it."""
    return demo_checkpoint


@pytest.fixture
def small(tmp_path, process_group):
    """A DCP checkpoint with a non-tensor entry (as GradScaler or param-group state is stored),
    and the state it holds."""
    state = {"w": torch.randn(6, 4), "step": torch.tensor(7), "scaler": {"scale": 1024.0,
                                                                          "growth": 3}}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt")
    return tmp_path / "ckpt", state


def test_a_written_checkpoint_loads_through_the_reader_exactly_as_with_dcps_own(trained):
    """The allowlist admits all that torch writes: the export path (_load_state_dict_from_keys)
    and dcp.load give the tensors DCP's stock reader gives."""
    metadata = checkpoint_reader(trained).read_metadata()
    assert any(k.startswith("optim.") for k in metadata.state_dict_metadata)
    stock = load_keys({"model"}, checkpoint_id=str(trained))["model"]
    safe = load_keys({"model"}, storage_reader=checkpoint_reader(trained))["model"]
    assert safe.keys() == stock.keys() and len(stock) > 10
    for name, tensor in stock.items():
        assert torch.equal(safe[name], tensor), name

    state = {"model": {name: torch.zeros_like(t) for name, t in stock.items()}}
    dcp.load(state, storage_reader=checkpoint_reader(trained))
    for name, tensor in stock.items():
        assert torch.equal(state["model"][name], tensor), name


def test_dcp_load_restores_tensors_and_plain_entries(small):
    """Non-tensor entries go through weights_only=True and a re-serialized copy, intact."""
    path, saved = small
    state = {"w": torch.zeros(6, 4), "step": torch.tensor(0), "scaler": {"scale": 0.0,
                                                                          "growth": 0}}
    reader = checkpoint_reader(path)
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], saved["w"]) and int(state["step"]) == 7
    assert state["scaler"] == {"scale": 1024.0, "growth": 3}
    again = {"w": torch.zeros(6, 4)}  # the same reader serves a second load (model, then optim)
    dcp.load(again, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(again["w"], saved["w"])


@pytest.mark.parametrize("payload", ["os.system", "exec", "nested"])
def test_a_planted_metadata_is_refused_and_nothing_runs(trained, tmp_path, payload):
    """A pickle that would touch a file: refused with the one-line error, the file never made.
    The same bytes do create it under plain pickle, so the payload is live."""
    marker = tmp_path / "pwned"
    if payload == "os.system":
        evil = Payload(os.system, f"touch {marker}")
    elif payload == "exec":
        evil = Payload(exec, f"open({str(marker)!r}, 'w').close()")
    else:  # allowed classes first, the call deep inside them
        evil = checkpoint_reader(trained).read_metadata()
        evil.storage_meta.save_id = Payload(os.system, f"touch {marker}")
    data = pickle.dumps(evil)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(data)

    with pytest.raises(DataError) as error:
        checkpoint_reader(folder)
    message = str(error.value)
    assert message.startswith(f"{folder}: the checkpoint metadata references a disallowed object")
    assert "not a checkpoint this program wrote" in message and "nothing in it was run" in message
    assert "\n" not in message
    assert not marker.exists()

    pickle.loads(data)
    assert marker.exists()


def test_a_planted_non_tensor_entry_is_refused_and_nothing_runs(tmp_path, process_group,
                                                               monkeypatch):
    """DCP reads non-tensor entries with torch.load(weights_only=False): the reader refuses a
    crafted one when it is made, and again inside dcp.load should that first check be missed."""
    marker = tmp_path / "pwned"
    dcp.save({"w": torch.ones(3), "x": Payload(os.system, f"touch {marker}")},
             checkpoint_id=tmp_path / "evil")
    assert not marker.exists()
    with pytest.raises(DataError) as error:
        checkpoint_reader(tmp_path / "evil")
    assert str(error.value).startswith(f"{tmp_path / 'evil'}: the checkpoint entry x references "
                                       f"a disallowed object (posix.system)")
    assert "\n" not in str(error.value) and not marker.exists()

    monkeypatch.setattr(SafeFileSystemReader, "_check_plain_entries", lambda self, md: None)
    with pytest.raises(CheckpointException) as error:
        dcp.load({"w": torch.zeros(3), "x": 0.0},
                 storage_reader=checkpoint_reader(tmp_path / "evil"))
    assert "checkpoint entry x references a disallowed object" in str(error.value)
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "not_metadata"])
def test_a_damaged_metadata_is_the_corrupt_error(trained, tmp_path, damage):
    original = (trained / ".metadata").read_bytes()
    data = {"truncated": original[: len(original) // 2], "empty": b"",
            "garbage": os.urandom(256), "not_metadata": pickle.dumps({"a": [1, 2]})}[damage]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(data)
    with pytest.raises(DataError) as error:
        checkpoint_reader(folder)
    assert str(error.value).startswith(f"{folder}: the checkpoint metadata (.metadata) is "
                                       f"truncated or corrupt (")
    assert "\n" not in str(error.value)


def test_metadata_naming_a_file_outside_the_folder_is_refused(small, tmp_path):
    """DCP joins the stored relative path to the folder: `../` would read any file."""
    path, _ = small
    metadata = checkpoint_reader(path).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(DataError, match=r"points at a file outside the checkpoint folder"):
        checkpoint_reader(path)


def linked_out(trained, tmp_path, name):
    """A copy of `trained` whose file `name` is a symbolic link to an identical file outside."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(trained, folder)
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    (folder / name).rename(outside)
    (folder / name).symlink_to(outside)
    return folder, outside


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
def test_a_file_linked_out_of_the_folder_is_refused_naming_it(trained, tmp_path, name):
    folder, outside = linked_out(trained, tmp_path, name)
    with pytest.raises(DataError) as error:
        checkpoint_reader(folder)
    assert str(error.value) == (f"{folder / name}: a link to {outside}, outside the checkpoint "
                                f"folder; put the file itself in the folder")


def test_eval_refuses_a_checkpoint_with_a_file_linked_out_of_it(trained, tmp_path):
    """The digest check reads no file through such a link either: a link to a copy of the
    very file (its digest matches) is refused as well."""
    from conftest import run_cli
    from dlrm_hybrid.train.checkpoint import check_checkpoint

    folder, outside = linked_out(trained, tmp_path, "__0_0.distcp")
    refused = (f"{folder / '__0_0.distcp'}: a link to {outside}, outside the checkpoint folder; "
               f"put the file itself in the folder")
    result = run_cli(["eval", "--checkpoint", str(folder), "--split", "val"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {refused}"]
    with pytest.raises(DataError) as error:
        check_checkpoint(folder, print)
    assert str(error.value) == refused


def test_a_folder_without_metadata_is_a_one_line_error(tmp_path):
    with pytest.raises(DataError, match=r"no \.metadata in it; it is not a complete checkpoint"):
        checkpoint_reader(tmp_path)


def rehash(checkpoint, name):
    """Record the current digest of `checkpoint`'s file `name` in its meta.json."""
    import hashlib
    import json

    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["sha256"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_eval_export_and_resume_refuse_a_planted_checkpoint(trained, tmp_path, process_group):
    """A real checkpoint folder whose `.metadata` was replaced: every command that reads
    checkpoints stops with the one-line error, and the payload never runs."""
    import shutil

    from conftest import run_cli

    marker = tmp_path / "pwned"
    planted = tmp_path / "run" / "checkpoints" / trained.name
    shutil.copytree(trained, planted)
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(os.system, f"touch {marker}")))
    rehash(planted, ".metadata")  # digests are no defence against a crafted folder
    commands = {
        "eval": ["eval", "--checkpoint", str(planted), "--split", "val"],
        "export": ["export", "--checkpoint", str(planted), "--out", str(tmp_path / "m.pt")],
    }
    refused = f"{planted}: the checkpoint metadata references a disallowed object"
    for name, args in commands.items():
        result = run_cli(args)
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: {refused}"), name
        assert not marker.exists(), name
    assert not (tmp_path / "m.pt").exists()
    resumed = load_config(str(planted / "config.yaml"), [  # resume: auto finds the planted one
        f"train.run_dir={tmp_path / 'run'}", "checkpoint.resume=auto",
        f"train.max_steps={DEMO_STEPS + 1}"])
    with pytest.raises(DataError, match=re.escape(refused)):
        train(resumed, process_group)
    assert not marker.exists()
