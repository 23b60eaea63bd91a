"""Which samples each rank reads: its contiguous slice of every global batch.

Rank r of W reads samples [b*G + r*G/W, b*G + (r+1)*G/W) of global batch b (G samples), so the
union over ranks is the global batch whatever W is.
"""

from __future__ import annotations

import math
from typing import Iterator

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.batch import Batch


def train_batches(dataset, global_batch: int, rank: int, world_size: int) -> Iterator[Batch]:
    """Endless: epoch after epoch, the last partial global batch of each dropped."""
    local = global_batch // world_size
    per_epoch = dataset.num_samples("train") // global_batch
    if per_epoch == 0:
        raise ConfigError(f"data.train_samples: {dataset.num_samples('train')} is less than one "
                          f"global batch ({global_batch}); add samples or lower data.global_batch_size")
    step = 0
    while True:
        first = (step % per_epoch) * global_batch + rank * local
        yield dataset.batch("train", first, local)
        step += 1


def eval_batches(dataset, split: str, global_batch: int, rank: int,
                 world_size: int) -> Iterator[Batch]:
    """Every sample of `split` exactly once; the last global batch is padded (valid=False)."""
    local = global_batch // world_size
    for b in range(math.ceil(dataset.num_samples(split) / global_batch)):
        yield dataset.batch(split, b * global_batch + rank * local, local)
