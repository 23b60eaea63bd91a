"""Multi-task ranking: one model for every task against one single-task model per task at the
same training budget, MMoE against the shared trunk, and what each extra task costs per step.

    .venv/bin/python benchmarks/multitask.py [--steps 1500] [--seeds 2] [--data
        ml-100k/u.data | --dataset DIR] [--log-steps 1500] [--quick]

1. Planted teacher: configs/demo.yaml's model and data with the tasks click, like, see_less
   (data/synthetic.py: correlated tasks, data.task_correlation 0.5; like's and see_less's label
   missing with data.label_missing 0.3), each task's head HEAD. Trained at one budget of
   S x batch samples: one multi-task model (shared trunk) for S steps; the same with an MMoE
   of EXPERTS experts; the same with each task's own dots (OWN_DOTS: model.task_dot_dim, and
   room for every task's latents in the embeddings) for OWN_DOTS_BUDGET x S steps; one
   single-task model per task for S/T steps each (the sum: S steps), the same at
   OWN_DOTS_BUDGET x S (the own-dots row's budget) and, for scale, one per task for S steps
   each (T times the budget). A single-task model is
   the same network with only its task's weight non-zero (the other heads get no gradient,
   so the trunk learns that task alone): the planted teacher is defined by the task list, so
   this keeps every model's data identical. Per-task val AUC over 65,536 samples (the samples
   whose label is missing left out) beside each task's oracle AUC; every model trained with
   train.seed 0..seeds-1 (its initialisation; the data fixed), the AUC the mean.
2. Step cost: steps of T = 1, 2, 4, 8 tasks (shared trunk, MMoE, own dots) and of the legacy single
   click logit on the same batch, the models alternating in rounds in one process, each
   round starting one model later (batches generated before timing); ms/step of each model's
   fastest round (other load on the machine only adds time), samples/s, ratio to T = 1.
3. With --data (an interaction log, e.g. MovieLens' u.data) or --dataset (a folder made from
   one): the log made into a ranking dataset by `preprocess interactions --labels LOG_LABELS
   --ranking-negatives LOG_NEGATIVES`, and the same multi vs single comparison on its labels
   (no oracle: the true probabilities are unknown).

Everything trains in this process on one gloo rank (OMP threads as set; 1 by default). Prints
the CPU, markdown tables and last the planted run's summary line:

    multitask: tasks=N multi_auc=A1,.. single_auc=A1,.. oracle_auc=A1,.. own_dots_auc=A1,..

(multi: the shared trunk; single: one model per task at the same total budget; own_dots: the
multi-task model with each task's own dots, at OWN_DOTS_BUDGET x S.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs/demo.yaml")
PLANTED_TASKS = ("click", "like", "see_less")
MORE_TASKS = ("share", "comment", "save", "hide", "follow")  # up to 8 for the step cost
HEAD = [16]  # every task's head: hidden widths before its logit
EXPERTS = 4
# Each task's own dots (model/task_dots.py): room in every embedding row for the shared latents
# and each task's own (the teacher's d = 8 each: 32), and a projection per task of that width
# (16 would hold the shared and the task's own; 32 learnt faster, and width 64 slower)
OWN_DOTS = ["model.embedding_dim=32", "model.bottom_mlp=[64,32]", "model.task_dot_dim=32"]
# The own-dots row trains OWN_DOTS_BUDGET x S steps (at S it stays 0.03-0.04 below the oracle on
# like and see_less), beside one model per task at that budget
OWN_DOTS_BUDGET = 2
LABEL_MISSING = 0.3
LOG_LABELS = "watched,liked:rating>=4,disliked:rating<=2"
LOG_NEGATIVES = 4
BATCH = 1024
COST_COUNTS = (1, 2, 4, 8)
COST_BATCHES = 8  # distinct batches cycled by the step-cost runs
COST_ROUNDS = 10


OWN_DOTS_ROW = (f"multi-task, each task's own dots (embedding_dim 32, task_dot_dim 32), "
                f"{OWN_DOTS_BUDGET}x the budget")


def tasks_set(tasks: Sequence[str], only: Optional[str] = None) -> str:
    """`model.tasks=...` naming `tasks`, each with HEAD; with `only`, the other tasks' weights
    are 0: a single-task model on data that carries every task's label as it is."""
    value = [{"name": t, "weight": 1.0 if only in (None, t) else 0.0, "head": HEAD}
             for t in tasks]
    return f"model.tasks={json.dumps(value)}"


