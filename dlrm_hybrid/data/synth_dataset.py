"""`python -m dlrm_hybrid synth --output DIR`: the planted synthetic dataset as split-binary files,
with the true click probabilities of every split (so training on it still reports oracle_auc)."""

from __future__ import annotations

from dlrm_hybrid.data.split_binary import SPLIT_NAMES
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter
from dlrm_hybrid.data.synthetic import SyntheticClicks

CHUNK = 65536


def write_synthetic(data_cfg, output: str) -> dict:
    """Write train, validation and test splits; returns the sample count of each."""
    data = SyntheticClicks(data_cfg)
    writer = SplitBinaryWriter(output, data.spec)
    try:
        for ours, folder in SPLIT_NAMES.items():
            total = data.num_samples(ours)
            for first in range(0, total, CHUNK):
                b = data.batch(ours, first, min(CHUNK, total - first))
                cats = [b.sparse[k].values().reshape(len(b.labels), -1).numpy()
                        for k in data.spec.feature_names]
                writer.write(folder, b.labels.numpy(), b.dense.numpy(), cats, b.true_prob.numpy())
    except BaseException:
        writer.abort()
        raise
    writer.finish()
    return writer.counts
