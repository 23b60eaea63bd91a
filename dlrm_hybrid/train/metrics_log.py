"""The record of a run: rank 0's `metrics.jsonl` (one JSON object per event) and printed
lines, and, on request (`train.rank_logs`), every rank's own `rank_<r>.jsonl`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from dlrm_hybrid.parallel.plan_file import save_plan
from dlrm_hybrid.parallel.plan_report import describe
from dlrm_hybrid.train.tensorboard_log import TensorBoardSink, check_tensorboard
from dlrm_hybrid.output_paths import temporary_beside


class MetricsLog:
    def __init__(self, run_dir: Path, rank: int, rank_logs: bool = False) -> None:
        self.run_dir = run_dir
        self.rank = rank
        self.enabled = rank == 0
        self.rank_logs = rank_logs
        self._file = self._rank_file = None
        self.started = time.perf_counter()  # the run's start, for elapsed_s
        self._sink = None  # TensorBoard's copy of the records (train.tensorboard)

    def begin(self, cfg, plan, applied_sharding: dict, resumed: int = 0) -> None:
        """Once the run is known to start: the run directory with the resolved config, the plan
        (reusable as `parallel.plan`) and the sharding torchrec applied. A run resumed after
        step `resumed` continues the event files it finds (`supersede`)."""
        mode = "a" if resumed else "w"
        if self.enabled or self.rank_logs:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.enabled:
            if check_tensorboard(cfg.train.tensorboard):
                self._sink = TensorBoardSink(self.run_dir, describe(plan), resumed)
            cfg.save(self.run_dir / "config.yaml")
            save_plan(plan, self.run_dir / "plan.json")
            (self.run_dir / "sharding.json").write_text(json.dumps(applied_sharding, indent=1))
            if resumed:
                self.started -= supersede(self.run_dir / "metrics.jsonl", resumed)
            self._file = open(self.run_dir / "metrics.jsonl", mode)
        if self.rank_logs:
            if resumed:
                supersede(self.run_dir / f"rank_{self.rank}.jsonl", resumed)
            self._rank_file = open(self.run_dir / f"rank_{self.rank}.jsonl", mode)
            shards = [f"{s.table}[{s.col_offset}:{s.col_offset + s.cols}]"
                      for s in plan.shards_on(self.rank)]
            self.record_rank({"rank": self.rank, "shards": shards,
                              "replicated": sorted(plan.replicated)})

    def record(self, event: dict) -> dict:
        """An event of the whole job (rank 0 writes it), stamped with the time (unix seconds)
        and the seconds since the run's start (`elapsed_s`); the stamped event is returned."""
        event = {**event, "time": time.time(), "elapsed_s": time.perf_counter() - self.started}
        _write(self._file, event)
        if self._sink is not None:
            self._sink.record(event)
        return event

    def record_rank(self, event: dict) -> None:
        """An event of this rank alone, kept only when rank logs were asked for."""
        _write(self._rank_file, event)

    def say(self, line: str) -> None:
        """Print on rank 0 without breaking the progress bar."""
        if self.enabled:
            tqdm.write(line)
            sys.stdout.flush()  # a batch log shows it now

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
        for f in (self._file, self._rank_file):
            if f is not None:
                f.close()


def supersede(path: Path, step: int) -> float:
    """A run resumed from the checkpoint of `step` trains the steps after it again: the events
    an earlier attempt logged for them move into one `resumed` event, so that the file holds one
    value per step (one curve) and still shows what happened. Rewritten atomically. Returns the
    last kept event's `elapsed_s`, from which the resumed run's clock goes on (0 if none)."""
    if not path.exists():
        return 0.0
    kept, superseded, elapsed = [], [], 0.0
    for line in path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:  # a line cut short by a kill: kept as it was, with the superseded
            superseded.append(line)
            continue
        if isinstance(event, dict) and event.get("step", 0) > step:
            superseded.append(event)
        else:
            kept.append(line)
            elapsed = event.get("elapsed_s", elapsed) if isinstance(event, dict) else elapsed
    kept.append(json.dumps({"step": step, "resumed": True, "superseded": superseded,
                            "time": time.time(), "elapsed_s": elapsed}))
    partial = temporary_beside(path)
    partial.write_text("".join(line + "\n" for line in kept))
    partial.replace(path)
    return elapsed


def _write(file, event: dict) -> None:
    if file is not None:
        file.write(json.dumps(event) + "\n")
        file.flush()


def done_line(steps: int, train_loss: float, metrics: dict, samples_per_s: float,
              target: Optional[dict] = None) -> str:
    """The run's last printed line; `oracle_auc` only where the data knows the true answer;
    with a target AUC, it and the seconds from the run's start to reaching it (nan: not)."""
    parts = [f"done: steps={steps}", f"train_loss={train_loss:.5f}"]
    if "val_auc" in metrics:
        parts += [f"val_auc={metrics['val_auc']:.5f}", f"val_logloss={metrics['val_logloss']:.5f}"]
    else:  # tasks: each one's; two_tower: its retrieval metrics, of a planted ceiling its recall
        parts += [f"{k}={v:.5f}" for k, v in metrics.items() if k.startswith("val_")
                  and not (k.startswith("val_ceiling_") and "recall@" not in k)]
    parts += [f"{k}={v:.5f}" for k, v in metrics.items() if k.startswith("oracle_auc")]
    parts.append(f"samples_per_s={samples_per_s:.0f}")
    if target:
        parts += [f"target_auc={target['target_auc']:.5f}",
                  f"time_to_target_s={target['time_to_target_s']:.1f}"]
    return " ".join(parts)


def metrics_text(metrics: dict) -> str:
    return " ".join(f"{k}={v:.5f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in metrics.items())