def budget(steps: int, run_dir: str) -> List[str]:
    """The settings every training run shares: `steps` x BATCH samples, warmup 20, then the
    learning rates decay over the second half of the run."""
    return [f"data.global_batch_size={BATCH}", f"train.max_steps={steps}",
            f"train.log_every={steps}", "train.eval_every=0", "train.progress_bar=false",
            "train.tensorboard=false", f"optim.warmup_steps={min(20, steps // 4)}",
            f"optim.decay_start_step={steps // 2}", f"optim.decay_steps={steps - steps // 2}",
            "checkpoint.resume=none", f"train.run_dir={run_dir}"]


def train_run(data: List[str], steps: int, run_dir: str, env, test: bool
              ) -> Tuple[Dict[str, float], float]:
    """(final validation metrics, and with `test` the test split's, training seconds) of one
    run of configs/demo.yaml with `data` (the data and model.tasks settings) at `steps` steps;
    the run's own lines are not printed."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.train.inference import evaluate_checkpoint
    from dlrm_hybrid.train.loop import train

    cfg = load_config(DEMO, data + budget(steps, run_dir))
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        start = time.perf_counter()
        metrics = train(cfg, env).metrics
        seconds = time.perf_counter() - start
        if test:
            metrics.update(evaluate_checkpoint(f"{run_dir}/checkpoints/step_{steps}", None, [],
                                               env, "test"))
    return metrics, seconds


@dataclass
class Row:
    """One row of a comparison: `models` models (one, or one per task) of `steps` steps each;
    per training seed, the AUC of each split and task (split-major)."""

    models: int
    steps: int
    seeds: List[List[float]] = field(default_factory=list)
    seconds: float = 0.0  # training, all seeds

    def auc(self) -> List[float]:
        """Per split and task, the mean over the seeds."""
        return [statistics.fmean(values) for values in zip(*self.seeds)]

    def cells(self) -> List[str]:
        """Per split and task, the mean and (more than one seed) half the range over the
        seeds."""
        spread = [(max(v) - min(v)) / 2 for v in zip(*self.seeds)]
        return [f"{a:.4f}" + (f" ±{s:.4f}" if len(self.seeds) > 1 else "")
                for a, s in zip(self.auc(), spread)]


def plans(tasks: Sequence[str], steps: int
          ) -> Dict[str, Tuple[int, List[Tuple[Optional[str], List[str]]]]]:
    """The comparison's rows at budget S = `steps`: {row name: (steps per model, [(the task the
    model is scored on, None: every task; its settings)])}."""
    singles = [(task, [tasks_set(tasks, only=task)]) for task in tasks]
    multiples = sorted({1, OWN_DOTS_BUDGET, len(tasks)})  # budgets of one model per task
    return {
        "multi-task, shared trunk": (steps, [(None, [tasks_set(tasks)])]),
        f"multi-task, MMoE ({EXPERTS} experts)":
            (steps, [(None, [tasks_set(tasks), f"model.mmoe.experts={EXPERTS}"])]),
        OWN_DOTS_ROW: (steps * OWN_DOTS_BUDGET, [(None, [tasks_set(tasks), *OWN_DOTS])]),
        **{"single-task, one per task" + ("" if k == 1 else ", T x the budget" if k == len(tasks)
                                          else f", {k}x the budget"):
           (max(1, steps * k // len(tasks)), singles) for k in multiples}}


def compare(data: List[str], tasks: Sequence[str], steps: int, seeds: int, scratch: str, env,
            splits: Sequence[str] = ("val",)) -> Tuple[Dict[str, Row], List[float]]:
    """Every model of the comparison on `data` for train.seed 0..seeds-1, scored on `splits`
    (val, or val and test): ({row name: Row}, the oracle val AUC per task where the data know
    the true probabilities, else [])."""
    rows: Dict[str, Row] = {}
    oracle: List[float] = []
    for name, (n, runs) in plans(tasks, steps).items():
        row = rows[name] = Row(len(runs), n)
        for seed in range(seeds):
            aucs: Dict[str, float] = {}
            for only, sets in runs:
                m, seconds = train_run(data + sets + [f"train.seed={seed}"], n,
                                       f"{scratch}/{len(rows)}_{seed}_{only}", env,
                                       "test" in splits)
                aucs.update({f"{s}_auc_{t}": m[f"{s}_auc_{t}"] for s in splits for t in tasks
                             if only in (None, t)})
                oracle = [m[f"oracle_auc_{t}"] for t in tasks if f"oracle_auc_{t}" in m]
                row.seconds += seconds
            row.seeds.append([aucs[f"{s}_auc_{t}"] for s in splits for t in tasks])
        print(f"  {name}: {n} steps per model, {seeds} seed(s), {row.seconds:.0f} s", flush=True)
    return rows, oracle


def comparison_table(title: str, tasks: Sequence[str], rows: Dict[str, Row],
                     oracle: List[float], splits: Sequence[str] = ("val",)) -> str:
    seeds = len(next(iter(rows.values())).seeds)
    columns = [f"{s} AUC {t}" for s in splits for t in tasks]
    lines = [title + (f"; val AUC the mean of train.seed 0..{seeds - 1} (the data fixed), ± half "
                      f"their range" if seeds > 1 else ""),
             "| model | models x steps x batch | training samples | "
             + " | ".join(columns)
             + (" | mean AUC - oracle" if oracle else "") + " | train s per seed |",
             "|---|---|---:|" + "---:|" * len(columns) + ("---:|" if oracle else "") + "---:|"]
    for name, row in rows.items():
        gap = (f" {statistics.fmean(a - o for a, o in zip(row.auc(), oracle)):+.4f} |"
               if oracle else "")
        lines.append(f"| {name} | {row.models} x {row.steps:,} x {BATCH:,} | "
                     f"{row.models * row.steps * BATCH:,} | " + " | ".join(row.cells())
                     + f" |{gap} {row.seconds / seeds:.0f} |")
    if oracle:
        lines.append("| oracle (the teacher's probabilities) | | | "
                     + " | ".join(f"{a:.4f}" for a in oracle) + " | | |")
    return "\n".join(lines)


def summary_line(tasks: Sequence[str], multi: Sequence[float], single: Sequence[float],
                 oracle: Sequence[float], own_dots: Sequence[float]) -> str:
    """The benchmark's last line, for scripts (AUCs in task order)."""
    def join(values: Sequence[float]) -> str:
        return ",".join(f"{v:.4f}" for v in values)

    return (f"multitask: tasks={len(tasks)} multi_auc={join(multi)} single_auc={join(single)} "
            f"oracle_auc={join(oracle)} own_dots_auc={join(own_dots)}")


