"""`python -m dlrm_hybrid bench`: steady-state training speed of a config in one process,
where the step's time goes, how close it is to the device's roofline, and the ratio to the
reference-style baseline trained in the same process on the same batches."""

from __future__ import annotations

import itertools
import re
import resource
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from dlrm_hybrid.bench.baseline import ReferenceBatch, reference_step
from dlrm_hybrid.bench.kernels import kernel_table, save_profile, top_kernels
from dlrm_hybrid.bench.roofline import (Peaks, Roofline, dense_flops_per_sample,
                                        embedding_bytes_per_sample, measure_peaks, synchronize)
from dlrm_hybrid.bench.step_split import PARTS, step_split
from dlrm_hybrid.bench.torchrec_peer import torchrec_models, torchrec_peer_step
from dlrm_hybrid.config import Config
from dlrm_hybrid.data.source import makes_on_device, open_dataset
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.parallel.process_group import DistEnv
from dlrm_hybrid.train.cuda_graphs import WARMUP_STEPS
from dlrm_hybrid.train.loop import build_sharded_model
from dlrm_hybrid.train.optim import build_optimizer
from dlrm_hybrid.train.precision import Precision, cpu_capability
from dlrm_hybrid.train.step import TrainStep

DISTINCT_BATCHES = 16  # cycled; generated before timing, so both sides see only training work
ROUNDS = 3  # ours and the baseline alternate, so a load change on the machine hits both
SPLIT_STEPS = 5


