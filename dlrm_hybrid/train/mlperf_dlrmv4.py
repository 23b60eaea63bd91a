"""MLPerf Training v6.1 DLRMv4's evaluation grid (closed_dlrmv4.yaml in mlperf-logging's
compliance checker, training_6.1.0): an evaluation every 0.1% of the training samples, rounded
up to whole global batches, and the first one on the first grid point at or after the
reference's earliest convergence for the batch size. Computed here exactly as the rule file
computes it, so a run's `eval_accuracy` samples_count values are the ones the checker accepts.

The rule fixes the real log's size (`TRAIN_SAMPLES`); a run on a smaller log passes its own, and
its first evaluation's threshold is the reference's scaled by its size (`scaled_threshold`).
`check_rules` refuses, in one line, a DLRMv4 MLPerf run with settings the closed rules forbid."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dlrm_hybrid.config import Config, ConfigError

TRAIN_SAMPLES = 2_290_835_423  # Yambda-5b's training samples, as the closed rules fix them
EVAL_SAMPLES = 2_058_204
MAX_SEQUENCE_LENGTH = 4096
EVAL_EVERY_DATA_PCT = 0.001  # the rule's fraction of train_samples between evaluations
TARGET_AUC = 0.75
BETAS, EPSILON, CLIP_NORM, WARMUP_STEPS = [0.95, 0.999], 1e-8, 1.0, 24000  # the closed rules'


def eval_interval_samples(global_batch: int, train_samples: int = TRAIN_SAMPLES) -> int:
    """Samples between evaluations: 0.1% of train_samples divided once by the global batch,
    rounded up (at least one batch), back in samples."""
    return max(1, int(math.ceil(EVAL_EVERY_DATA_PCT * train_samples / global_batch))) * global_batch


def convergence_threshold(global_batch: int) -> int:
    """The reference sweep's earliest convergence at this batch size less its two-block margin
    (the rule's linear fit, in samples)."""
    return math.floor((4480 * global_batch + 135331840) / 3)


def scaled_threshold(global_batch: int, train_samples: int) -> int:
    """`convergence_threshold` as the same share of a log of `train_samples` (equal to it at the
    rules' TRAIN_SAMPLES): a small log's run reaches its first evaluation within its data."""
    return (4480 * global_batch + 135331840) * train_samples // (3 * TRAIN_SAMPLES)


def first_eval_samples(global_batch: int, train_samples: int = TRAIN_SAMPLES,
                       threshold: Optional[int] = None) -> int:
    """The first grid point at or after `threshold` (default `convergence_threshold`): where the
    first evaluation is."""
    interval = eval_interval_samples(global_batch, train_samples)
    if threshold is None:
        threshold = convergence_threshold(global_batch)
    return int(math.ceil(threshold / interval)) * interval


@dataclass(frozen=True)
class EvalGrid:
    """The grid in steps: evaluations every `every` steps from step `first`."""

    batch: int  # global batch size
    every: int  # steps between evaluations
    first: int  # the first evaluation's step

    @staticmethod
    def of(global_batch: int, train_samples: int = TRAIN_SAMPLES,
           threshold: Optional[int] = None) -> "EvalGrid":
        interval = eval_interval_samples(global_batch, train_samples)
        first = first_eval_samples(global_batch, train_samples, threshold)
        return EvalGrid(global_batch, interval // global_batch, first // global_batch)

    @staticmethod
    def for_run(global_batch: int, train_samples: int) -> "EvalGrid":
        """A run's grid on its training split: the rules' on the real log, and on a smaller one
        its own interval with the threshold scaled to it."""
        return EvalGrid.of(global_batch, train_samples,
                           scaled_threshold(global_batch, train_samples))

    @property
    def first_block(self) -> int:
        """The first evaluation's grid point (1-based: block n ends at n intervals)."""
        return self.first // self.every

    def evaluates_at(self, step: int) -> bool:
        """Whether the run evaluates after `step` steps."""
        return step >= self.first and step % self.every == 0

    def samples_count(self, step: int) -> int:
        """eval_accuracy's samples_count metadata after `step` steps: samples trained."""
        return step * self.batch


def is_dlrmv4(cfg: Config) -> bool:
    """An MLPerf run (train.mlperf_log) of DLRMv4's shape: a ranker with the HSTU sequence
    feature; any other ranker's MLPerf log is DLRM-DCNv2's."""
    return bool(cfg.train.mlperf_log) and cfg.model.sequence == "hstu"


def check_rules(cfg: Config) -> None:
    """Refuse, in one line naming the key, what closed_dlrmv4.yaml forbids: the optimizers, Adam's
    betas and epsilon, the clip norm, the warm-up, a decay, the learning rate outside its band."""
    o, batch = cfg.optim, cfg.data.global_batch_size
    fixed = {"optim.dense": (o.dense, "adam"), "optim.dense_betas": (o.dense_betas, BETAS),
             "optim.eps": (o.eps, EPSILON), "optim.dense_clip_norm": (o.dense_clip_norm, CLIP_NORM),
             "optim.embedding": (o.embedding, "rowwise_adagrad"),
             "optim.warmup_steps": (o.warmup_steps, WARMUP_STEPS),
             # the warm-up ramps to a constant rate; the log has no key for a decay
             "optim.decay_start_step": (o.decay_start_step, 0),
             "optim.decay_steps": (o.decay_steps, 0)}
    for key, (value, rule) in fixed.items():
        if value != rule:
            raise ConfigError(f"{key}: DLRMv4's closed rules fix it at {rule}, not {value}; set "
                              f"{key}={rule} (or leave train.mlperf_log empty)")
    low, high = 0.5e-6 * batch / 8192, 1.5e-6 * batch / 8192
    if not low * (1 - 1e-9) <= o.dense_lr <= high * (1 + 1e-9):
        raise ConfigError(f"optim.dense_lr: {o.dense_lr} is outside DLRMv4's band for global batch "
                          f"{batch:,}, [{low:.4g}, {high:.4g}] (0.5 to 1.5 x 1e-6 x batch / 8192)")


def check_history(cfg: Config, feature_names, where: str) -> None:
    """The log reports max_sequence_length as model.hstu.max_length + 1, and the ranker's HSTU
    reads the dataset's history slots: a DLRMv4 run whose dataset has other slots would log a
    length it does not train with, so it is refused."""
    from dlrm_hybrid.data.interactions.interaction_meta import HISTORY

    slots = sum(name.startswith(HISTORY) for name in feature_names)
    if is_dlrmv4(cfg) and not slots:
        raise ConfigError(f"model.hstu.max_length: {cfg.model.hstu.max_length}, and {where} has "
                          f"no history slots: preprocess it with --history "
                          f"{cfg.model.hstu.max_length}")
    if is_dlrmv4(cfg) and slots != cfg.model.hstu.max_length:
        raise ConfigError(f"model.hstu.max_length: {cfg.model.hstu.max_length}, and {where} "
                          f"has {slots} history slots: the MLPerf log's max_sequence_length "
                          f"would not be the length trained; preprocess with --history "
                          f"{cfg.model.hstu.max_length}, or set model.hstu.max_length={slots}")
