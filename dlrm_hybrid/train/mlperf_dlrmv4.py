"""MLPerf Training v6.1 DLRMv4's evaluation grid (closed_dlrmv4.yaml in mlperf-logging's
compliance checker, training_6.1.0): an evaluation every 0.1% of the training samples, rounded
up to whole global batches, and the first one on the first grid point at or after the
reference's earliest convergence for the batch size. Computed here exactly as the rule file
computes it, so a run's `eval_accuracy` samples_count values are the ones the checker accepts.

The rule fixes the real log's size (`TRAIN_SAMPLES`); a run on a smaller log passes its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

TRAIN_SAMPLES = 2_290_835_423  # Yambda-5b's training samples, as the closed rules fix them
EVAL_SAMPLES = 2_058_204
MAX_SEQUENCE_LENGTH = 4096
EVAL_EVERY_DATA_PCT = 0.001  # the rule's fraction of train_samples between evaluations
TARGET_AUC = 0.75


def eval_interval_samples(global_batch: int, train_samples: int = TRAIN_SAMPLES) -> int:
    """Samples between evaluations: 0.1% of train_samples divided once by the global batch,
    rounded up (at least one batch), back in samples."""
    return max(1, int(math.ceil(EVAL_EVERY_DATA_PCT * train_samples / global_batch))) * global_batch


def convergence_threshold(global_batch: int) -> int:
    """The reference sweep's earliest convergence at this batch size less its two-block margin
    (the rule's linear fit, in samples)."""
    return math.floor((4480 * global_batch + 135331840) / 3)


def first_eval_samples(global_batch: int, train_samples: int = TRAIN_SAMPLES) -> int:
    """The first grid point at or after `convergence_threshold`: where the first evaluation is."""
    interval = eval_interval_samples(global_batch, train_samples)
    return int(math.ceil(convergence_threshold(global_batch) / interval)) * interval


@dataclass(frozen=True)
class EvalGrid:
    """The grid in steps: evaluations every `every` steps from step `first`."""

    batch: int  # global batch size
    every: int  # steps between evaluations
    first: int  # the first evaluation's step

    @staticmethod
    def of(global_batch: int, train_samples: int = TRAIN_SAMPLES) -> "EvalGrid":
        interval = eval_interval_samples(global_batch, train_samples)
        return EvalGrid(global_batch, interval // global_batch,
                        first_eval_samples(global_batch, train_samples) // global_batch)

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
