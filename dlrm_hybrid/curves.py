"""`dlrm-hybrid plot RUN_DIR [RUN_DIR ...]`: the training loss and what each run's evaluations
measured (a ranker's validation AUC, a multi-task run's each task's, a two-tower run's recall@K),
against steps and against time, read from their metrics.jsonl and overlaid in one image, for a
look at a run without TensorBoard (e.g. on a cluster's login node)."""

from __future__ import annotations

import argparse
import json
import numbers
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import (refuse_overwriting_inputs, require_file_target,
                                      temporary_beside)

METRICS = "metrics.jsonl"
DEFAULT_NAME = "curves.png"
LINE_STYLES = (("-", "."), ("--", "x"), (":", "^"), ("-.", "s"))  # (line, marker) per task
# What an evaluation measured, the first family its records hold: (metric name prefix, the
# panel's name for it). A ranker's val_auc, a multi-task run's val_auc_<task>, a two-tower run's
# val_recall@<K>; any other val_* field (not a planted ceiling's) where none of these is.
FAMILIES = (("val_auc", "AUC"), ("val_recall@", "recall@K"), ("val_", "metric"))
CEILING = "val_ceiling_"  # the planted teacher's own retrieval metrics: a bound, not the run's
SIZE_IN, DPI = (12.0, 8.0), 100  # 1200 x 800 pixels


@dataclass
class Run:
    """One run's curves: (step, elapsed seconds or None, value) points."""
    name: str
    loss: List[tuple] = field(default_factory=list)
    evals: Dict[str, List[tuple]] = field(default_factory=dict)  # each val_* field's points

    def timed(self) -> bool:
        points = self.loss + [p for ps in self.evals.values() for p in ps]
        return all(t is not None for _, t, _ in points)

    def measured(self) -> str:
        """The panel's name for what this run's evaluations measured ("" before any)."""
        return next((name for prefix, name in FAMILIES
                     if any(k.startswith(prefix) for k in self.evals)), "")

    def eval_curves(self) -> List[tuple]:
        """(label suffix, points) of each evaluation curve of the first family in FAMILIES the
        run's evaluations hold: the AUC (" <task>": a task's), or " recall@<K>" for each K."""
        prefix = next((p for p, name in FAMILIES if name == self.measured()), None)
        return [(_legend_suffix(key), points) for key, points in self.evals.items()
                if prefix and key.startswith(prefix)]


def _legend_suffix(key: str) -> str:
    """val_auc: ""; val_auc_<task>: " <task>"; val_recall@10: " recall@10"."""
    if key == "val_auc":
        return ""
    return " " + (key[len("val_auc_"):] if key.startswith("val_auc_") else key[len("val_"):])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a training run's folder (train.run_dir), holding metrics.jsonl")
    parser.add_argument("--out", help=f"image to write (.png, .svg, .pdf...; default: "
                        f"RUN_DIR/{DEFAULT_NAME} for one run, ./{DEFAULT_NAME} for several)")


def run(args: argparse.Namespace) -> None:
    runs = [read_run(d, name) for d, name in zip(args.run_dirs, _names(args.run_dirs))]
    out = args.out or str(Path(args.run_dirs[0] if len(runs) == 1 else ".") / DEFAULT_NAME)
    require_file_target("--out", out)
    refuse_overwriting_inputs([("--out", out)], [("the run record", str(Path(d) / METRICS))
                                                 for d in args.run_dirs], "plot")
    kind = _image_format(out)
    untimed = [r.name for r in runs if not r.timed()]
    if untimed:
        print(f"plot: no time panel for {', '.join(untimed)}: its metrics.jsonl has no elapsed_s "
              f"(written by an earlier version); plotted against steps only", file=sys.stderr)
    _write(runs, Path(out), kind)
    print(f"plot: wrote {out} ({len(runs)} run{'s' * (len(runs) > 1)})")


