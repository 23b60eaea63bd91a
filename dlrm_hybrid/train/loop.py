"""The training loop: place, shard, then step; evaluate every `eval_every` steps and at the end."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from tqdm import tqdm

from dlrm_hybrid.config import Config
from dlrm_hybrid.data.source import make_loader, open_dataset, require_samples
from dlrm_hybrid.model.dlrm import build_model
from dlrm_hybrid.parallel.exchange_bytes import choose_exchange
from dlrm_hybrid.parallel.job_plan import job_plan
from dlrm_hybrid.parallel.plan_report import describe, describe_lookups
from dlrm_hybrid.parallel.process_group import DistEnv
from dlrm_hybrid.parallel.sharding import applied_sharding, init_tables, shard_model
from dlrm_hybrid.parallel.tables import table_specs
from dlrm_hybrid.train.evaluate import evaluate
from dlrm_hybrid.train.checkpoint import (check_same_experiment, checkpoint_root,
                                          checkpoint_to_resume, load_checkpoint, save_checkpoint)
from dlrm_hybrid.train.divergence import DivergenceGuard
from dlrm_hybrid.train.metrics_log import MetricsLog, done_line, metrics_text
from dlrm_hybrid.train.optim import advance_schedule, attach_embedding_optimizer, build_optimizer
from dlrm_hybrid.train.step import TrainStep


@dataclass
class TrainResult:
    steps: int
    losses: List[float]  # global-batch mean loss at each logged step
    metrics: Dict[str, float]  # final validation metrics (rank 0 only; empty elsewhere)
    samples_per_s: float


def train(cfg: Config, env: DistEnv) -> TrainResult:
    log = MetricsLog(Path(cfg.train.run_dir), env.rank, cfg.train.rank_logs)
    dataset = open_dataset(cfg.data)
    require_samples(dataset, ("train", "val"), "training")
    dmp, plan = build_sharded_model(cfg, dataset.spec, env, log.say)
    optimizer, schedule = build_optimizer(dmp, cfg.optim)
    train_step = TrainStep(dmp, optimizer, schedule, cfg.train, env.device)
    first = resume(cfg, train_step, log)
    B, steps = cfg.data.global_batch_size, cfg.train.max_steps
    if first >= steps:
        log.say(f"nothing left to train: the checkpoint is at step {first} and train.max_steps "
                f"is {steps}; raise train.max_steps to train further, or start anew with "
                f"checkpoint.resume=none or another train.run_dir")
        log.close()
        return TrainResult(first, [], {}, 0.0)
    log.begin(cfg, plan, applied_sharding(dmp), resumed=first > 0)
    guard = DivergenceGuard(checkpoint_root(cfg), env.device, first)

    batches = make_loader(cfg.data, dataset, "train", env, cfg.train.seed, start_step=first,
                          on_device=train_step.pipeline is None)  # else the pipeline copies
    losses, train_time = [], 0.0
    loss_sum, window = torch.zeros((), device=env.device), 0  # since the last loss event
    for step in tqdm(range(first + 1, steps + 1), initial=first, total=steps, desc="train",
                     unit="step", disable=not (env.is_main and cfg.train.progress_bar)):
        start = time.perf_counter()
        loss = train_step(batches)
        guard.observe(loss)
        loss_sum += loss
        window += 1
        train_time += time.perf_counter() - start
        if step % cfg.train.log_every == 0 or step == steps:
            log.record_rank({"step": step, "local_loss": loss_sum.item() / window,
                             "train_seconds": train_time, **dmp.module.exchange_counter.take(window)})
            losses.append(global_mean(loss_sum, env) / window)
            guard.check_loss(losses[-1], step)
            log.record({"step": step, "loss": losses[-1], "lr": schedule.get_last_lr()[-1],
                        **train_step.precision.log_fields()})
            loss_sum.zero_()
            window = 0
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != steps:
            guard.check_state(dmp, step)
            save_checkpoint(checkpoint_root(cfg), step, dmp, optimizer, env, cfg,
                            train_step.state_dict())
        if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step != steps:
            train_step.pause()
            evaluate_and_log(dmp, dataset, cfg, env, log, step)

    batches.close()
    train_step.pause()
    guard.check_state(dmp, steps)
    path = save_checkpoint(checkpoint_root(cfg), steps, dmp, optimizer, env, cfg,
                           train_step.state_dict())
    log.say(f"checkpoint: {path}")
    metrics = evaluate_and_log(dmp, dataset, cfg, env, log, steps)
    samples_per_s = (steps - first) * B / train_time if train_time else 0.0
    if env.is_main:
        log.say(done_line(steps, losses[-1], metrics, samples_per_s))
    log.close()
    return TrainResult(steps, losses, metrics, samples_per_s)


def resume(cfg: Config, train_step: TrainStep, log: MetricsLog) -> int:
    """The step to continue after: that of the checkpoint `checkpoint.resume` names (if it
    was trained with these settings), or 0."""
    path = checkpoint_to_resume(cfg)
    if path is None:
        return 0
    check_same_experiment(path, cfg)
    meta = load_checkpoint(path, train_step.dmp, train_step.optimizer)
    step = int(meta["step"])
    train_step.load_state_dict(meta)
    advance_schedule(train_step.schedule, step)
    log.say(f"resumed from {path} (step {step})")
    return step


def build_sharded_model(cfg: Config, spec, env: DistEnv, say: Callable[[str], None]):
    """The DLRM with its tables placed, sharded and initialised, the MLPs wrapped in DDP."""
    torch.manual_seed(cfg.train.seed)  # the dense layers: identical on every rank
    model = build_model(cfg.model, spec)
    attach_embedding_optimizer(model.embedding_bags, cfg.optim, env.device)
    plan = job_plan(cfg, table_specs(cfg, spec), env)
    say(describe(plan))
    replaced = describe_lookups(model.lookups, cfg)
    if replaced:
        say(replaced)
    exchange, why = choose_exchange(cfg, plan)
    say(f"embedding exchange: {exchange} ({why})")
    dmp = shard_model(model, plan, env.device, env.local_world_size, cfg.parallel.comm_precision,
                      exchange)
    init_tables(dmp, [part for lookup in model.lookups for part in lookup.tables], cfg.train.seed)
    return dmp, plan


def evaluate_and_log(dmp, dataset, cfg: Config, env: DistEnv, log: MetricsLog,
                     step: int) -> Dict[str, float]:
    batches = make_loader(cfg.data, dataset, "val", env)
    metrics = evaluate(dmp, batches, env)
    batches.close()
    if metrics is None:
        return {}
    log.record({"step": step, **metrics})
    log.say(f"eval step {step}: {metrics_text(metrics)}")
    return metrics


def global_mean(local_value: torch.Tensor, env: DistEnv) -> float:
    total = local_value.detach().clone()
    dist.all_reduce(total)
    return total.item() / env.world_size