def step_cost(steps: int, rounds: int, env) -> str:
    """ms/step of the legacy click logit and of T tasks (shared trunk, MMoE, own dots) on the same
    batches; the models alternate, `steps` per round, and each keeps its fastest round."""
    import torch

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import open_dataset
    from dlrm_hybrid.train.loop import build_sharded_model
    from dlrm_hybrid.train.optim import build_optimizer
    from dlrm_hybrid.train.step import TrainStep

    tasks = PLANTED_TASKS + MORE_TASKS
    cases = {("legacy click logit", 0): []}
    for count in COST_COUNTS:
        sets = [tasks_set(tasks[:count])]  # one task has no label to leave out
        sets += [f"data.label_missing={LABEL_MISSING}"] if count > 1 else []
        cases["shared trunk", count] = sets
        cases[f"MMoE ({EXPERTS} experts)", count] = sets + [f"model.mmoe.experts={EXPERTS}"]
        cases["own dots", count] = sets + OWN_DOTS
    runs = {}
    with tempfile.TemporaryDirectory() as scratch:
        for case, sets in cases.items():
            cfg = load_config(DEMO, sets + budget(steps, scratch))
            dataset = open_dataset(cfg.data, cfg.model)
            batches = [dataset.batch("train", i * BATCH, BATCH).to(env.device)
                       for i in range(COST_BATCHES)]
            dmp, _ = build_sharded_model(cfg, dataset.spec, env, lambda line: None)
            runs[case] = (TrainStep(dmp, *build_optimizer(dmp, cfg.optim), cfg.train,
                                    env.device), batches)
    best = {case: float("inf") for case in cases}
    order = list(runs)
    for r in range(rounds + 1):  # the first round warms up; each round starts one case later
        for case in order[r % len(order):] + order[:r % len(order)]:
            train_step, batches = runs[case]
            cycle = iter(batches * (steps // COST_BATCHES + 1))
            start = time.perf_counter()
            for _ in range(steps):
                loss = train_step(cycle)
            loss.item()
            if r:
                best[case] = min(best[case], (time.perf_counter() - start) / steps)
    base = {trunk: best[trunk, 1] for trunk, count in cases if count == 1}
    lines = [f"Step cost: batch {BATCH:,}, configs/demo.yaml's model, head {HEAD} per task, "
             f"{torch.get_num_threads()} thread(s); fastest of {rounds} rounds of {steps} steps",
             "| tasks | trunk | ms/step | samples/s | ratio to 1 task | ms per task beyond the "
             "first |", "|---:|---|---:|---:|---:|---:|"]
    for (trunk, count), seconds in best.items():
        one = base.get(trunk, best["shared trunk", 1])
        extra = f"{(seconds - one) * 1e3 / (count - 1):+.2f}" if count > 1 else ""
        lines.append(f"| {count or '-'} | {trunk} | {seconds * 1e3:.2f} | {BATCH / seconds:,.0f} "
                     f"| {seconds / one:.2f} | {extra} |")
    return "\n".join(lines)


def cli(args: List[str]) -> None:
    """`python -m dlrm_hybrid ARGS`, or exit with its error line."""
    run = subprocess.run([sys.executable, "-m", "dlrm_hybrid", *args], cwd=ROOT, text=True,
                         capture_output=True)
    if run.returncode:
        lines = (run.stderr + run.stdout).strip().splitlines() or ["no output"]
        errors = [line for line in lines if line.startswith("error:")]
        sys.exit(f"{' '.join(args[:2])} failed: {(errors or lines)[-1]}")


def log_comparison(args, scratch: str, env) -> str:
    """Part 3: the interaction log as a ranking dataset, multi vs single on its labels."""
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    folder = args.dataset
    if not folder:
        folder = f"{scratch}/log"
        cli(["preprocess", "interactions", "--input", args.data, "--output", folder,
             "--labels", LOG_LABELS, "--ranking-negatives", str(LOG_NEGATIVES)])
    name = args.name or Path(args.data or folder).resolve().parent.name
    data = [f"data.path={folder}"]
    dataset = SplitBinaryDataset(folder)
    tasks = dataset.label_names
    size = {s: dataset.num_samples(s) for s in ("train", "val", "test")}
    print(f"{name}: {size['train']:,} training samples, labels {', '.join(tasks)}; budget "
          f"{args.log_steps} x {BATCH:,} samples:", flush=True)
    rows, _ = compare(data, tasks, args.log_steps, args.seeds, f"{scratch}/log_runs", env,
                      ("val", "test"))
    return comparison_table(
        f"{name} (`preprocess interactions --labels \"{LOG_LABELS}\" --ranking-negatives "
        f"{LOG_NEGATIVES}`): {size['train']:,} training samples ({size['train'] / BATCH:.0f} "
        f"steps an epoch), {size['val']:,} validation, {size['test']:,} test; budget "
        f"{args.log_steps:,} x {BATCH:,} = {args.log_steps * BATCH:,} samples", tasks, rows, [],
        ("val", "test"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500,
                        help="S: the planted comparison's budget in steps of 1,024 samples")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", help="an interaction log (e.g. ml-100k/u.data) for part 3")
    source.add_argument("--dataset", help="a ranking dataset `preprocess interactions "
                        "--labels ... --ranking-negatives N` wrote, for part 3")
    parser.add_argument("--name", help="the log's name in its table (default: its folder's)")
    parser.add_argument("--log-steps", type=int, default=1500, help="S on the log")
    parser.add_argument("--seeds", type=int, default=2, help="train.seed values per model "
                        "(the AUCs: their mean)")
    parser.add_argument("--cost-steps", type=int, default=20, help="steps per step-cost round")
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 60 steps "
                        "(30 on the log), one seed, 2 step-cost rounds of 8 steps")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.log_steps, args.cost_steps, args.seeds = 60, 30, 8, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    import logging

    import torch

    from dlrm_hybrid.parallel.process_group import init_distributed
    from dlrm_hybrid.train.precision import cpu_description

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", "Please use DTensor", FutureWarning)  # checkpoint loads
    env = init_distributed("gloo")
    cpu = f"{os.cpu_count()} cores ({cpu_description()}), {torch.get_num_threads()} thread(s)"
    print(f"multitask benchmark on {cpu}", flush=True)
    planted = ["data.val_samples=65536", f"data.label_missing={LABEL_MISSING}"]
    with tempfile.TemporaryDirectory() as scratch:
        print(f"planted teacher, budget {args.steps} x {BATCH:,} samples:", flush=True)
        rows, oracle = compare(planted, PLANTED_TASKS, args.steps, args.seeds,
                               f"{scratch}/planted", env)
        cost = step_cost(args.cost_steps, 2 if args.quick else COST_ROUNDS, env)
        log = log_comparison(args, scratch, env) if args.data or args.dataset else ""
    print(f"\n{cpu}\n")
    print(comparison_table(
        f"Planted teacher (configs/demo.yaml, tasks {', '.join(PLANTED_TASKS)}; task_correlation "
        f"0.5, label_missing {LABEL_MISSING}; head {HEAD} per task), budget {args.steps:,} x "
        f"{BATCH:,} = {args.steps * BATCH:,} samples", PLANTED_TASKS, rows, oracle))
    print(f"\n{cost}\n")
    if log:
        print(f"{log}\n")
    print(summary_line(PLANTED_TASKS, rows["multi-task, shared trunk"].auc(),
                       rows["single-task, one per task"].auc(), oracle,
                       rows[OWN_DOTS_ROW].auc()))


if __name__ == "__main__":
    main()
