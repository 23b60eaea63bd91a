"""`dlrm-hybrid plot RUN_DIR [RUN_DIR ...]`: the training loss and validation AUC (a multi-task
run's: each task's) of one or more runs, against steps and against time, read from their metrics.jsonl and overlaid in one image,
for a look at a run without TensorBoard (e.g. on a cluster's login node)."""

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
TASK_AUC = "val_auc_"  # a multi-task run's per-task validation AUC: val_auc_<task>
SIZE_IN, DPI = (12.0, 8.0), 100  # 1200 x 800 pixels


@dataclass
class Run:
    """One run's curves: (step, elapsed seconds or None, value) points."""
    name: str
    loss: List[tuple] = field(default_factory=list)
    auc: List[tuple] = field(default_factory=list)
    task_auc: Dict[str, List[tuple]] = field(default_factory=dict)  # multi-task: val_auc_<task>

    def timed(self) -> bool:
        points = self.loss + self.auc + [p for ps in self.task_auc.values() for p in ps]
        return all(t is not None for _, t, _ in points)

    def auc_curves(self) -> List[tuple]:
        """(label suffix, points) of each AUC curve: the click AUC, or each task's."""
        return ([("", self.auc)] if self.auc else []) + [
            (f" {task}", points) for task, points in self.task_auc.items()]


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
    """The loss and AUC points of `run_dir/metrics.jsonl`; a last line cut short (a run killed
    while writing it) is skipped with a notice. Only top-level `loss` and `val_auc` fields are
    points, so the events a resume superseded (kept inside its `resumed` record) are not."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        what = "is not a folder" if not Path(run_dir).is_dir() else f"holds no {METRICS}"
        raise UserError(f"plot: {run_dir} {what}; give the folder a training run wrote "
                        f"(its train.run_dir)")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"plot: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    run = Run(name)
    for number, line in enumerate(lines, 1):
        event = _parse(line)
        if event is None and number == len(lines):
            print(f"plot: {path}: skipped line {number}, cut short (the run was stopped while "
                  f"writing it)", file=sys.stderr)
        elif event is None:
            raise UserError(f"plot: {path} line {number} is not a JSON record; the file is "
                            f"damaged (remove that line to plot the rest)")
        else:  # the record a resume leaves (`resumed`) holds no point: skipped there
            _add_point(run, event)
    if not run.loss and not run.auc_curves():
        raise UserError(f"plot: {path} has no loss or val_auc records yet; plot it once the run "
                        f"has logged (train.log_every steps)")
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
    for key, points in (("loss", run.loss), ("val_auc", run.auc)):
        if isinstance(event.get(key), numbers.Real):
            points.append((event["step"], elapsed, event[key]))
    for key, value in event.items():
        if key.startswith(TASK_AUC) and isinstance(value, numbers.Real):
            run.task_auc.setdefault(key[len(TASK_AUC):], []).append(
                (event["step"], elapsed, value))


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
    return [("", run.loss)] if attr == "loss" else run.auc_curves()


def _empty_reason(runs: List[Run], attr: str) -> str:
    if not any(points for r in runs for _, points in _curves(r, attr)):
        return "no evaluation yet" if attr == "auc" else "no loss logged yet"
    return "time unavailable: no elapsed_s in metrics.jsonl\n(written by an earlier version)"


def _write(runs: List[Run], out: Path, kind: str) -> None:
    """Loss (top) and AUC (bottom) against steps (left) and elapsed time (right), written whole
    or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=SIZE_IN, dpi=DPI)
    for row, (attr, label) in enumerate((("loss", "training loss"), ("auc", "validation AUC"))):
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
