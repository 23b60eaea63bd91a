"""The start of the first input read to estimate all of it (`Sample`): the job sizes its
counters and checks the free disk by it before the first pass."""

from __future__ import annotations

import gzip
from dataclasses import dataclass

import numpy as np

from dlrm_hybrid.data.criteo import counts
from dlrm_hybrid.data.criteo.native import parse_fast
from dlrm_hybrid.data.criteo.tasks import Task, read_lines


@dataclass(frozen=True)
class Sample:
    """What the first 256 KiB of the first input say about all of it."""
    expansion: float  # bytes of text per input byte (a .gz: more than 1)
    rows_per_byte: float  # of text
    keys_per_byte: float  # distinct (feature, value) pairs per byte of text, an overestimate


def sample_input(task: Task) -> Sample:
    text = next(read_lines(task, 1 << 18), b"")
    chunk = parse_fast(text)
    expansion = 1.0
    if task.end is None:
        expansion = max(1.0, len(text) / max(_compressed_bytes_read(task.path, len(text)), 1))
    size = max(len(text), 1)
    return Sample(expansion, len(chunk.labels) / size,
                  len(np.unique(counts.keys_of(chunk.cats))) / size)


def _compressed_bytes_read(path: str, text_bytes: int) -> int:
    with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw) as f:
        f.read(text_bytes)
        return raw.tell()
