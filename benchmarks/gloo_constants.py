"""The cost model's "cpu_gloo" constants, measured on this machine with 2 gloo ranks (one thread
each, as the CPU tests train):

    .venv/bin/python benchmarks/gloo_constants.py [--world 2] [--repeat 20]

- all-to-all: `all_to_all_single` over 4 KiB .. 32 MiB per rank; time = a + bytes/bw fitted by
  least squares of the relative error, bytes = what a rank sends to the others: bw is the
  all-to-all bandwidth (one host: intra = inter), a / (P - 1) the fixed cost per message (a
  call sends one to each other rank);
- all-reduce: `all_reduce` over the same sizes, the same fit (bytes = 2(P-1)/P of the
  tensor's, a ring's, as the cost model charges them: a check on the all-to-all's bandwidth);
- embedding memory bandwidth: fbgemm's CPU table batch, forward + backward with its fused
  optimizer (`--optimizer`, row-wise Adagrad by default as configs/demo.yaml), on huge pages as
  training has it (parallel/cpu_lookup.py), on both ranks at once (they share the memory in
  training), bytes counted as the planner counts them (`TableSpec.shard_lookup_bytes`);
- per-shard fixed cost: one table batch of k small tables against one, the slope over k of
  its forward + backward time, less the bytes' share.

Prints each fit, the CPU, and the `DEVICES` entry to paste into dlrm_hybrid/parallel/cost_model.py.
Takes ~20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlrm_hybrid.parallel.cpu_lookup import speed_up_cpu_tables
from dlrm_hybrid.parallel.tables import TableSpec

SIZES = [2**k for k in range(12, 26)]  # bytes per rank: 4 KiB .. 32 MiB
SHARD_COUNTS = [1, 2, 4, 8, 16, 32, 64]
OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad")


def fit_line(x: List[float], seconds: List[float]) -> Tuple[float, float]:
    """(a, bandwidth) of seconds = a + x / bandwidth, least squares of the relative error (the
    small sizes, which decide a, count as much as the large ones)."""
    seconds = np.asarray(seconds, float)
    slope, intercept = np.polyfit(np.asarray(x, float), seconds, 1, w=1 / seconds)
    return float(intercept), float(1.0 / slope)


def timed(call: Callable[[], object], repeat: int) -> float:
    """Median seconds of `call` over `repeat` runs, after a quarter as many warm-ups (gloo's
    first calls set up its pairs), the slowest rank's."""
    for _ in range(max(2, repeat // 4)):
        call()
    times = []
    for _ in range(repeat):
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    median = torch.tensor([statistics.median(times)])
    if dist.is_initialized():
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median)


def collectives(world: int, repeat: int) -> Dict[str, list]:
    """Seconds per all_to_all_single and all_reduce at each size."""
    out = {"a2a": [], "allreduce": []}
    for size in SIZES:
        send = torch.ones(size // 4)
        received = torch.empty_like(send)
        out["a2a"].append(timed(lambda: dist.all_to_all_single(received, send), repeat))
        out["allreduce"].append(timed(lambda: dist.all_reduce(send), repeat))
    return out


def table_batch(tables: List[TableSpec]):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

    kinds = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
             "adagrad": EmbOptimType.EXACT_ADAGRAD}
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.rows, t.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        optimizer=kinds[tables[0].optimizer], learning_rate=0.01)
    tbe.init_embedding_weights_uniform(-0.01, 0.01)
    speed_up_cpu_tables(tbe)  # as training has it: huge pages, the C path for SGD
    return tbe


def lookup_seconds(tables: List[TableSpec], batch: int, repeat: int) -> float:
    """Forward + backward (the fused update) of one table batch of `tables`, each looked up
    `hotness` uniform random ids per sample."""
    tbe = table_batch(tables)
    gen = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    hot = int(tables[0].hotness)
    ids = torch.cat([torch.randint(t.rows, (batch * hot,), generator=gen) for t in tables])
    offsets = torch.arange(0, len(tables) * batch * hot + 1, hot)
    grad = torch.full((batch, sum(t.dim for t in tables)), 1e-4)
    return timed(lambda: tbe(ids, offsets).backward(grad), repeat)


