"""What the variant jobs (two_tower_job.py, multitask_job.py) and their tests share.

The job side, `run_variants`: run under torchrun (or alone, one rank), a job script trains each
named variant of its settings on this world size into OUT/<variant>/, and with --resume DIR
continues each of those variants from its step 5 checkpoint in DIR (another launch's OUT), if
it has one, into OUT/resumed_<variant>/.
  usage: SCRIPT OUT [VARIANT ...] [--resume DIR]   (no VARIANT: all)

The test side: `launch` (a 2-rank launch, then a 1-rank one resuming it), `losses`,
`assert_same_evaluations`,
`assert_close`.
"""

import sys
from pathlib import Path
from typing import Dict, List


def run_variants(common: List[str], variants: Dict[str, List[str]]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.parallel.process_group import init_distributed, shutdown
    from dlrm_hybrid.train.loop import train

    out = Path(sys.argv[1])
    args = sys.argv[2:]
    resume = Path(args.pop(args.index("--resume") + 1)) if "--resume" in args else None
    args = [a for a in args if a != "--resume"]
    env = init_distributed("gloo")

    def config(run_dir: Path, variant: str, extra=()):
        return load_config(None, [*common, *variants[variant], f"train.run_dir={run_dir}",
                                  *extra], env.world_size)

    names = args or list(variants)
    for variant in names:
        train(config(out / variant, variant), env)
    if resume is not None:
        for variant in names:
            checkpoint = resume / variant / "checkpoints" / "step_5"
            if checkpoint.is_dir():
                train(config(out / f"resumed_{variant}", variant,
                             [f"checkpoint.resume={checkpoint}"]), env)
    shutdown()


def launch(root: Path, job: Path, two_rank_variants: List[str], extra: List[str] = ()) -> dict:
    """{"two": OUT of a 2-rank launch of `two_rank_variants`, "one": OUT of a 1-rank launch
    of every variant that also resumes the 2-rank runs' step 5, "stdout": the 2-rank launch's}.
    `extra`: more arguments of both launches (the job's own)."""
    from conftest import failure, run_cli  # the test side only: the jobs run without pytest

    two = run_cli([str(root / "two"), *two_rank_variants, *extra], nproc=2, script=job)
    assert two.returncode == 0, failure(two)
    one = run_cli([str(root / "one"), "--resume", str(root / "two"), *extra], script=job)
    assert one.returncode == 0, failure(one)
    return {"two": root / "two", "one": root / "one", "stdout": two.stdout}


def losses(run_dir: Path) -> list:
    from conftest import read_metrics

    return [e["loss"] for e in read_metrics(run_dir) if "loss" in e]


def assert_close(got: list, want: list, rel: float) -> None:
    assert len(got) == len(want) and got, (got, want)
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want))
    assert worst < rel, (worst, got, want)


def assert_same_evaluations(jobs: dict, variant: str, metrics) -> None:
    """The 1- and 2-rank runs of `variant` evaluated at steps 5 and 10 alike (retrieval
    metrics to 2e-3: the ranks' float sums differ in order), and found something."""
    import pytest
    from conftest import read_metrics

    evals = {n: [e for e in read_metrics(jobs[n] / variant) if "val_mrr" in e]
             for n in ("one", "two")}
    assert [e["step"] for e in evals["two"]] == [5, 10]
    for one, two in zip(evals["one"], evals["two"]):
        for metric in metrics:
            assert one[metric] == pytest.approx(two[metric], abs=2e-3), metric
    assert evals["two"][-1]["val_recall@100"] > 0
