"""Commands that need no torch answer without importing it (torch takes ~2 s, torchrec ~4 s on
these hosts; benchmarks/start_time.py prints the times): help, the planner's dry run, and the
one-line errors of a bad config or checkpoint, also under the torchrun launcher."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

HEAVY = ("torch", "torchrec", "fbgemm_gpu", "tensorboard", "matplotlib", "nvidia")
CLI = ["-m", "dlrm_hybrid"]
CASES = {
    "help": (CLI + ["--help"], 0),
    "plan": (CLI + ["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "8"], 0),
    "train-bad-set": (CLI + ["train", "--config", "configs/demo.yaml", "--set",
                             "model.embedding_dim=abc"], 2),
    "train-no-config": (CLI + ["train", "--config", "configs/nope.yaml"], 2),
    "eval-no-checkpoint": (CLI + ["eval", "--checkpoint", "no/step_1"], 2),
    "export-no-checkpoint": (CLI + ["export", "--checkpoint", "no/step_1", "--out", "x.pt"], 2),
    "launcher-bad-set": (["-m", "dlrm_hybrid.torchrun", "--standalone", "--nproc_per_node=2",
                          *CLI, "train", "--config", "configs/demo.yaml", "--set",
                          "data.global_batch_size=1001"], 2),
}


def imported_modules(args, tmp_path):
    """The exit code, stderr lines and top-level modules `python -X importtime ARGS` loaded."""
    result = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    lines = result.stderr.splitlines()
    modules = {line.split("|")[-1].strip().split(".")[0] for line in lines
               if line.startswith("import time:")}
    said = [line for line in lines if not line.startswith("import time:")]
    return result.returncode, said, modules


@pytest.mark.parametrize("case", CASES)
def test_commands_that_need_no_torch_do_not_import_it(case, tmp_path):
    args, code = CASES[case]
    if "configs/" in " ".join(args):
        (tmp_path / "configs").symlink_to(ROOT / "configs")
    returncode, said, modules = imported_modules(args, tmp_path)
    assert returncode == code, said
    if code:
        assert len(said) == 1 and said[0].startswith("error:"), said
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_output_piped_into_head_ends_quietly(tmp_path):
    """`plan ... | head -3`: the three lines, no BrokenPipeError traceback from the rest."""
    result = subprocess.run(
        f"{sys.executable} -m dlrm_hybrid plan --config configs/criteo_1tb_fl15.yaml "
        f"--world-size 1024 | head -3", shell=True, cwd=ROOT, capture_output=True, text=True,
        timeout=60)
    assert len(result.stdout.splitlines()) == 3 and result.stdout.startswith("plan (")
    assert result.stderr == ""


def test_imports_skip_the_collector_and_leave_it_on_with_what_they_made_frozen():
    """What a command imports under collector_paused is frozen, and the collector is back on
    after it (a long run without it would keep every reference cycle it makes), also when the
    import fails; where it was off, it stays off."""
    import gc

    from dlrm_hybrid.startup import collector_paused

    frozen = gc.get_freeze_count()
    try:
        with collector_paused():
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
        with pytest.raises(ImportError), collector_paused():
            import dlrm_hybrid.no_such_module  # noqa: F401
        assert gc.isenabled()
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
