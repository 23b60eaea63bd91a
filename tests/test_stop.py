"""Stopping a run with a signal, as Ctrl-C and a preempting scheduler send it: every rank stops
after one step, a checkpoint holds it, one line says so, and the same command resumes it."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (ROOT, default_sigint, done_fields, failure, read_metrics, run_cli,
                      start_cli)

# Dense SGD: 1 and 2 ranks then give the same losses up to rounding (measured 1.1e-7 relative).
SETTINGS = ["data.global_batch_size=256", "data.val_samples=1024", "optim.dense=sgd",
            "optim.dense_lr=0.5", "optim.embedding=sgd", "train.max_steps=20",
            "train.log_every=1", "train.eval_every=0", "train.progress_bar=false",
            "checkpoint.resume=auto"]


def train_args(run_dir: Path, settings) -> list:
    return ["train", "--config", "configs/demo.yaml",
            *[a for s in [*settings, f"train.run_dir={run_dir}"] for a in ("--set", s)]]


# torchrun as the launch scripts and `make demo` run it
LAUNCHER = [sys.executable, "-m", "dlrm_hybrid.torchrun"]


def start(args: list, nproc: int = 0, fresh: bool = False):
    """The CLI in its own session, as a terminal or a scheduler starts it, with SIGINT's default
    action: one process forked from the CLI zygote (conftest.start_cli), or `fresh`; with nproc
    ranks, a fresh launch under the launch scripts' torchrun, whose handling of the signals is
    what is tested."""
    if not nproc and not fresh:
        return start_cli(args)
    cmd = ([*LAUNCHER, "--standalone", f"--nproc_per_node={nproc}", "-m", "dlrm_hybrid", *args]
           if nproc else [sys.executable, "-m", "dlrm_hybrid", *args])
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.Popen(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)


@pytest.fixture
def launch():
    """`start`, and what still runs when the test ends (it failed) is stopped."""
    runs = []

    def launch_(args: list, nproc: int = 0, fresh: bool = False):
        runs.append(start(args, nproc, fresh))
        return runs[-1]

    yield launch_
    for run in runs:
        if run.poll() is None:
            run.terminate()  # torchrun passes it on to its workers, in their own sessions
            try:
                run.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
                run.communicate()


def iter_until(stream, prefix: str):
    """The lines of `stream` up to and including the first that starts with `prefix`."""
    for line in stream:
        yield line
        if line.startswith(prefix):
            return
    raise AssertionError(f"the output ended before a line starting {prefix!r}")


def wait_for_step(run: subprocess.Popen, run_dir: Path, step: int) -> None:
    """Until metrics.jsonl has the loss of `step` or a later one (training is under way)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert run.poll() is None, run.communicate()
        try:
            if any("loss" in e and e["step"] >= step for e in read_metrics(run_dir)):
                return
        except (OSError, ValueError):  # not written yet, or a line half written
            pass
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within 240 s")


def losses(run_dir: Path) -> list:
    return [(e["step"], e["loss"]) for e in read_metrics(run_dir) if "loss" in e]


