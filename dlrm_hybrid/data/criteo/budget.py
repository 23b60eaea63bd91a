"""The memory limit of a preprocessing run and how it is shared out, the process tree's peak RSS,
and free disk.

Every process (the parent, the fork server the workers are forked from, and each worker) costs
`base` (Python and numpy, measured at start);
the rest of the limit is split among the workers: a worker parses `chunk_bytes` of text at a time,
counts at most `counter_capacity` distinct keys before it spills a run, and an aggregation range
holds at most `range_entries` run entries. The parent keeps only per-task records.

Peak RSS of the tree is bounded from above by the parent's peak, the fork server's, and, for the
pool of workers that peaked highest together, the sum of each worker's peak (each reports its own
VmHWM, and its fork server's)."""

from __future__ import annotations

import os
import re
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.errors import DataError

DEFAULT_FRACTION = 0.5  # of the memory available at start, when no --memory-limit is given
RANGE_BYTES_PER_ENTRY = 96  # a range's keys and counts, summed then numbered, with temporaries
LOOKUP_BYTES_PER_VALUE = 48  # pass 2: the value, its sorted copy and id, up to 32 B of hash slots
PARSE_BYTES_PER_BYTE = {"numpy": 16, "native": 6}  # a worker's arrays per byte of text
HEADROOM = 0.8  # of the limit planned for: the rest for what the allocator holds back
MIN_CHUNK_BYTES = 256 << 10
MIN_ENTRIES = 1 << 15
SIZE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*")


def parse_size(text: str) -> int:
    """`512M`, `2G`, `1.5GiB`, `800000000` -> bytes (K/M/G/T binary)."""
    match = SIZE.fullmatch(text)
    if not match:
        raise ConfigError(f"--memory-limit: {text!r} is not a size; write e.g. 512M, 4G or 16GiB")
    return int(float(match[1]) * 1024 ** " kmgt".index((match[2] or " ").lower()))


def available_memory() -> int:
    """Memory this process may still use: MemAvailable, or less under a cgroup (container) limit."""
    available = _kib_field("/proc/meminfo", "MemAvailable") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = (Path(p).read_text().strip() for p in (limit_file, usage_file))
        except OSError:
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            available = min(available, int(limit) - int(usage))
        break
    return available


def own_peak_rss() -> int:
    """This process's peak RSS in bytes: VmHWM, the high-water mark of this program's own memory
    (ru_maxrss would start at the RSS of the parent that forked it, e.g. a large Python)."""
    return _status("VmHWM") or 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def parent_peak_rss() -> int:
    """The parent process's peak RSS in bytes (a worker's parent: its fork server); 0 if unread."""
    return _kib_field(f"/proc/{os.getppid()}/status", "VmHWM") or 0


def own_rss() -> int:
    return _status("VmRSS") or own_peak_rss()


def _status(key: str) -> Optional[int]:
    return _kib_field("/proc/self/status", key)


def _kib_field(path: str, key: str) -> Optional[int]:
    """`key:  N kB` of a /proc file, in bytes; None where there is no such file or line."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class MemoryPlan:
    limit: int
    workers: int
    base: int  # bytes one process costs before any data
    chunk_bytes: int
    counter_capacity: int
    range_entries: int

    def lookup_workers(self, vocabulary_values: int, parse_bytes_per_byte: int) -> int:
        """Workers whose vocabulary lookups fit the limit in the write pass; 0 if none does."""
        need = self.base + vocabulary_values * LOOKUP_BYTES_PER_VALUE \
            + self.chunk_bytes * parse_bytes_per_byte
        return max(0, min(self.workers, (int(self.limit * HEADROOM) - self.base) // need))


def plan_memory(limit: int, workers: int, counter_bytes_per_entry: int,
                parse_bytes_per_byte: int, chunk_bytes: int) -> MemoryPlan:
    """Share `limit` among the parent, the fork server and `workers` workers; a limit too
    small for that is a one-line error."""
    base = own_rss()
    processes = workers + 2
    share = (int(limit * HEADROOM) - base * processes) // workers
    chunk = min(chunk_bytes, max(MIN_CHUNK_BYTES, share // 4 // parse_bytes_per_byte))
    counter = (share - chunk * parse_bytes_per_byte) // counter_bytes_per_entry
    entries = share * 3 // 4 // RANGE_BYTES_PER_ENTRY
    if min(counter, entries) < MIN_ENTRIES:
        need = (base * processes + workers * (MIN_CHUNK_BYTES * parse_bytes_per_byte
                                                  + MIN_ENTRIES * RANGE_BYTES_PER_ENTRY)) / HEADROOM
        raise ConfigError(f"--memory-limit: {limit / 2**20:,.0f} MiB is below the "
                          f"{need / 2**20:,.0f} MiB that {workers} workers need at least "
                          f"({base / 2**20:.0f} MiB per process before data); raise it or "
                          f"use fewer --workers")
    return MemoryPlan(limit, workers, base, chunk, counter, entries)


def parse_bytes_per_byte() -> int:
    from dlrm_hybrid.data.criteo import native
    return PARSE_BYTES_PER_BYTE["native" if native.available() else "numpy"]


class NoDiskSpace(DataError):
    """A refusal that freeing space undoes: the work a stopped run left is kept for the next."""


def check_free_disk(folder: Path, need: int, what: str) -> None:
    """Refuse, before writing, when the disk holding `folder` has less than `need` bytes free."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise NoDiskSpace(f"{folder}: {what} need about {need / 2**30:,.2f} GiB of disk, "
                        f"{free / 2**30:,.2f} GiB are free; free space there or put --output on "
                        f"a larger disk (work done so far is kept)")


def describe(limit: int, given: bool, available: int) -> str:
    if given:
        return f"memory limit {limit / 2**30:,.2f} GiB (--memory-limit)"
    return (f"memory limit {limit / 2**30:,.2f} GiB ({DEFAULT_FRACTION:.0%} of the "
            f"{available / 2**30:,.1f} GiB available; --memory-limit to change)")
