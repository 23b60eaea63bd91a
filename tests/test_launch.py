"""The launch wrappers' commands, as each would run them: stand-ins for python, nvidia-smi,
docker, scontrol and srun on PATH record what they were asked (no training runs; the
multi-host join itself is run in test_distributed.py). Then how a launch that cannot run ends:
a config mistake before torchrun starts, an error only the ranks see after."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

RECORDER = """#!/usr/bin/env bash
{{ echo "$(basename "$0") TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${{TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}}"
  printf '%s\\n' "$@"; echo; }} >> {log}
"""


def stand_in(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.fixture
def tools(tmp_path):
    """A PATH folder of recording stand-ins (python, docker, srun) and where they record."""
    folder, log = tmp_path / "bin", tmp_path / "calls.txt"
    folder.mkdir()
    for name in ("python", "docker", "srun"):
        stand_in(folder, name, RECORDER.format(log=log))
    return folder, log


def launch(script: str, args: list, folder: Path, **env) -> subprocess.CompletedProcess:
    environment = {"PATH": f"{folder}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
                   "PYTHON": str(folder / "python"), **env}
    return subprocess.run(["bash", script, *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=60)


def calls(log: Path) -> list:
    """[(program, TORCH_DISABLE_SHARE_RDZV_TCP_STORE value, argv)] in call order."""
    found = []
    for block in log.read_text().split("\n\n"):
        if block.strip():
            head, *argv = block.strip("\n").split("\n")
            program, setting = head.split(" ")
            found.append((program, setting.split("=", 1)[1], argv))
    return found


SINGLE = ["-m", "dlrm_hybrid", "train", "--config", "configs/demo.yaml", "--set",
          "train.max_steps=5"]


@pytest.mark.parametrize("gpus, nproc_env, expected", [
    (0, None, 2), (3, None, 3), (3, "1", 1)], ids=["no-gpu", "three-gpus", "NPROC"])
def test_single_node_runs_torchrun_standalone_one_process_per_gpu(tools, gpus, nproc_env,
                                                                 expected):
    folder, log = tools
    listing = "".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})\\n" for i in range(gpus))
    stand_in(folder, "nvidia-smi", f"#!/usr/bin/env bash\nprintf '{listing}'\n"
             if gpus else "#!/usr/bin/env bash\nexit 9\n")  # 9: no driver loaded
    env = {"NPROC": nproc_env} if nproc_env else {}
    result = launch("launch/single_node.sh", ["configs/demo.yaml", "--set", "train.max_steps=5"],
                    folder, **env)
    assert result.returncode == 0, result.stderr
    assert calls(log) == [("python", "1", ["-m", "dlrm_hybrid.torchrun", "--standalone",
                                           f"--nproc_per_node={expected}", *SINGLE])]


def test_slurm_starts_one_torchrun_per_node_meeting_on_the_first_node(tools):
    """20,000 nodes: more host names than a pipe holds, so a reader that stops at the first
    line would have scontrol killed by SIGPIPE (and the script with it, under pipefail)."""
    folder, log = tools
    stand_in(folder, "scontrol", "#!/usr/bin/env bash\n"
             "[ \"$*\" = 'show hostnames gpu[00001-20000]' ] && seq -f 'gpu%05g' 1 20000\n")
    result = launch("launch/slurm.sbatch", ["configs/demo.yaml", "--set", "data.path=/d"], folder,
                    SLURM_JOB_NODELIST="gpu[00001-20000]", SLURM_JOB_NUM_NODES="20000",
                    SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=str(ROOT))
    assert result.returncode == 0, result.stderr
    assert calls(log) == [("srun", "1", [
        str(folder / "python"), "-m", "dlrm_hybrid.torchrun", "--nnodes=20000",
        "--nproc_per_node=8", "--rdzv_backend=c10d", "--rdzv_endpoint=gpu00001:29500",
        "--rdzv_id=4242", "--max-restarts=3", "-m", "dlrm_hybrid", "train", "--config",
        "configs/demo.yaml", "--set", "checkpoint.resume=auto", "--set", "data.path=/d"])]
    header = (ROOT / "launch/slurm.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in header and "#SBATCH --gpus-per-node=8" in header


def test_docker_run_mounts_data_and_runs_and_launches_single_node_inside(tools, tmp_path):
    folder, log = tools
    args = ["configs/criteo_1tb_fl15.yaml", "--set", "data.path=/data"]
    result = launch("launch/docker_run.sh", args, folder, DATA="/srv/criteo",
                    RUNS=str(tmp_path / "runs"), IMAGE="dlrm_hybrid:test")
    assert result.returncode == 0, result.stderr
    assert calls(log) == [("docker", "", [
        "run", "--rm", "--gpus", "all", "--ipc=host", "--ulimit", "memlock=-1", "--ulimit",
        "stack=67108864", "-v", "/srv/criteo:/data:ro", "-v", f"{tmp_path / 'runs'}:/workspace/runs",
        "dlrm_hybrid:test", "launch/single_node.sh", "configs/criteo_1tb_fl15.yaml",
        "--set", "train.run_dir=/workspace/runs/criteo_1tb_fl15", "--set", "data.path=/data"])]
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()  # the command runs from the
    assert {"WORKDIR /workspace/dlrm_hybrid", "COPY launch ./launch",
            "COPY configs ./configs"} <= set(dockerfile)  # checkout's copy, as itself, through
    assert not [line for line in dockerfile if line.startswith("ENTRYPOINT")]  # NGC's entry point

    log.unlink()
    missing = launch("launch/docker_run.sh", args, folder)
    assert missing.returncode != 0 and "set DATA to the dataset folder" in missing.stderr
    assert not log.exists()  # nothing started


def test_multi_node_restarts_from_the_newest_checkpoint_by_default(tools):
    """The join itself runs in test_distributed.py; here the settings it does not exercise."""
    folder, log = tools
    result = launch("launch/multi_node.sh", ["configs/demo.yaml"], folder, NNODES="4",
                    ENDPOINT="node0:29500", NPROC="8")
    assert result.returncode == 0, result.stderr
    assert calls(log) == [("python", "1", [
        "-m", "dlrm_hybrid.torchrun", "--nnodes=4", "--nproc_per_node=8", "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29500", "--rdzv_id=dlrm_hybrid", "--max-restarts=3",
        "-m", "dlrm_hybrid", "train", "--config", "configs/demo.yaml",
        "--set", "checkpoint.resume=auto"])]
    log.unlink()
    missing = launch("launch/multi_node.sh", ["configs/demo.yaml"], folder, NNODES="4")
    assert missing.returncode != 0 and "set ENDPOINT=host:port" in missing.stderr
    assert not log.exists()


def launch_on_cpu(args: list, tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """launch/single_node.sh with this interpreter and 2 CPU ranks; torchrun's files (it makes
    a torchelastic_* folder when it starts) in tmp_path/tmp."""
    (tmp_path / "tmp").mkdir()
    environment = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    environment.update(PYTHON=sys.executable, NPROC="2", OMP_NUM_THREADS="1",
                       CUDA_VISIBLE_DEVICES="", TMPDIR=str(tmp_path / "tmp"))
    return subprocess.run(["bash", "launch/single_node.sh", "configs/demo.yaml", *args], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("setting, error", [
    ("model.embedding_dim=abc", "error: model.embedding_dim: expected int, got 'abc'"),
    ("data.path=missing", "error: data.path: cannot read missing/feature_spec.yaml"),
    ("data.global_batch_size=1023", "error: data.global_batch_size: 1023 is not divisible by "
                                    "the world size 2"),
    ("model.size=2", "error: model.size: unknown key")], ids=["value", "data", "world", "key"])
def test_a_config_mistake_is_one_line_before_torchrun_starts(tmp_path, setting, error):
    result = launch_on_cpu(["--set", setting, "--set", f"train.run_dir={tmp_path / 'run'}"],
                           tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(error), result.stderr
    assert not list((tmp_path / "tmp").iterdir()) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", ["configs/nope.yaml", None], ids=["config", "checkpoint"])
def test_eval_under_the_launcher_checks_its_config_first(tmp_path, config):
    """The wrapper as `make demo` runs it (make demo takes no settings), running eval: with a
    --config, that file; without, the checkpoint's own config (here: no checkpoint at all)."""
    (tmp_path / "tmp").mkdir()
    checkpoint = tmp_path / "step_5"
    result = subprocess.run(
        [sys.executable, "-m", "dlrm_hybrid.torchrun", "--standalone", "--nproc_per_node=2",
         "-m", "dlrm_hybrid", "eval", "--checkpoint", str(checkpoint),
         *(["--config", config] if config else [])],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: config file configs/nope.yaml: cannot read (No such file or directory); check "
        "the path" if config else f"error: --checkpoint: {checkpoint} does not exist, and no "
        "checkpoint is published beside it; give a step_<n> folder of a run "
        "(train.run_dir/checkpoints)"]
    assert not list((tmp_path / "tmp").iterdir())


