"""How long a run trains and when it evaluates: `train.max_steps` (streamed: at most one pass,
0 the whole pass) and `train.eval_every`, or
MLPerf's schedule (`train.evals_per_epoch`): N evaluations per epoch, every
floor(train samples / (global batch * N)) steps, for at most one epoch; or, in the DLRMv4 MLPerf
mode, the rules' grid (train/mlperf_dlrmv4.py): every `.every` steps from step `.first`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from dlrm_hybrid.config import Config, ConfigError
from dlrm_hybrid.train.mlperf_dlrmv4 import EvalGrid, is_dlrmv4


@dataclass(frozen=True)
class RunSchedule:
    steps: int  # the last step
    eval_every: int  # steps between evaluations before the last step (0: only at the end)
    batch: int  # global batch size
    train_samples: int  # samples in one epoch of the training split
    grid: Optional[EvalGrid] = None  # DLRMv4's: evaluations only on it, the first at grid.first

    def evaluates_at(self, step: int) -> bool:
        """An evaluation inside the run (the last step's comes after the checkpoint)."""
        if self.grid is not None:
            return self.grid.evaluates_at(step) and step != self.steps
        return bool(self.eval_every) and step % self.eval_every == 0 and step != self.steps

    def mlperf_metadata(self, step: int) -> Optional[dict]:
        """An evaluation's MLPerf metadata after `step` steps, or None where MLPerf does not log
        it: the run's last evaluation, when off the schedule (DLRMv4's grid; DCNv2's every
        `eval_every` steps, as train.max_steps short of the epoch may end)."""
        if self.grid is None:
            if self.eval_every and step % self.eval_every:
                return None
            return {"epoch_num": self.epoch_num(step)}
        if not self.grid.evaluates_at(step):
            return None
        return {"epoch_num": self.epoch_num(step), "samples_count": self.grid.samples_count(step)}

    def epoch_num(self, step: int) -> float:
        """Epochs trained after `step` steps (MLPerf's epoch_num)."""
        return step * self.batch / self.train_samples


def run_schedule(cfg: Config, train_samples: int) -> RunSchedule:
    t, batch = cfg.train, cfg.data.global_batch_size
    if cfg.data.stream_window_s:  # one pass in time order (data/stream_windows.py)
        pass_steps = 0 if t.evals_per_epoch else train_samples // batch  # else: its epoch
        t = replace(t, max_steps=t.max_steps or pass_steps)
        if t.max_steps * batch > train_samples:
            raise ConfigError(f"train.max_steps: {t.max_steps} steps of {batch:,} are more than "
                              f"one pass over the {train_samples:,} training rows "
                              f"({train_samples // batch} steps), and a stream in time order is "
                              f"trained once; use at most {train_samples // batch}, or 0 for the "
                              f"whole pass")
    if is_dlrmv4(cfg):
        grid = EvalGrid.for_run(batch, train_samples)
        if t.evals_per_epoch or t.eval_every not in (0, grid.every):
            key = "evals_per_epoch" if t.evals_per_epoch else "eval_every"
            raise ConfigError(f"train.{key}: DLRMv4's rules evaluate every {grid.every} steps "
                              f"from step {grid.first} at global batch {batch:,} and "
                              f"{train_samples:,} training samples; set it to 0")
        return RunSchedule(t.max_steps, grid.every, batch, train_samples, grid)
    if not t.evals_per_epoch:
        return RunSchedule(t.max_steps, t.eval_every, batch, train_samples)
    every = train_samples // (batch * t.evals_per_epoch)
    if every == 0:
        raise ConfigError(f"train.evals_per_epoch: {t.evals_per_epoch} evaluations need at least "
                          f"{t.evals_per_epoch} global batches of {batch:,}, and the training "
                          f"split has {train_samples:,} samples")
    epoch = every * t.evals_per_epoch  # the last evaluation's step; the rest of the epoch is unused
    if t.max_steps > epoch:
        raise ConfigError(f"train.max_steps: {t.max_steps} is more than one epoch of "
                          f"{t.evals_per_epoch} evaluations every {every} steps ({epoch} steps); "
                          f"use 0 for the whole epoch, or fewer")
    return RunSchedule(t.max_steps or epoch, every, batch, train_samples)
