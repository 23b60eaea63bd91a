"""Dense memory and step time of a DHEN of over 100M dense parameters under ddp, fsdp and hsdp
(2 x 2) on 4 gloo ranks (CPU), each with and without activation checkpointing.

    .venv/bin/python benchmarks/dense_sharding.py [--ranks 4] [--steps 5] [--warmup 2]
        [--dim 128] [--width 96] [--layers 3] [--batch 64]

Each run is one torchrun launch of this script (`--worker`) through the training job's own
build path (train/loop.py build_sharded_model, train/optim.py build_optimizer, train/step.py
TrainStep) with `parallel.dense` set. Per rank it counts, from the tensors it holds (a DTensor's
local shard), the dense parameters, their gradients and the dense optimizer's state (Adagrad's
sum and step), after the last step; next to them the planner's prediction
(parallel/dense_memory.py; the same three, and the transient all-gather it adds for fsdp and
hsdp); the peak RSS (VmHWM: ru_maxrss would report the forking parent's); and the median step
time of rank 0 over `--steps` steps after `--warmup`, each started at a barrier. A mode whose
launch fails is reported with its error line, the others still run.

Last line, for scripts: `dense_sharding: params=N ddp_bytes=.. fsdp_bytes=.. hsdp_bytes=..
ddp_ms=.. fsdp_ms=.. hsdp_ms=..` (counted bytes per rank, the largest rank's; step ms without
checkpointing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("ddp", "fsdp", "hsdp")
DENSE_MODULES = ("dense_arch", "interaction", "over_arch")


def overrides(args, mode: str, checkpointing: bool) -> list:
    """26 tables of 100 rows (the tables are not what is measured), 13 dense features; a DHEN of
    all five modules on a list of `width` vectors of `dim`."""
    shard = [f"parallel.hsdp_shard_size={args.ranks // 2}"] if mode == "hsdp" else []
    return [f"model.embedding_dim={args.dim}", f"model.bottom_mlp=[256,{args.dim}]",
            "model.top_mlp=[512,1]", "model.interaction=dhen", f"model.dhen.layers={args.layers}",
            "model.dhen.modules=[dot,self_attention,linear,dcn,conv]",
            f"model.dhen.width={args.width}", "model.dhen.heads=4",
            f"model.dhen.activation_checkpointing={str(checkpointing).lower()}",
            "data.num_dense=13", f"data.cardinalities={[100] * 26}", "data.hotness=[1]",
            f"data.global_batch_size={args.batch}",
            f"data.train_samples={args.batch * (args.steps + args.warmup + 1)}",
            "data.val_samples=1024", "optim.dense=adagrad", "optim.embedding=sgd",
            "parallel.replicate=false", f"parallel.dense={mode}", *shard,
            "parallel.reserve_per_rank=8GiB", "parallel.memory_per_rank=16GiB",
            "train.run_dir=/tmp/dense_sharding_unused"]


def local_bytes(tensor) -> int:
    """A DTensor's local shard, or the tensor itself."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return tensor.numel() * tensor.element_size()


def held(dmp, optimizer) -> dict:
    """Dense parameter, gradient and optimizer-state bytes on this rank, from the tensors."""
    import torch

    dense = [p for name, p in dmp.module.named_parameters()
             if name.split(".")[0] in DENSE_MODULES]
    state = optimizer.state
    return {"parameters": sum(local_bytes(p) for p in dense),
            "gradients": sum(local_bytes(p.grad) for p in dense if p.grad is not None),
            "optimizer": sum(local_bytes(v) for p in dense for v in state.get(p, {}).values()
                             if isinstance(v, torch.Tensor)),
            "count": sum(p.numel() for p in dense)}


