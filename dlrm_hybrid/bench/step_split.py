"""Where a training step's time goes, from a profile of a few steps: every op's own time is
charged to the first part its name, or the name of an op it runs inside, points to."""

from __future__ import annotations

import os
from collections import Counter
from typing import Callable, Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile

# Kineto, the profiler's engine, writes `USDT:<time> <pid>:<tid> ...] profiler_start` (and
# `profiler_stop`) to stderr at every profile: USDT is its highest log level, above the errors
# torch quiets it down to, so only a level past every one (6) drops the lines. Kineto reads
# KINETO_LOG_LEVEL once, at the process's first profile; a level the user set is kept.
KINETO_SILENT = "6"
PARTS = ("embedding_fwd", "embedding_bwd", "exchange", "dense", "optimizer")
# (part, name fragments), first match wins; names are torchrec's record_function labels,
# fbgemm's ops and autograd's backward nodes (a CUDA kernel's time counts for the op that
# launched it). Everything else is the dense part.
RULES = (
    ("optimizer", ("Optimizer.",)),
    ("embedding_bwd", ("split_embedding_backward", "SplitLookupFunction", "embedding_backward",
                       "EmbeddingBagBackward", "SgdLookupBackward")),
    ("embedding_fwd", ("[lookup]", "split_embedding_codegen_forward", "bounds_check_indices")),
    ("exchange", ("_dist]", "all_to_all", "alltoall", "All2All", "AllToAll")),
)


def part_of(names: List[str]) -> str:
    """The part of an op whose name and enclosing ops' names (innermost first) are `names`."""
    for name in names:
        for part, fragments in RULES:
            if any(f in name for f in fragments):
                return part
    return "dense"


def step_split(step: Callable[[], object], steps: int, device: torch.device,
               detailed: bool = False) -> Tuple[Dict[str, float], profile]:
    """Milliseconds per step of each part, profiling `steps` calls of `step`, and the profile
    (`detailed`: with each op's input shapes and FLOPs, for `bench --profile`)."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_SILENT)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=detailed, with_flops=detailed) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    totals: Counter = Counter({part: 0.0 for part in PARTS})
    for event in prof.events():
        own = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if own > 0:
            totals[part_of(_names(event))] += own / 1000 / steps
    return dict(totals), prof


def _names(event) -> List[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names