def bench(cfg: Config, env: DistEnv, steps: int, warmup: int,
          profile_dir: Optional[Path] = None, peers: Sequence[str] = ("reference",)) -> None:
    """`profile_dir`: also print the step's top kernels and write the profile's trace there.
    `peers`: what else trains on the same batches, timed in turns with ours (PEERS)."""
    device, B = env.device, cfg.data.global_batch_size
    dataset = open_dataset(cfg.data, cfg.model)
    batches, data_ms = _batches(dataset, B, min(DISTINCT_BATCHES, steps + warmup), device)
    made_on = device.type if makes_on_device(dataset, device) else "host"

    dmp, _ = build_sharded_model(cfg, dataset.spec, env, lambda line: None)
    ours = TrainStep(dmp, *build_optimizer(dmp, cfg.optim), cfg.train, device)
    if ours.graph is not None:
        warmup = max(warmup, WARMUP_STEPS + 2)
    ours_run = _Timed(ours, batches, device)
    ours_run.warm_up(warmup)
    counter = dmp.module.exchange_counter
    counter.take(0)
    rounds = [steps // ROUNDS + (r < steps % ROUNDS) for r in range(ROUNDS)]
    ours_run.timed(rounds[0])
    exchange = counter.take(rounds[0])
    peak_gib = _peak_memory_gib(device)

    ours.pause()
    peer_runs = {name: _peer_run(name, cfg, dataset.spec, env, batches, warmup) for name in peers}
    for run in peer_runs.values():
        run.timed(rounds[0])
    for n in rounds[1:]:
        ours_run.timed(n)
        for run in peer_runs.values():
            run.timed(n)

    split, prof = step_split(ours_run.one_step, SPLIT_STEPS, device, detailed=bool(profile_dir))
    precision = ours.precision  # what runs: bf16/fp16 fall back to fp32 on a CPU that emulates them
    peaks = measure_peaks(device, precision.dtype or torch.float32)
    spec, dim = dataset.spec, cfg.model.embedding_dim
    roof = Roofline(embedding_bytes_per_sample(spec, dim, cfg.model.embedding_precision,
                                               cfg.optim.embedding),
                    dense_flops_per_sample(dmp.module, cfg.model.interaction,
                                           len(spec.cardinalities) + 1, dim),
                    peaks.bandwidth, peaks.flops_per_s)
    x = ours_run.samples_per_s(B)
    peer_rates = {name: run.samples_per_s(B) for name, run in peer_runs.items()}
    cpu = cpu_capability()
    path = dmp.module.exchange
    print(_report(cfg, device, steps, precision, cpu, x, peer_rates, (data_ms, made_on), split,
                  roof, peaks, peak_gib))
    if profile_dir is not None:
        table = kernel_table(top_kernels(prof, SPLIT_STEPS, device), sum(split.values()), device,
                             peaks.flops_per_s, peaks.bandwidth)
        print(table)
        save_profile(prof, profile_dir, table)
        print(f"  profile: {profile_dir}/trace.json ({SPLIT_STEPS} steps; open in Perfetto or "
              f"chrome://tracing)")
    print(f"  embedding exchange: {path}, rank {env.rank} sends {exchange['exchange_fwd_bytes']:,.0f} "
          f"+ {exchange['exchange_bwd_bytes']:,.0f} bytes per step (forward + backward, counted; "
          f"one rank exchanges nothing: `plan --world-size N` gives both paths' bytes at N)")
    print(_last_line(precision, x, peer_rates, x / roof.samples_per_s, peak_gib, cpu)
          + f" exchange={path} exchange_bytes="
            f"{exchange['exchange_fwd_bytes'] + exchange['exchange_bwd_bytes']:.0f}", flush=True)


PEERS = {
    "reference": "reference (nn.EmbeddingBag sparse + SGD, fp32)",
    "torchrec": "torchrec (DLRM, DistributedModelParallel, fused embedding optimizer, "
                "TrainPipelineSparseDist)",
}
# The last line's fields of each peer: samples/s, and ours over it.
PEER_FIELDS = {"reference": ("baseline_samples_per_s", "ratio"),
               "torchrec": ("torchrec_samples_per_s", "torchrec_ratio")}


def default_peers(cfg: Config) -> List[str]:
    """The reference, and torchrec's stack where its DLRM models the config."""
    return ["reference", "torchrec"] if torchrec_models(cfg.model) else ["reference"]


def _peer_run(name: str, cfg: Config, spec, env: DistEnv, batches: List,
              warmup: int) -> "_Timed":
    """A peer built and warmed up beside ours, on the same batches."""
    try:
        if name == "reference":
            step = reference_step(cfg.model, spec, cfg.optim.dense_lr, env.device)
            run = _Timed(step, [ReferenceBatch.of(b) for b in batches], env.device)
        else:
            run = _Timed(torchrec_peer_step(cfg, spec, env), batches, env.device)
        run.warm_up(warmup)
    except torch.OutOfMemoryError:
        raise UserError(f"bench: the {name} peer (every table its own, next to ours) does not "
                        f"fit on {env.device}; bench with --peers naming fewer, or none")
    return run


def _batches(dataset, batch: int, count: int, device: torch.device) -> Tuple[List, float]:
    """`count` training batches on `device`, and the ms each took to make: on a GPU the planted
    synthetic data makes them there (as the training loader does), other data on the host
    (copied after timing, as the loader's copy overlaps the step)."""
    on_device = makes_on_device(dataset, device)
    if on_device:  # its first batch starts CUDA's libraries: not the batches' cost
        dataset.batch("train", 0, batch, device)
    made = []
    start = time.perf_counter()
    for i in range(count):
        made.append(dataset.batch("train", i * batch, batch, device) if on_device
                    else dataset.batch("train", i * batch, batch))
    synchronize(device)
    data_ms = (time.perf_counter() - start) / count * 1e3
    return [b.to(device) for b in made], data_ms


def _last_line(precision: Precision, ours: float, peers: Dict[str, float],
               roofline_fraction: float, peak_gib: float, cpu: str) -> str:
    """`bench: key=value ...`, one token per value, for scripts (benchmarks/bench_table.py):
    `precision` is what ran, `requested` only where that differs, `cpu` the capability with
    its spaces turned into dashes (`AVX2,bf16-emulated,fp16-emulated`)."""
    requested = f" requested={precision.requested}" if precision.requested != precision.name else ""
    cpu = re.sub(r",\s*", ",", cpu).replace(" ", "-")
    compared = "".join(f" {PEER_FIELDS[name][0]}={rate:.0f} {PEER_FIELDS[name][1]}={ours / rate:.2f}"
                       for name, rate in peers.items())
    return (f"bench: precision={precision.name}{requested} samples_per_s={ours:.0f}{compared} "
            f"roofline_fraction={roofline_fraction:.2f} peak_mem_gib={peak_gib:.2f} "
            f"cpu={cpu}")


class _Timed:
    """A step function over cycled batches, timing only the steps asked to be timed."""

    def __init__(self, step: Callable, batches: List, device: torch.device) -> None:
        self.step, self.batches, self.device = step, itertools.cycle(batches), device
        self.steps, self.seconds = 0, 0.0

    def one_step(self) -> torch.Tensor:
        return self.step(self.batches)

    def warm_up(self, n: int) -> None:
        for _ in range(n):
            self.one_step()
        synchronize(self.device)

    def timed(self, n: int) -> None:
        start = time.perf_counter()
        for _ in range(n):
            loss = self.one_step()
        loss.item()
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.steps += n

    def samples_per_s(self, batch: int) -> float:
        return self.steps * batch / self.seconds


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # peak RSS, KiB


def _unlike(peer: str, interaction: str) -> str:
    """The reference is the original DLRM's `dot` model: another interaction of ours is another
    model, whose cost the ratio includes."""
    if peer != "reference" or interaction == "dot":
        return ""
    return f" (its interaction dot, ours {interaction}: the ratio includes that model's cost)"


def _report(cfg: Config, device: torch.device, steps: int, precision: Precision, cpu: str,
            ours: float, peers: Dict[str, float], data: Tuple[float, str], split: dict,
            roof: Roofline, peaks: Peaks, peak_gib: float) -> str:
    B = cfg.data.global_batch_size
    memory = "peak allocated" if device.type == "cuda" else "process peak RSS"
    step_ms = sum(split.values())
    parts = " | ".join(f"{p} {split[p]:.1f} ({split[p] / step_ms:.0%})" for p in PARTS)
    ran = precision.name if precision.requested == precision.name else \
        f"{precision.name}, {precision.requested} requested"
    matmul = f"{peaks.matmul_size}x{peaks.matmul_size} {str(peaks.dtype).removeprefix('torch.')}"
    return "\n".join([
        f"bench on {device.type}, batch {B}, {steps} timed steps after warm-up, "
        f"{torch.get_num_threads()} threads; cpu: {cpu}",
        f"  dlrm_hybrid ({ran}): {ours:,.0f} samples/s, {B / ours * 1e3:.1f} ms/step",
        *[f"  {PEERS[name]}: {rate:,.0f} samples/s, {B / rate * 1e3:.1f} ms/step; ours "
          f"{ours / rate:.2f}x" + _unlike(name, cfg.model.interaction)
          for name, rate in peers.items()],
        f"  step split, ms/step (profiled over {SPLIT_STEPS} steps): {parts}; "
        f"data (loader, outside the step) {data[0]:.1f}, made on {data[1]}",
        f"  roofline: embeddings {roof.embedding_bytes / 1024:.1f} KiB/sample at "
        f"{roof.bandwidth / 1e9:.1f} GB/s (measured copy), dense "
        f"{roof.dense_flops / 1e6:.2f} MFLOP/sample at {roof.flops_per_s / 1e9:.0f} GFLOP/s "
        f"(measured {matmul} matmul): bound {roof.samples_per_s:,.0f} samples/s "
        f"({roof.bound_by}); achieved {ours / roof.samples_per_s:.2f} of it",
        f"  memory: {memory} {peak_gib:.2f} GiB",
    ])
