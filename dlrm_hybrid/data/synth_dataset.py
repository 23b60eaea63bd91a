"""`python -m dlrm_hybrid synth --output DIR`: the planted synthetic dataset as split-binary files,
with the true click probabilities of every split (so training on it still reports oracle_auc)."""

from __future__ import annotations

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.split_binary import SPLIT_NAMES
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
from dlrm_hybrid.data.synthetic import SyntheticClicks

CHUNK = 65536


def write_synthetic(data_cfg, output: str) -> dict:
    """Write train, validation and test splits; returns the sample count of each."""
    if data_cfg.hotness_distribution != "fixed":
        raise ConfigError(f"data.hotness_distribution: {data_cfg.hotness_distribution!r} cannot be "
                          f"written (split-binary files hold fixed hotness); use fixed for synth "
                          f"--output, or train on the synthetic data directly (data.path empty)")
    data = SyntheticClicks(data_cfg)
    with SplitBinaryWriter(output, data.spec) as writer:
        for ours, folder in SPLIT_NAMES.items():
            total = data.num_samples(ours)
            for first in range(0, total, CHUNK):
                c = data.columns(ours, first, min(CHUNK, total - first))
                writer.write(folder, c.labels, c.dense, c.ids, c.true_prob)
    return writer.counts