def peak_rss() -> int:
    """VmHWM of this process, bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def worker(args) -> None:
    import torch.distributed as dist

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import make_loader, open_dataset
    from dlrm_hybrid.parallel.dense_memory import all_modes
    from dlrm_hybrid.parallel.process_group import init_distributed, shutdown
    from dlrm_hybrid.train.loop import build_sharded_model
    from dlrm_hybrid.train.optim import build_optimizer
    from dlrm_hybrid.train.step import TrainStep

    env = init_distributed("gloo")
    cfg = load_config(None, overrides(args, args.mode, args.checkpointing), env.world_size)
    dataset = open_dataset(cfg.data)
    dmp, _ = build_sharded_model(cfg, dataset.spec, env, lambda line: None)
    optimizer, schedule = build_optimizer(dmp, cfg.optim)
    step = TrainStep(dmp, optimizer, schedule, cfg.train, env.device)
    batches = make_loader(cfg.data, dataset, "train", env, cfg.train.seed,
                          on_device=step.pipeline is None)
    seconds = []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        step(batches).item()
        seconds.append(time.perf_counter() - start)
    batches.close()
    mine = {**held(dmp, optimizer), "rss": peak_rss()}
    ranks = [None] * env.world_size
    dist.all_gather_object(ranks, mine)
    if env.is_main:
        predicted = all_modes(cfg, dataset.spec, env.world_size, env.local_world_size)[args.mode]
        print("RESULT " + json.dumps({
            "ranks": ranks, "step_ms": 1e3 * statistics.median(seconds[args.warmup:]),
            "predicted": {"parameters": predicted.parameters, "gradients": predicted.gradients,
                          "optimizer": predicted.optimizer, "transient": predicted.transient,
                          "largest": predicted.largest, "shards": predicted.shards}}))
    shutdown()


def launch(args, mode: str, checkpointing: bool) -> dict:
    """One torchrun launch of the worker; its result, or {"error": its last error line}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.ranks}", __file__, "--worker", "--mode", mode,
           *(["--checkpointing"] if checkpointing else []),
           *[a for k in ("steps", "warmup", "dim", "width", "layers", "batch", "ranks")
             for a in (f"--{k}", str(getattr(args, k)))]]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                            env={**env, "OMP_NUM_THREADS": "1"})
    found = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode or not found:
        errors = [line for line in result.stderr.splitlines() if "Error" in line or "error" in line]
        return {"error": (errors or result.stderr.splitlines() or ["no output"])[-1][:200]}
    return json.loads(found[0][len("RESULT "):])


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"dense_sharding: {cpu_name()}; {args.ranks} gloo ranks, OMP_NUM_THREADS=1")
    print(f"model: DHEN {args.layers} layers of [dot, self_attention, linear, dcn, conv], concat, "
          f"width {args.width}, d {args.dim}, 4 heads; bottom MLP [256, {args.dim}], top MLP "
          f"[512, 1]; 13 dense, 26 tables of 100 rows; dense Adagrad; global batch {args.batch}; "
          f"hsdp: 2 replicas x {args.ranks // 2} shards")
    print("per rank, MiB: parameters, gradients, optimizer state counted from the tensors (the "
          "largest rank), their sum, the planner's prediction of it and the ratio; transient: "
          "the planner's all-gather of the largest unit; RSS peak: lowest-highest rank")
    head = (f"{'mode':<5} {'ckpt':<4} {'params':>9} {'grads':>9} {'optim':>9} {'counted':>9} "
            f"{'predicted':>9} {'ratio':>7} {'transient':>9} {'RSS peak':>17} {'step ms':>9}")
    print(head)
    summary, params = {}, 0
    for mode in MODES:
        for checkpointing in (False, True):
            r = launch(args, mode, checkpointing)
            ckpt = "on" if checkpointing else "off"
            if "error" in r:
                print(f"{mode:<5} {ckpt:<4} failed: {r['error']}")
                continue
            top = max(r["ranks"], key=lambda x: x["parameters"] + x["gradients"] + x["optimizer"])
            counted = top["parameters"] + top["gradients"] + top["optimizer"]
            p = r["predicted"]
            predicted = p["parameters"] + p["gradients"] + p["optimizer"]
            rss = [x["rss"] for x in r["ranks"]]
            params = r["ranks"][0]["count"]
            print(f"{mode:<5} {ckpt:<4} {mib(top['parameters']):>9} {mib(top['gradients']):>9} "
                  f"{mib(top['optimizer']):>9} {mib(counted):>9} "
                  f"{mib(predicted):>9} {counted / predicted:>7.4f} {mib(p['transient']):>9} {mib(min(rss)) + '-' + mib(max(rss)):>17} "
                  f"{r['step_ms']:>9.0f}")
            if not checkpointing:
                summary[mode] = (counted, r["step_ms"])
    fields = " ".join(f"{m}_bytes={summary[m][0] if m in summary else 'failed'}" for m in MODES)
    times = " ".join(f"{m}_ms={summary[m][1]:.0f}" if m in summary else f"{m}_ms=failed"
                     for m in MODES)
    print(f"dense_sharding: params={params} {fields} {times}")


if __name__ == "__main__":
    main()