def lookups(optimizer: str, repeat: int) -> Dict[str, object]:
    """Memory bandwidth of one large table, and seconds per step of k small tables."""
    large, batch = TableSpec("large", 2_000_000, 64, "fp32", optimizer, 8.0), 4096
    large_s = lookup_seconds([large], batch, repeat)
    small, small_batch = TableSpec("small", 1000, 16, "fp32", optimizer, 1.0), 256
    per_k = [lookup_seconds([TableSpec(f"s{i}", small.rows, small.dim, "fp32", optimizer, 1.0)
                             for i in range(k)], small_batch, repeat) for k in SHARD_COUNTS]
    return {"bandwidth": large.shard_lookup_bytes(large.dim, batch) / large_s,
            "large_ms": large_s * 1e3, "per_k": per_k,
            "small_bytes": small.shard_lookup_bytes(small.dim, small_batch)}


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"collectives": collectives(world, args.repeat),
                  "lookups": lookups(args.optimizer, args.repeat)}
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.processor() or "unknown CPU"


def report(result: dict, world: int, optimizer: str) -> None:
    sent = [size * (world - 1) / world for size in SIZES]  # to the other ranks
    a2a_fixed, a2a_bw = fit_line(sent, result["collectives"]["a2a"])
    ring = [2 * (world - 1) / world * size for size in SIZES]  # what the model charges
    ar_fixed, ar_bw = fit_line(ring, result["collectives"]["allreduce"])
    looked = result["lookups"]
    per_table, _ = np.polyfit(SHARD_COUNTS, looked["per_k"], 1)
    shard_fixed = float(per_table) - looked["small_bytes"] / looked["bandwidth"]
    print(f"{cpu_name()}; {world} gloo ranks, 1 thread each; torch {torch.__version__}")
    print("\n| bytes per rank | all_to_all_single ms | all_reduce ms |\n|---:|---:|---:|")
    for size, a2a, ar in zip(SIZES, result["collectives"]["a2a"],
                             result["collectives"]["allreduce"]):
        print(f"| {size:,} | {a2a * 1e3:.3f} | {ar * 1e3:.3f} |")
    print("\n| tables in one batch | forward + backward ms |\n|---:|---:|")
    for k, seconds in zip(SHARD_COUNTS, looked["per_k"]):
        print(f"| {k} | {seconds * 1e3:.3f} |")
    message = a2a_fixed / (world - 1)  # a call sends one message to each other rank
    print(f"\nall-to-all: {a2a_bw / 1e9:.3f} GB/s sent per rank, {a2a_fixed * 1e6:.1f} us per call "
          f"({message * 1e6:.1f} us per message)")
    print(f"all-reduce: {ar_bw / 1e9:.3f} GB/s per rank (ring: 2(P-1)/P of the tensor's bytes), "
          f"{ar_fixed * 1e6:.1f} us per call")
    print(f"embedding lookup + {optimizer} update: {looked['bandwidth'] / 1e9:.3f} GB/s per rank "
          f"(2,000,000 x 64 table, 4,096 x 8 ids: {looked['large_ms']:.1f} ms)")
    print(f"per shard: {shard_fixed * 1e6:.1f} us ({per_table * 1e6:.1f} us per table in a batch, "
          f"less its bytes)")
    print("\nfor dlrm_hybrid/parallel/cost_model.py DEVICES:")
    print(f'    "cpu_gloo": DeviceConstants(\n'
          f'        "cpu_gloo", {looked["bandwidth"]:.3g}, {a2a_bw:.3g}, {a2a_bw:.3g}, '
          f'{shard_fixed:.2g}, {message:.2g},\n'
          f'        "benchmarks/gloo_constants.py: {cpu_name()}, {world} gloo ranks of 1 thread, '
          f'torch {torch.__version__.split("+")[0]}"),')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per point (median)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="rowwise_adagrad")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(_worker, args=(args.world, free_port(), args, out), nprocs=args.world)
        result = json.loads(Path(out).read_text())
    report(result, args.world, args.optimizer)


if __name__ == "__main__":
    main()
