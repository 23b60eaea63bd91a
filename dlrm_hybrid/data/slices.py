"""Which samples each rank reads: its contiguous part of every global batch.

Rank r of W reads samples [p + r*G/W, p + (r+1)*G/W) of the global batch at stream position p
(G samples), so the union over ranks is the global batch whatever W is. Training reads the
split as an endless stream, epoch after epoch: global batch s covers positions [s*G, (s+1)*G),
and a batch that runs past an epoch's end carries over into the next epoch, so every row is read
once per epoch (dropping the last partial batch dropped the same rows every epoch). An epoch is
the split cut into blocks of G rows, the full ones in order or, with shuffling, in an order
seeded by (seed, epoch) (the same on every rank, no files needed), then the last partial block.
A rank's part of a batch is therefore one to a few runs of consecutive rows (`Slice.runs`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator, List, Tuple

import numpy as np

from dlrm_hybrid.config import ConfigError


@dataclass(frozen=True)
class Slice:
    """This rank's part of global batch `step`: `runs` of (first row, count) of the split, in
    order; `offset`: where the part starts in the global batch. Rows past the split's end are
    padding (evaluation's last batch)."""

    step: int
    offset: int
    runs: Tuple[Tuple[int, int], ...]


def train_slices(num_samples: int, global_batch: int, rank: int, world_size: int,
                 shuffle: bool = False, seed: int = 0) -> Iterator[Slice]:
    """This rank's slice of each global batch, step after step, epoch after epoch."""
    if num_samples < global_batch:
        raise ConfigError(f"data.train_samples: {num_samples} training samples are less than one "
                          f"global batch ({global_batch}); add samples or lower "
                          f"data.global_batch_size")
    local = global_batch // world_size
    epochs = _Epochs(num_samples, global_batch, shuffle, seed)
    for step in itertools.count():
        start = step * global_batch + rank * local
        yield Slice(step, rank * local, tuple(epochs.runs(start, local)))


class _Epochs:
    """Stream positions -> rows: epoch e = p // N holds the rows in its block order."""

    def __init__(self, rows: int, block: int, shuffle: bool, seed: int) -> None:
        self.rows, self.block, self.shuffle, self.seed = rows, block, shuffle, seed
        self.epoch, self.order = -1, np.zeros(0, np.int64)

    def _blocks(self, epoch: int) -> np.ndarray:
        """The epoch's blocks in reading order (block b: rows [b*G, min(N, (b+1)*G)))."""
        if epoch != self.epoch:
            full = self.rows // self.block
            order = (np.random.default_rng([self.seed, epoch]).permutation(full) if self.shuffle
                     else np.arange(full))
            tail = [full] if self.rows % self.block else []
            self.epoch, self.order = epoch, np.concatenate([order, tail]).astype(np.int64)
        return self.order

    def runs(self, position: int, count: int) -> List[Tuple[int, int]]:
        """(first row, count) runs of stream positions [position, position + count)."""
        out: List[Tuple[int, int]] = []
        while count:
            epoch, at = divmod(position, self.rows)
            k, within = divmod(at, self.block)  # only the last block is short
            first = int(self._blocks(epoch)[k]) * self.block + within
            take = min(count, self.block - within, self.rows - at)
            if out and out[-1][0] + out[-1][1] == first:
                out[-1] = (out[-1][0], out[-1][1] + take)
            else:
                out.append((first, take))
            position, count = position + take, count - take
        return out


def eval_slices(num_samples: int, global_batch: int, rank: int, world_size: int
                ) -> Iterator[Slice]:
    """Every sample exactly once; the last global batch runs past the end (padding)."""
    local = global_batch // world_size
    for b in range(math.ceil(num_samples / global_batch)):
        yield Slice(b, rank * local, ((b * global_batch + rank * local, local),))
