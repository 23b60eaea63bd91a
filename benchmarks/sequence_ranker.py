"""The ranker with and without its sequence feature (`model.sequence: hstu`, DLRMv3's shape) on
one interaction log's ranking dataset: test AUC of each label, the same rows, steps and seeds.

    .venv/bin/python benchmarks/sequence_ranker.py --data ml-100k/u.data [--history 50]
        [--seeds 3] [--steps 2000] [--quick]

1. Data: `preprocess interactions --labels LABELS --ranking-negatives 4` of the log (every rating
   an engagement, leave-last-out per user by timestamp, 4 uniform negatives per engagement),
   and the same with `--history L` (each row's L earlier engagements with their actions): the
   same rows, ids and negatives (one seed), in a temporary folder made afresh each run.
2. Models: configs/multitask_demo.yaml's multi-task ranker (tasks watched, liked, disliked,
   the README's) on each dataset, the sequence one with `model.sequence=hstu` (HSTU's defaults
   but dropout, DROPOUT); `--steps` steps, shuffled, a validation and a checkpoint every
   EVAL_EVERY steps, on 2 gloo ranks.
3. The choice, on validation only: each run's step of the best mean validation AUC over the
   tasks; that checkpoint is tested (`eval --split test`). Each seed (`train.seed`, the model's
   initialisation) is trained and chosen on its own.

Prints the CPU, each run's chosen step and test AUCs, a table of the means, and last:

    sequence_ranker: data=NAME history=L seeds=S auc_watched_dlrm=X auc_watched_sequence=X ...
        gain_watched=X ... dlrm_samples_per_s=X sequence_samples_per_s=X
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List

from retrieval import cli, cpu_name

ROOT = Path(__file__).resolve().parents[1]
LABELS = "watched,liked:rating>=4,disliked:rating<=2"
TASKS = ("watched", "liked", "disliked")
TASK_SETTING = "[{name: watched}, {name: liked, head: [16]}, {name: disliked, head: [16]}]"
DROPOUT = 0.2
EVAL_EVERY = 250


def make_datasets(log: str, history: int, folder: Path) -> Dict[str, str]:
    """{"dlrm": the ranking dataset, "sequence": the same with --history}."""
    out = {}
    for kind, more in (("dlrm", []), ("sequence", ["--history", str(history)])):
        out[kind] = str(folder / kind)
        cli(["preprocess", "interactions", "--input", log, "--output", out[kind], "--labels",
             LABELS, "--ranking-negatives", "4", *more])
    return out


def train_and_test(kind: str, data: str, steps: int, seed: int, folder: Path) -> dict:
    """One run: its validation-best step's test AUCs and the run's samples/s."""
    run = folder / f"{kind}_{seed}"
    half = steps // 2
    sets = [f"data.path={data}", f"model.tasks={TASK_SETTING}", "data.label_missing=0",
            "value_model={}", "data.shuffle=true", f"train.seed={seed}",
            f"train.max_steps={steps}", f"train.eval_every={EVAL_EVERY}",
            f"checkpoint.every={EVAL_EVERY}", f"checkpoint.keep={steps // EVAL_EVERY + 1}",
            f"train.log_every={EVAL_EVERY}", f"optim.decay_start_step={half}",
            f"optim.decay_steps={steps - half}", "train.progress_bar=false",
            "train.tensorboard=false", f"train.run_dir={run}"]
    if kind == "sequence":
        sets += ["model.sequence=hstu", f"model.hstu.dropout={DROPOUT}"]
    out = cli(["train", "--config", str(ROOT / "configs/multitask_demo.yaml"),
               *[a for s in sets for a in ("--set", s)]], ranks=2)
    done = fields(out.strip().splitlines()[-1])
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if f"val_auc_{TASKS[0]}" in e]
    best = max(evals, key=lambda e: (statistics.mean(e[f"val_auc_{t}"] for t in TASKS),
                                     -e["step"]))
    tested = fields(cli(["eval", "--checkpoint", str(run / "checkpoints" / f"step_{best['step']}"),
                         "--split", "test"]).strip().splitlines()[-1])
    return {"step": best["step"], **{t: tested[f"test_auc_{t}"] for t in TASKS},
            "samples_per_s": done["samples_per_s"]}


def fields(line: str) -> Dict[str, float]:
    """key=value pairs of a `done:` or `eval:` line (numbers only)."""
    out = {}
    for item in line.split()[1:]:
        key, _, value = item.partition("=")
        try:
            out[key] = float(value)
        except ValueError:
            pass
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="an interaction log with ratings and "
                        "timestamps, e.g. ml-100k/u.data")
    parser.add_argument("--name", help="the data's name (default: the log's folder)")
    parser.add_argument("--history", type=int, default=50, help="--history L (default 50)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000, help="steps of 1,024 rows each")
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 1 seed, "
                        f"{EVAL_EVERY * 2} steps, history 8")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.steps, args.history = 1, EVAL_EVERY * 2, 8
    if args.steps < EVAL_EVERY or args.history < 1 or args.seeds < 1:
        parser.error(f"--steps >= {EVAL_EVERY}, --history >= 1, --seeds >= 1")
    name = args.name or Path(args.data).resolve().parent.name
    print(f"sequence ranker benchmark on {cpu_name()}; 2 gloo ranks of 1 thread", flush=True)
    runs: Dict[str, List[dict]] = {"dlrm": [], "sequence": []}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_datasets(args.data, args.history, Path(tmp))
        for seed in range(args.seeds):
            for kind in runs:
                r = train_and_test(kind, data[kind], args.steps, seed, Path(tmp))
                runs[kind].append(r)
                print(f"  seed {seed} {kind}: step {r['step']:.0f}, test AUC "
                      + ", ".join(f"{t} {r[t]:.4f}" for t in TASKS)
                      + f"; {r['samples_per_s']:,.0f} samples/s", flush=True)
    mean = {k: {t: statistics.mean(r[t] for r in v) for t in (*TASKS, "samples_per_s")}
            for k, v in runs.items()}
    print(f"\n{name}: test AUC, mean of {args.seeds} seeds (each at its validation-best step)")
    print("| ranker | " + " | ".join(TASKS) + " | samples/s |")
    print("|---|" + "---:|" * (len(TASKS) + 1))
    for kind, label in (("dlrm", "DLRM"), ("sequence", f"DLRM + HSTU over the last "
                                                       f"{args.history} engagements")):
        print(f"| {label} | " + " | ".join(f"{mean[kind][t]:.4f}" for t in TASKS)
              + f" | {mean[kind]['samples_per_s']:,.0f} |")
    print(f"sequence_ranker: data={name} history={args.history} seeds={args.seeds} "
          + " ".join(f"auc_{t}_{k}={mean[k][t]:.5f}" for t in TASKS for k in runs) + " "
          + " ".join(f"gain_{t}={mean['sequence'][t] - mean['dlrm'][t]:.5f}" for t in TASKS)
          + " " + " ".join(f"{k}_samples_per_s={mean[k]['samples_per_s']:.0f}" for k in runs))


if __name__ == "__main__":
    main()