def read_run(run_dir: str, name: str) -> Run:
    """The loss and evaluation points of `run_dir/metrics.jsonl`; a last line cut short (a run
    killed while writing it) is skipped with a notice. Only top-level `loss` and `val_*` fields
    are points, so the events a resume superseded (kept inside its `resumed` record) are not."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        what = "is not a folder" if not Path(run_dir).is_dir() else f"holds no {METRICS}"
        raise UserError(f"plot: {run_dir} {what}; give the folder a training run wrote "
                        f"(its train.run_dir)")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()  # an editor's BOM, CRLF
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"plot: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    run = Run(name)
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    for number, line in numbered:
        event = _parse(line)
        if event is None and number == numbered[-1][0]:
            print(f"plot: {path}: skipped line {number}, cut short (the run was stopped while "
                  f"writing it)", file=sys.stderr)
        elif event is None:
            raise UserError(f"plot: {path} line {number} is not a JSON record; the file is "
                            f"damaged (remove that line to plot the rest)")
        else:  # the record a resume leaves (`resumed`) holds no point: skipped there
            _add_point(run, event)
    if not run.loss and not run.eval_curves():
        raise UserError(f"plot: {path} has no loss or evaluation records yet; plot it once the "
                        f"run has logged (train.log_every steps)")
    return run


def _parse(line: str) -> Optional[dict]:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) and isinstance(event.get("step"), int) else None


def _add_point(run: Run, event: dict) -> None:
    elapsed = event.get("elapsed_s")
    elapsed = elapsed if isinstance(elapsed, numbers.Real) else None
    if _number(event.get("loss")):
        run.loss.append((event["step"], elapsed, event["loss"]))
    for key, value in event.items():
        if key.startswith("val_") and not key.startswith(CEILING) and _number(value):
            run.evals.setdefault(key, []).append((event["step"], elapsed, value))


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _names(run_dirs: List[str]) -> List[str]:
    """The legend: each run folder's name, or the path as given where two names are the same."""
    names = [Path(os.path.abspath(d)).name for d in run_dirs]
    return [n if names.count(n) == 1 else d for n, d in zip(names, run_dirs)]


def _image_format(out: str) -> str:
    from matplotlib.backend_bases import FigureCanvasBase

    kind = Path(out).suffix[1:].lower() or "png"
    supported = FigureCanvasBase.get_supported_filetypes()
    if kind not in supported:
        raise UserError(f"plot: --out {out} is no image name matplotlib writes; end it in one of "
                        f"{', '.join('.' + k for k in supported)}")
    return kind


def _curves(run: Run, attr: str) -> List[tuple]:
    return [("", run.loss)] if attr == "loss" else run.eval_curves()


def _eval_label(runs: List[Run]) -> str:
    """"validation AUC", "validation recall@K", or each measure the runs overlaid hold."""
    measured = [m for m in dict.fromkeys(r.measured() for r in runs) if m]
    return "validation " + (" / ".join(measured) or "AUC")


def _empty_reason(runs: List[Run], attr: str) -> str:
    if not any(points for r in runs for _, points in _curves(r, attr)):
        return "no evaluation yet" if attr == "auc" else "no loss logged yet"
    return "time unavailable: no elapsed_s in metrics.jsonl\n(written by an earlier version)"


def _write(runs: List[Run], out: Path, kind: str) -> None:
    """Loss (top) and what the evaluations measured (bottom) against steps (left) and elapsed
    time (right), written whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=SIZE_IN, dpi=DPI)
    for row, (attr, label) in enumerate((("loss", "training loss"), ("auc", _eval_label(runs)))):
        for x, xlabel in enumerate(("step", "elapsed, s")):
            ax = axes[row][x]
            drawn = [(i, r) for i, r in enumerate(runs)
                     if _curves(r, attr) and (x == 0 or r.timed())]
            for i, r in drawn:  # a run keeps its colour in every panel, a task its line style
                for j, (task, points) in enumerate(_curves(r, attr)):
                    style = LINE_STYLES[j % len(LINE_STYLES)]
                    ax.plot([p[x] for p in points], [p[2] for p in points], marker=style[1],
                            color=f"C{i % 10}", linestyle=style[0], label=r.name + task)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
            if drawn:
                ax.legend(fontsize=8)
            else:
                ax.text(0.5, 0.5, _empty_reason(runs, attr), ha="center", va="center",
                        transform=ax.transAxes)
    fig.tight_layout()
    partial = temporary_beside(out)
    try:
        fig.savefig(partial, format=kind, dpi=DPI)
        partial.replace(out)
    except OSError as e:
        raise UserError(f"plot: cannot write {out} ({e.strerror})") from None
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
