"""Which samples each rank reads: its contiguous slice of every global batch.

Rank r of W reads samples [b*G + r*G/W, b*G + (r+1)*G/W) of global batch b (G samples), so the
union over ranks is the global batch whatever W is. With shuffling, the order of global batches
in each epoch is a permutation seeded by (seed, epoch): the same on every rank, no files needed.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator

import numpy as np

from dlrm_hybrid.config import ConfigError


def train_slices(num_samples: int, global_batch: int, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0) -> Iterator[int]:
    """First sample index of this rank's slice, step after step, epoch after epoch; the last
    partial global batch of each epoch is dropped."""
    per_epoch = num_samples // global_batch
    if per_epoch == 0:
        raise ConfigError(f"data.train_samples: {num_samples} training samples are less than one "
                          f"global batch ({global_batch}); add samples or lower "
                          f"data.global_batch_size")
    local = global_batch // world_size
    for epoch in itertools.count():
        order = (np.random.default_rng([seed, epoch]).permutation(per_epoch) if shuffle
                 else range(per_epoch))
        for b in order:
            yield int(b) * global_batch + rank * local


def eval_slices(num_samples: int, global_batch: int, rank: int, world_size: int) -> Iterator[int]:
    """Every sample exactly once; the last global batch runs past the end (padding)."""
    local = global_batch // world_size
    for b in range(math.ceil(num_samples / global_batch)):
        yield b * global_batch + rank * local