def test_a_preempted_two_rank_run_checkpoints_and_resumes_to_the_same_losses(tmp_path, launch,
                                                                            process_group):
    """SIGTERM to the launch scripts' torchrun, as SLURM and Kubernetes send it: it passes it on,
    the ranks stop at one step, it exits 143 without a traceback, and the same command continues
    to the losses of an uninterrupted run."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.train.checkpoint import complete_checkpoints
    from dlrm_hybrid.train.loop import train

    run_dir = tmp_path / "run"
    run = launch(train_args(run_dir, SETTINGS), nproc=2)
    wait_for_step(run, run_dir, 1)
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    last = out.strip().splitlines()[-1]
    stop = re.fullmatch(r"stopped at step (\d+) \(SIGTERM\); checkpoint: (\S+); resume with the "
                        r"same command", last)
    assert stop, out[-2000:] + err[-2000:]
    step, checkpoint = int(stop.group(1)), Path(stop.group(2))
    assert 1 < step < 20 and checkpoint == run_dir / "checkpoints" / f"step_{step}"
    assert json.loads((checkpoint / "meta.json").read_text())["step"] == step
    assert complete_checkpoints(checkpoint.parent) == [checkpoint]
    assert not list(checkpoint.parent.glob(".*.partial"))
    last = read_metrics(run_dir)[-1]
    assert {k: last[k] for k in last.keys() - {"time", "elapsed_s"}} == {"step": step,
                                                                       "stopped_by": "SIGTERM"}
    # Nothing from the ranks on stderr, no traceback: only torchrun's notices (its banner, the
    # signal it passes on), and 128 + SIGTERM, where plain torchrun raises and exits 1.
    assert run.returncode == 143, err
    lines = err.strip().splitlines()
    assert not [l for l in lines if l.startswith("[rank")] and "Traceback" not in err, err
    assert len(lines) <= 8, err

    resumed = run_cli(train_args(run_dir, SETTINGS), nproc=2)
    assert resumed.returncode == 0, failure(resumed)
    assert f"resumed from {checkpoint} (step {step})" in resumed.stdout
    assert done_fields(resumed.stdout)["steps"] == 20
    whole = train(load_config(str(ROOT / "configs/demo.yaml"),
                              [*SETTINGS, f"train.run_dir={tmp_path / 'whole'}"]), process_group)
    parts = losses(run_dir)
    assert [s for s, _ in parts] == list(range(1, 21))
    for (s, a), b in zip(parts, whole.losses):
        assert abs(a - b) / b < 1e-6, f"step {s}: stopped and resumed {a}, uninterrupted {b}"


def test_ctrl_c_stops_at_a_step_and_a_second_ctrl_c_at_once(tmp_path, launch):
    """Ctrl-C in a terminal signals the whole foreground process group. The demo config starts
    afresh (checkpoint.resume none): the line says how to resume instead."""
    settings = ["data.global_batch_size=8192", "train.max_steps=1000", "train.log_every=1",
                "train.progress_bar=false"]
    args = train_args(tmp_path, settings)
    run = launch(args)
    wait_for_step(run, tmp_path, 1)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=120)
    stop = re.fullmatch(r"stopped at step (\d+) \(SIGINT\); checkpoint: (\S+); resume with the "
                        r"same command and --set checkpoint.resume=auto",
                        out.strip().splitlines()[-1])
    assert stop and run.returncode == 130 and err == "", out[-2000:] + err[-2000:]
    assert "SIGINT: stopping after the step the ranks agree on, with a checkpoint" in out
    step = int(stop.group(1))
    assert Path(stop.group(2)) == tmp_path / "checkpoints" / f"step_{step}"

    run = launch([*args, "--set", "checkpoint.resume=auto"])
    wait_for_step(run, tmp_path, step + 2)  # step + 1 is behind it
    os.killpg(run.pid, signal.SIGINT)
    # The second signal once the first is acknowledged (one still pending would merge with it),
    # at once: a stop this small ends a few milliseconds later.
    before = "".join(iter_until(run.stdout, "SIGINT: stopping"))
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=120)
    out = before + out
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{step}'} (step {step})" in out
    stop = re.fullmatch(r"stopped at once after step (\d+) \(a second Ctrl-C\), without a "
                        r"checkpoint of it; resume with the same command: it continues from "
                        r"the newest checkpoint", out.strip().splitlines()[-1])
    assert stop and run.returncode == 130 and err == "", out[-2000:] + err[-2000:]
    assert int(stop.group(1)) > step
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == [f"step_{step}"]


def test_ctrl_c_before_training_begins_says_so_in_one_line(tmp_path, launch):
    """Ctrl-C while the command still starts: here it waits for its config from a pipe."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    run = launch(["train", "--config", str(fifo)], fresh=True)  # the command's own start
    deadline = time.monotonic() + 120
    while True:  # opening the pipe for writing succeeds once the command has it open
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            time.sleep(0.05)
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.communicate(timeout=60)
    os.close(writer)
    assert (run.returncode, out, err) == (130, "", "interrupted (Ctrl-C)\n")


def test_ranks_agree_on_the_stop_step_and_the_grace_time_bounds_the_stop(tmp_path):
    """Rank 1 alone gets SIGTERM, twice (SLURM signals every process of a step and torchrun
    passes it on too): both ranks stop after the same step. Then a checkpoint that outlasts
    train.stop_grace_s: the process ends at once, saying so."""
    started = time.monotonic()
    result = run_cli([], nproc=2, script=Path(__file__), timeout=120)
    assert time.monotonic() - started < 60, "the grace time did not end the stop"
    lines = result.stdout.strip().splitlines()
    stops = sorted((json.loads(l) for l in lines if l.startswith("{")), key=lambda s: s["rank"])
    assert len(stops) == 2, result.stdout + result.stderr[-3000:]
    assert stops[0]["stopped_at"] == stops[1]["stopped_at"] > 3 and stops[0]["signum"] == 15
    assert lines[-1] == (f"stopped at once after step {stops[0]['stopped_at']} (not stopped within "
                         f"train.stop_grace_s=1), without a checkpoint of it; resume with the "
                         f"same command: it continues from the newest checkpoint")


def agreement_job() -> None:
    """Under torchrun: steps of 20 ms; rank 1 signals itself at step 3; after the agreed step
    each rank 'writes a checkpoint' for a minute."""
    import torch.distributed as dist

    from dlrm_hybrid.train.stop_request import StopRequest

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with StopRequest(grace_s=1.0, is_main=rank == 0, resume="auto") as stop:
        step, signum = 0, 0
        while not signum:
            step += 1
            time.sleep(0.02)
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # delivered, not merged with the next one
                os.kill(os.getpid(), signal.SIGTERM)
            stop.step = step
            signum = stop.agreed()
        print(json.dumps({"stopped_at": step, "signum": signum, "rank": rank}), flush=True)
        time.sleep(60)


if __name__ == "__main__":
    agreement_job()
