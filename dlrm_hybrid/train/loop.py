"""The training loop: place, shard, then step; evaluate every `eval_every` steps and at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.nn.functional import binary_cross_entropy_with_logits
from tqdm import tqdm

from dlrm_hybrid.config import Config, parse_bytes
from dlrm_hybrid.data.slices import train_batches
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.model.dlrm import build_model
from dlrm_hybrid.parallel.placement import TableSpec, place_tables
from dlrm_hybrid.parallel.process_group import DistEnv
from dlrm_hybrid.parallel.sharding import init_tables, shard_model
from dlrm_hybrid.train.evaluate import evaluate
from dlrm_hybrid.train.metrics_log import MetricsLog, done_line
from dlrm_hybrid.train.optim import attach_embedding_optimizer, build_optimizer

CPU_DEFAULT_BUDGET = 8 * 2**30


@dataclass
class TrainResult:
    steps: int
    losses: List[float]  # global-batch mean loss at each logged step
    metrics: Dict[str, float]  # final validation metrics (rank 0 only; empty elsewhere)
    samples_per_s: float


def train(cfg: Config, env: DistEnv) -> TrainResult:
    log = MetricsLog(Path(cfg.train.run_dir), env.is_main)
    dataset = SyntheticClicks(cfg.data)
    dmp = build_sharded_model(cfg, dataset.spec, env, log)
    optimizer, schedule = build_optimizer(dmp, cfg.optim)
    log.begin(cfg)

    B, steps = cfg.data.global_batch_size, cfg.train.max_steps
    batches = train_batches(dataset, B, env.rank, env.world_size)
    losses, train_time = [], 0.0
    loss_sum, window = torch.zeros((), device=env.device), 0  # since the last loss event
    for step in tqdm(range(1, steps + 1), disable=not (env.is_main and cfg.train.progress_bar),
                     desc="train", unit="step"):
        start = time.perf_counter()
        batch = next(batches).to(env.device, non_blocking=True)
        optimizer.zero_grad()  # also hands the scheduled LR to the fused embedding optimizer
        loss = binary_cross_entropy_with_logits(dmp(batch.dense, batch.sparse), batch.labels)
        loss.backward()  # the embedding update happens here, fused into the backward
        optimizer.step()
        schedule.step()
        loss_sum += loss.detach()
        window += 1
        if step % cfg.train.log_every == 0 or step == steps:
            losses.append(global_mean(loss_sum, env) / window)
            log.record({"step": step, "loss": losses[-1], "lr": schedule.get_last_lr()[-1]})
            loss_sum.zero_()
            window = 0
        train_time += time.perf_counter() - start
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != steps:
            evaluate_and_log(dmp, dataset, cfg, env, log, step)

    metrics = evaluate_and_log(dmp, dataset, cfg, env, log, steps)
    samples_per_s = steps * B / train_time
    if env.is_main:
        log.say(done_line(steps, losses[-1], metrics, samples_per_s))
    log.close()
    return TrainResult(steps, losses, metrics, samples_per_s)


def build_sharded_model(cfg: Config, spec, env: DistEnv, log: MetricsLog):
    """The DLRM with its tables placed, sharded and initialised, the MLPs wrapped in DDP."""
    torch.manual_seed(cfg.train.seed)  # the dense layers: identical on every rank
    model = build_model(cfg.model, spec)
    tables = model.embedding_bags.embedding_bag_configs()
    attach_embedding_optimizer(model.embedding_bags, cfg.optim, env.device)
    specs = [TableSpec.of(t, cfg.model.embedding_precision, cfg.optim.embedding) for t in tables]
    placement = place_tables(specs, env.world_size, memory_budget(cfg, env))
    log.say(placement.describe())
    dmp = shard_model(model, placement, env.device, env.local_world_size)
    init_tables(dmp, tables, cfg.train.seed)
    return dmp


def evaluate_and_log(dmp, dataset, cfg: Config, env: DistEnv, log: MetricsLog,
                     step: int) -> Dict[str, float]:
    metrics = evaluate(dmp, dataset, "val", cfg.data.global_batch_size, env)
    if metrics is None:
        return {}
    log.record({"step": step, **metrics})
    log.say(f"eval step {step}: " + " ".join(f"{k}={v:.5f}" for k, v in metrics.items()))
    return metrics


def global_mean(local_value: torch.Tensor, env: DistEnv) -> float:
    total = local_value.detach().clone()
    dist.all_reduce(total)
    return total.item() / env.world_size


def memory_budget(cfg: Config, env: DistEnv) -> int:
    """Embedding bytes each rank may hold: the config's, or 85% of the device (the rest for MLPs
    and activations), or 8 GiB on CPU; the smallest over all ranks, so every rank plans alike."""
    budget = parse_bytes(cfg.parallel.memory_per_rank, "parallel.memory_per_rank", allow_auto=True)
    if budget is None and env.device.type == "cuda":
        budget = int(0.85 * torch.cuda.get_device_properties(env.device).total_memory)
    smallest = torch.tensor([budget or CPU_DEFAULT_BUDGET], dtype=torch.int64, device=env.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return int(smallest.item())
