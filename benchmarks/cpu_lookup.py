"""The CPU embedding lookup and its fused SGD update alone, per training step, four ways:

    .venv/bin/python benchmarks/cpu_lookup.py [--config configs/bench_cpu.yaml] [--steps 48]

fbgemm's table batch as torchrec builds it, on 4 KiB and on huge pages; and with the lookup and
update of parallel/cpu_lookup.py (csrc/cpu_lookup.c), on 4 KiB and on huge pages (what training
uses). The four alternate step by step on the config's tables and batches, with 240 MB of other
memory traffic between the lookup and the update, as the dense part of a step has. Prints ms per
step of the lookup and of the update.
"""

from __future__ import annotations

import argparse
import time

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as OptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.source import open_dataset
from dlrm_hybrid.parallel import cpu_lookup
from dlrm_hybrid.parallel.host_memory import keep_freed_memory, use_huge_pages


def table_batch(cfg, c_sgd: bool, huge_pages: bool) -> SplitTableBatchedEmbeddingBagsCodegen:
    specs = [(rows, cfg.model.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
             for rows in cfg.data.cardinalities]
    tbe = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=OptimType.EXACT_SGD,
                                                learning_rate=cfg.optim.embedding_lr)
    tbe.init_embedding_weights_uniform(-0.01, 0.01)
    if c_sgd:
        tbe.__class__ = cpu_lookup.CpuSgdTBE
    if huge_pages:
        use_huge_pages(tbe.weights_host)
    return tbe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/bench_cpu.yaml")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    keep_freed_memory()
    cfg = load_config(args.config)
    dataset, batch = open_dataset(cfg.data), cfg.data.global_batch_size
    batches = [dataset.batch("train", i * batch, batch).sparse for i in range(16)]
    ways = {"fbgemm": table_batch(cfg, False, False),
            "fbgemm, huge pages": table_batch(cfg, False, True),
            "csrc/cpu_lookup.c": table_batch(cfg, True, False),
            "csrc/cpu_lookup.c, huge pages": table_batch(cfg, True, True)}
    other = torch.ones(60_000_000)
    grad = torch.full((batch, ways["fbgemm"].total_D), 1e-4)
    totals = {name: [0.0, 0.0] for name in ways}
    for step in range(args.steps):
        ids = batches[step % len(batches)]
        for name, tbe in ways.items():
            start = time.perf_counter()
            pooled = tbe(ids.values(), ids.offsets())
            looked_up = time.perf_counter()
            other.mul_(1.0)
            start_update = time.perf_counter()
            pooled.backward(grad)
            totals[name][0] += looked_up - start
            totals[name][1] += time.perf_counter() - start_update
    print(f"{len(cfg.data.cardinalities)} tables, batch {batch}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps; ms per step")
    print("| way | lookup | SGD update |\n|---|---:|---:|")
    for name, (lookup, update) in totals.items():
        print(f"| {name} | {lookup / args.steps * 1e3:.1f} | {update / args.steps * 1e3:.1f} |")


if __name__ == "__main__":
    main()