def test_an_error_only_ranks_see_ends_the_launch_in_the_ranks_line(tmp_path):
    """nccl on a host without GPUs: the ranks find out (the launcher imports no torch). Their
    line is the last one, with their exit code; torchrun's traceback and notices are gone."""
    result = launch_on_cpu(["--set", "parallel.backend=nccl"], tmp_path)
    assert result.returncode == 2, result.stderr
    said = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert said == ["error: parallel.backend: nccl needs one GPU per local rank, found 0 GPUs "
                    "for 2 ranks; use fewer ranks or parallel.backend=gloo"], result.stderr
    assert result.stderr.strip().splitlines()[-1] == said[0]
    assert not any(word in result.stderr for word in ("Traceback", "ChildFailedError", "FAILED"))


def test_failed_ranks_end_with_the_first_cause_and_its_exit_code(tmp_path, monkeypatch):
    """Which line the launcher ends with, and its exit code, for failures as torchrun reports
    them (in the order it saw the ranks end; those it stopped come last)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from dlrm_hybrid.rank_failure import record, summary

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    record("error: data.path: cannot read d/train/label.bin")
    user = ProcessFailure(0, 100, 2, str(tmp_path / "error.json"))
    crashed, killed, stopped = (ProcessFailure(1, 101, code, str(tmp_path / "none.json"))
                                for code in (1, -9, -15))
    assert summary({0: user, 1: stopped}) == (None, 2)  # its own line is the last
    assert summary({1: crashed, 0: user}) == ("error: data.path: cannot read d/train/label.bin",
                                              2)  # said again below the crash's traceback
    assert summary({1: crashed, 0: stopped}) == ("error: rank 1 exited with code 1", 1)
    assert summary({1: killed, 0: stopped}) == ("error: rank 1 was killed by SIGKILL", 137)


def test_a_user_error_one_rank_meets_mid_run_ends_the_launch_alone(tmp_path):
    """A dense nan only rank 1 reads, at step 5: rank 0's collective breaks when rank 1 stops,
    and it says nothing of its own (gloo's traceback once buried the cause): the output ends
    with rank 1's line, said once, and its exit code."""
    import numpy as np

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synth_dataset import write_synthetic

    data = tmp_path / "data"
    write_synthetic(load_config(None, ["data.train_samples=8000", "data.val_samples=1000"]).data,
                    str(data))
    numerical = np.memmap(data / "train" / "numerical.bin", np.float16, "r+")
    numerical[5000 * 13 + 4] = np.nan
    numerical.flush()
    result = launch_on_cpu(["--set", f"data.path={data}", "--set", "train.max_steps=7",
                            "--set", f"train.run_dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 2, result.stderr
    cause = (f"error (rank 1): {data}/train/numerical.bin: sample 5000's dense value 4 is nan, "
             f"not finite; ")
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(cause), result.stderr
    assert [line for line in lines if line.startswith("error")] == [lines[-1]], result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_rank_finds_the_user_error_a_peer_recorded(tmp_path, monkeypatch):
    """The error files torchrun gives an attempt's ranks, side by side: a peer's recorded line
    is found, not this rank's own, nor another program's failure record."""
    from dlrm_hybrid.rank_failure import KIND, peer_error

    for rank in "012":
        (tmp_path / rank).mkdir()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "0" / "error.json"))
    (tmp_path / "0" / "error.json").write_text(json.dumps({"message": "mine", "kind": KIND}))
    (tmp_path / "1" / "error.json").write_text(json.dumps({"message": {"py": "traceback"}}))
    assert peer_error() is None
    (tmp_path / "2" / "error.json").write_text(json.dumps({"message": "error (rank 2): x",
                                                           "kind": KIND}))
    assert peer_error() == "error (rank 2): x"
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert peer_error() is None


def test_the_launcher_drops_torchruns_omp_num_threads_banner(tmp_path):
    """torchrun logs four lines of asterisks where OMP_NUM_THREADS is unset and it sets it for
    the ranks; the launcher sets it first (threads.py), so they never reach the user."""
    (tmp_path / "tmp").mkdir()
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    result = subprocess.run(
        [sys.executable, "-m", "dlrm_hybrid.torchrun", "--standalone", "--nproc_per_node=2",
         "--no-python", "true"], cwd=ROOT, env={**environment, "TMPDIR": str(tmp_path / "tmp")},
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "OMP_NUM_THREADS" not in result.stderr and "*****" not in result.stderr
