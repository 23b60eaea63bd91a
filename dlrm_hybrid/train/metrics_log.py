"""Rank 0's record of a run: `metrics.jsonl` (one JSON object per event) and printed lines."""

from __future__ import annotations

import json
from pathlib import Path
from tqdm import tqdm

from dlrm_hybrid.parallel.plan_file import save_plan


class MetricsLog:
    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.run_dir = run_dir
        self.enabled = enabled
        self._file = None

    def begin(self, cfg, plan, applied_sharding: dict) -> None:
        """Once the run is known to start: the run directory with the resolved config, the plan
        (reusable as `parallel.plan`) and the sharding torchrec applied."""
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.yaml")
            save_plan(plan, self.run_dir / "plan.json")
            (self.run_dir / "sharding.json").write_text(json.dumps(applied_sharding, indent=1))
            self._file = open(self.run_dir / "metrics.jsonl", "w")

    def record(self, event: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(event) + "\n")
            self._file.flush()

    def say(self, line: str) -> None:
        """Print on rank 0 without breaking the progress bar."""
        if self.enabled:
            tqdm.write(line)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def done_line(steps: int, train_loss: float, metrics: dict, samples_per_s: float) -> str:
    """The run's last printed line; `oracle_auc` only where the data knows the true answer."""
    parts = [f"done: steps={steps}", f"train_loss={train_loss:.5f}",
             f"val_auc={metrics['val_auc']:.5f}", f"val_logloss={metrics['val_logloss']:.5f}"]
    if "oracle_auc" in metrics:
        parts.append(f"oracle_auc={metrics['oracle_auc']:.5f}")
    parts.append(f"samples_per_s={samples_per_s:.0f}")
    return " ".join(parts)
