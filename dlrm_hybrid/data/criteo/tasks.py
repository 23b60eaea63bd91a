"""Cutting the inputs into tasks (the unit a worker does, and the unit a killed run redoes) and
reading a task's text in blocks of whole lines."""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

from dlrm_hybrid.errors import DataError

TASK_BYTES = 64 << 20  # one task of a plain file; tests shrink it to exercise several per file
CHUNK_BYTES = 8 << 20  # parsed at once; the memory plan may choose less
BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which some editors put first in a file


@dataclass(frozen=True)
class Task:
    """Whole lines of one input: bytes [start, end) of a plain file, or all of a .gz (end None)."""
    path: str
    start: int
    end: Optional[int]

    @property
    def size(self) -> int:
        """Bytes of input this task reads (a .gz: its compressed size)."""
        return os.path.getsize(self.path) if self.end is None else self.end - self.start


def plan_tasks(paths: Sequence[str], task_bytes: int = TASK_BYTES) -> List[Task]:
    """Cut plain files into about `task_bytes` ranges starting at line starts; a .gz is one task."""
    tasks: List[Task] = []
    for path in paths:
        try:
            with open(path, "rb") as f:
                if path.endswith(".gz"):
                    tasks.append(Task(path, 0, None))
                    continue
                size = os.fstat(f.fileno()).st_size
                starts = {_next_line_start(f, b) for b in range(task_bytes, size, task_bytes)}
                cuts = sorted({0, size} | starts)
                tasks += [Task(path, a, b) for a, b in zip(cuts, cuts[1:])]
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror}); check the --input path") from None
    return tasks


def _next_line_start(f, position: int) -> int:
    f.seek(position - 1)
    while True:
        block = f.read(1 << 16)
        found = block.find(b"\n")
        if found >= 0:
            return f.tell() - len(block) + found + 1
        if not block:
            return f.tell()


def read_lines(task: Task, block: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The task's text in blocks of whole lines of about `block` bytes, each ending in a
    newline; a byte-order mark at the start of the file dropped (else its row is a bad label)."""
    carry = b""
    first = task.start == 0
    try:
        with (gzip.open(task.path, "rb") if task.end is None else open(task.path, "rb")) as f:
            f.seek(task.start)
            left = None if task.end is None else task.end - task.start
            while data := f.read(block if left is None else min(block, left)):
                left = None if left is None else left - len(data)
                if first:
                    data, first = data.removeprefix(BOM), False
                cut = data.rfind(b"\n") + 1
                if cut:
                    yield carry + data[:cut]
                    carry = data[cut:]
                else:
                    carry += data
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{task.path}: truncated or corrupt gzip file ({e}); download it "
                        f"again") from None
    except OSError as e:
        raise DataError(f"{task.path}: cannot read ({e.strerror or e}); check the file") from None
    if carry:
        yield carry + b"\n"
