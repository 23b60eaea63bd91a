"""The launch wrappers' commands, as each would run them: stand-ins for python, nvidia-smi,
docker, scontrol and srun on PATH record what they were asked (no training runs; the
multi-host join itself is run in test_distributed.py)."""

import os
import stat
import subprocess
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
    assert {"WORKDIR /workspace/dlrm_hybrid", "COPY launch ./launch", "COPY configs ./configs",
            "ENTRYPOINT []"} <= set(dockerfile)  # checkout's copy, as itself

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
