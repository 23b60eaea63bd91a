"""`python -m dlrm_hybrid synth --output DIR`: the planted synthetic dataset as split-binary files,
with the true click probabilities of every split (so training on it still reports oracle_auc).
With model.tasks, one label per task (missing ones as the planted data has them) and each task's
true probability (oracle_auc_<task>)."""

from __future__ import annotations

from typing import Sequence

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.split_binary import SPLIT_NAMES
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
from dlrm_hybrid.data.feature_spec import LABEL, SINGLE_TASK
from dlrm_hybrid.data.synthetic import SyntheticClicks

CHUNK = 65536


def write_synthetic(data_cfg, output: str, tasks: Sequence[str] = ()) -> dict:
    """Write train, validation and test splits (the labels data.labels plants, else those of
    `tasks`, model.tasks' names; none: one click label); returns the sample count of each."""
    tasks = list(data_cfg.labels) or list(tasks)
    if data_cfg.hotness_distribution != "fixed":
        raise ConfigError(f"data.hotness_distribution: {data_cfg.hotness_distribution!r} cannot be "
                          f"written (split-binary files hold fixed hotness); use fixed for synth "
                          f"--output, or train on the synthetic data directly (data.path empty)")
    if len(tasks) == 1 and tasks[0] != SINGLE_TASK:
        raise ConfigError(f"model.tasks: a dataset with one label reads as the task "
                          f"{SINGLE_TASK}; name the task {SINGLE_TASK}, or plant several")
    data = SyntheticClicks(data_cfg, tasks)
    data.use_tasks(tasks, "the planted synthetic data")
    with SplitBinaryWriter(output, data.spec, labels=list(tasks) or [LABEL]) as writer:
        for ours, folder in SPLIT_NAMES.items():
            total = data.num_samples(ours)
            for first in range(0, total, CHUNK):
                c = data.columns(ours, first, min(CHUNK, total - first))
                writer.write(folder, c.labels, c.dense, c.ids, c.true_prob)
    return writer.counts
