"""How many intra-op threads a training process uses when the user does not say
(OMP_NUM_THREADS unset): the cores it may run on, shared by the ranks of its host, less one for
the loader's thread, at least one.

Why not torch's own default (every core): torch's CPU ops are OpenMP regions of one team, and
libgomp's team threads spin between regions (GOMP_SPINCOUNT: 300,000 turns). When every core is
in the team and anything else wants one (another job, a container's CPU limit, the loader
thread), the spinning threads take its time slices and each small op waits for a descheduled
team thread. One process training the demo from split-binary files at batch 256 on a 2-core
AMD EPYC (AVX2, 2026-12-07), one core kept busy by `yes`: 2 threads 16,885-23,978 samples/s,
1 thread 70,033-79,891, 2 threads that do not spin (GOMP_SPINCOUNT=0) 58,517-64,091; idle,
1 thread 68,383-76,221, 2 threads 68,621-82,429 (29,689-34,100 if they do not spin).
benchmarks/train_throughput.py --threads measures it. In-memory synthetic data loses less
(1.4-1.8x): its loader thread runs OpenMP regions too, and libgomp spins 100 turns when it
manages more threads than there are CPUs. An explicit OMP_NUM_THREADS (torchrun sets 1 for the
several ranks it starts) is kept as given.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Optional

ENV = "OMP_NUM_THREADS"
CGROUP = Path("/sys/fs/cgroup")


def default_threads(local_world_size: int = 1, cores: Optional[int] = None) -> int:
    """Intra-op threads per rank: its share of `cores` (those this process may use) less the
    loader thread's core, at least 1."""
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, local_world_size) - 1)


def usable_cores(cgroup: Path = CGROUP) -> int:
    """Physical cores among the CPUs this process may run on (its affinity), no more than its
    cgroup's CPU quota (a container's limit)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = _physical_cores(cpus) or os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return max(1, min(cores, quota) if quota else cores)


def _physical_cores(cpus) -> int:
    """Distinct (package, core) pairs of `cpus`; 0 where the topology cannot be read."""
    seen = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            seen.add(((topology / "physical_package_id").read_text().strip(),
                      (topology / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(seen)


def cpu_quota(cgroup: Path = CGROUP) -> Optional[int]:
    """The cgroup's CPU limit in whole CPUs, rounded up (v2 `cpu.max`, v1 `cpu.cfs_quota_us`);
    None without one."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit():
        return None
    return max(1, math.ceil(int(quota) / max(1, int(period))))


def apply_thread_defaults(local_world_size: int = 1) -> Optional[int]:
    """Set this process's threads to `default_threads` unless OMP_NUM_THREADS says otherwise:
    in the environment, for libgomp and MKL to read when torch loads (every thread then starts
    with it, the loader's too), and in torch where it is loaded already. Returns the count set,
    or None when the user's (or torchrun's) setting stands."""
    if os.environ.get(ENV, "").strip():
        return None
    threads = default_threads(local_world_size)
    os.environ[ENV] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    return threads
