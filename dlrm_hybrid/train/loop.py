"""The training loop: place, shard, then step; evaluate on the run's schedule and at the end,
or stop at the first evaluation that reaches the target AUC, or after a checkpoint at the step
the ranks agree on when a signal (Ctrl-C, a scheduler's SIGTERM) asks them to stop."""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from dlrm_hybrid.config import Config, ConfigError
from dlrm_hybrid.data.configured_spec import data_spec
from dlrm_hybrid.data.criteo.day23 import require_reference_rule
from dlrm_hybrid.data.source import (make_loader, open_dataset, require_one_batch,
                                     require_samples)
from dlrm_hybrid.data.stream_windows import StreamWindows, stream_windows
from dlrm_hybrid.parallel.dense_memory import dense_layout, require_dense_fits
from dlrm_hybrid.parallel.exchange_bytes import choose_exchange
from dlrm_hybrid.parallel.job_plan import job_plan
from dlrm_hybrid.parallel.plan_report import describe, describe_lookups
from dlrm_hybrid.parallel.process_group import DistEnv
from dlrm_hybrid.parallel.sharding import applied_sharding, init_tables, shard_model
from dlrm_hybrid.parallel.tables import table_specs
from dlrm_hybrid.train.checkpoint import (checkpoint_root, checkpoint_to_resume,
                                          intact_checkpoint_to_resume, load_checkpoint,
                                          new_run_id, run_of, save_checkpoint)
from dlrm_hybrid.train.earlier_run import RunDirLock, set_aside_earlier_run
from dlrm_hybrid.train.resume_rules import check_same_experiment
from dlrm_hybrid.train.divergence import DivergenceGuard
from dlrm_hybrid.train.metrics_log import MetricsLog, done_line, metrics_text
from dlrm_hybrid.train.mlperf_dlrmv4 import check_history
from dlrm_hybrid.train.mlperf_log import MLPerfLog
from dlrm_hybrid.train.model_kinds import ModelKind, model_kind
from dlrm_hybrid.train.optim import (advance_schedule, attach_embedding_optimizer, build_optimizer,
                                     current_lrs)
from dlrm_hybrid.train.progress import Progress
from dlrm_hybrid.train.run_schedule import RunSchedule, run_schedule
from dlrm_hybrid.train.step import TrainStep
from dlrm_hybrid.train.stop_request import RunStopped, StopRequest, resume_hint


@dataclass
class TrainResult:
    steps: int
    losses: List[float]  # global-batch mean loss at each logged step
    metrics: Dict[str, float]  # final validation metrics (rank 0 only; empty elsewhere)
    samples_per_s: float


def train(cfg: Config, env: DistEnv) -> TrainResult:
    """Raises `RunStopped` after the checkpoint of a run stopped by SIGINT/SIGTERM."""
    if cfg.train.mlperf_log and cfg.data.path:
        require_reference_rule(cfg.data.path)  # MLPerf evaluates on day 23's first half
        check_history(cfg, data_spec(cfg.data, cfg.model).feature_names, cfg.data.path)
    with StopRequest(cfg.train.stop_grace_s, env.is_main, cfg.checkpoint.resume,
                     bool(cfg.train.mlperf_log)) as stop, \
            RunDirLock() as lock:
        mlperf = MLPerfLog.open(cfg, env.rank, resuming=checkpoint_to_resume(cfg) is not None)
        mlperf.init_start()
        try:
            return _train(cfg, env, mlperf, stop, lock)
        finally:
            mlperf.abort()  # a run that raised: run_stop aborted (nothing after a run_stop)


def _train(cfg: Config, env: DistEnv, mlperf: MLPerfLog, stop: StopRequest, lock: RunDirLock
           ) -> TrainResult:
    log = MetricsLog(Path(cfg.train.run_dir), env.rank, cfg.train.rank_logs)
    dataset = open_dataset(cfg.data, cfg.model, cfg.retrieval)
    require_samples(dataset, ("train", "val"), "training")
    require_one_batch(dataset, cfg.data.global_batch_size, env.world_size)
    run = run_schedule(cfg, dataset.num_samples("train"))
    B = cfg.data.global_batch_size
    stream = stream_windows(dataset, cfg.data.stream_window_s, B) if cfg.data.stream_window_s else None
    kind = model_kind(cfg)
    dmp, plan = build_sharded_model(cfg, dataset.spec, env, log.say)
    optimizer, schedule = build_optimizer(dmp, cfg.optim)
    train_step = TrainStep(dmp, optimizer, schedule, cfg.train, env.device)
    if plan.replicated and train_step.precision.scaler is not None:
        # The loss scaler would unscale their gradient twice: the tables' backward gets it unscaled.
        raise ConfigError(f"train.precision: fp16 does not train replicated tables (the plan "
                          f"replicates {', '.join(sorted(plan.replicated))}); use bf16 or fp32")
    lock.take(cfg)
    first, run_id = resume(cfg, train_step, log, stream)
    steps = run.steps
    state = lambda step: {**train_step.state_dict(),  # noqa: E731 (a checkpoint's meta)
                          **({"stream": stream.record(step)} if stream else {})}
    if first >= steps:
        log.say(f"nothing left to train: the checkpoint is at step {first} and train.max_steps "
                f"is {steps}; raise train.max_steps to train further, or start anew with "
                f"checkpoint.resume=none or another train.run_dir")
        log.close()
        return TrainResult(first, [], {}, 0.0)
    log.begin(cfg, plan, applied_sharding(dmp), resumed=first)
    if stream is not None:
        log.say(stream.describe(cfg.data.stream_window_s, cfg.data.stream_eval, first, steps))
    guard = DivergenceGuard(checkpoint_root(cfg), env.device, first)
    mlperf.run_start(cfg, env, dataset.num_samples("train"), dataset.num_samples("val"),
                     train_step.precision.name, dataset.spec)
    target = TargetWatch(cfg.train.target_auc)

    batches = make_loader(cfg.data, dataset, "train", env, cfg.train.seed, start_step=first,
                          on_device=train_step.pipeline is None)  # else the pipeline copies
    log.record({"step": first, "loader": batches.name, "step_driver": train_step.driver,
                "precision": train_step.precision.name,
                "cuda_graphs": train_step.graph is not None, "threads": torch.get_num_threads(),
                "dense": cfg.parallel.dense, "dense_replicas_shards": dense_layout(
                    cfg.parallel.dense, cfg.parallel.hsdp_shard_size, env.world_size,
                    env.local_world_size)})
    progress = Progress(first, steps, cfg.train.progress_bar, env.is_main)
    losses, train_time, logged_time = [], 0.0, 0.0  # training seconds, in all and at the last log
    loss_sum, window = torch.zeros((), device=env.device), 0  # since the last loss event
    step = stop.step = first
    stopped = 0  # the signal the ranks agreed to stop on
    path = None  # the checkpoint of `step`, once written
    for step in range(first + 1, steps + 1):
        start = time.perf_counter()
        loss = train_step(batches)
        guard.observe(loss)
        loss_sum += loss
        window += 1
        logs = step % cfg.train.log_every == 0 or step == steps
        if logs:  # waits for the device: the window's time includes the work it queued
            losses.append(global_mean(loss_sum, env) / window)
        train_time += time.perf_counter() - start
        if logs:
            exchange = dmp.module.exchange_counter.take(window)
            log.record_rank({"step": step, "local_loss": loss_sum.item() / window,
                             "train_seconds": train_time, **exchange})
            guard.check_loss(losses[-1], step)
            progress.show(log.record(training_record(
                step, losses[-1], window * B / (train_time - logged_time), train_step, cfg,
                exchange)))
            logged_time = train_time
            loss_sum.zero_()
            window = 0
        progress.step()
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != steps:
            guard.check_state(dmp, step)
            path = save_checkpoint(checkpoint_root(cfg), step, dmp, optimizer, env, cfg,
                                   state(step), run_id)
            log.say(f"checkpoint: {path}")
        if run.evaluates_at(step):
            train_step.pause()
            metrics = evaluate_and_log(dmp, dataset, kind, env, log, step, mlperf, run)
            if target.reached(metrics, env):
                mlperf.run_stop(True, run.epoch_num(step))
                break
        upcoming = stream.next_window(step) if stream and cfg.data.stream_eval != "none" else None
        if upcoming is not None and step != steps:  # the last window's next: the final evaluation
            train_step.pause()
            evaluate_window(dmp, dataset, kind, env, log, step, stream, upcoming,
                            cfg.data.stream_eval)
        stop.step = step
        stopped = stop.agreed() if step < steps else 0  # the last step ends the run anyway
        if stopped:
            break

    progress.close()
    batches.close()
    train_step.pause()
    if window:  # stopped (at the target, or on a signal) between two loss events
        losses.append(global_mean(loss_sum, env) / window)
    if path is None or path.name != f"step_{step}":  # not when the loop just wrote this step
        guard.check_state(dmp, step)
        path = save_checkpoint(checkpoint_root(cfg), step, dmp, optimizer, env, cfg,
                               state(step), run_id)
        if not stopped:  # else the stop's line names it
            log.say(f"checkpoint: {path}")
    if stopped:
        raise stopped_at(step, stopped, path, cfg, log)
    if not target.hit:
        metrics = evaluate_and_log(dmp, dataset, kind, env, log, step, mlperf, run)
        logged = run.mlperf_metadata(step) is not None  # only the schedule's evaluations
        mlperf.run_stop(target.reached(metrics, env) and logged, run.epoch_num(step))
    if target.wanted:
        log.record({"step": step, "target_auc": target.target_auc, "target_reached": target.hit,
                    "time_to_target_s": target.seconds if target.hit else None})
    samples_per_s = (step - first) * B / train_time if train_time else 0.0
    if env.is_main:
        log.say(done_line(step, losses[-1], metrics, samples_per_s, target.fields()))
    log.close()
    return TrainResult(step, losses, metrics, samples_per_s)


def training_record(step: int, loss: float, samples_per_s: float, train_step: TrainStep,
                    cfg: Config, exchange: dict) -> dict:
    """metrics.jsonl's record of a log step: the loss and throughput of the steps since the
    last one, the LRs of the next step (`lr` is `lr_dense`, as earlier versions wrote it) and
    rank 0's embedding exchange bytes per step."""
    lrs = current_lrs(train_step.optimizer, train_step.schedule, cfg.optim)
    return {"step": step, "loss": loss, "samples_per_s": samples_per_s, "lr": lrs["lr_dense"],
            **lrs, "exchange_fwd_bytes": exchange["exchange_fwd_bytes"],
            "exchange_bwd_bytes": exchange["exchange_bwd_bytes"],
            **train_step.precision.log_fields()}


def stopped_at(step: int, signum: int, checkpoint: Path, cfg: Config, log: MetricsLog
               ) -> RunStopped:
    """Say where a run stopped by a signal stands, and close its record."""
    log.record({"step": step, "stopped_by": signal.Signals(signum).name})
    log.say(f"stopped at step {step} ({signal.Signals(signum).name}); checkpoint: {checkpoint}; "
            f"{resume_hint(cfg.checkpoint.resume, bool(cfg.train.mlperf_log))}")
    log.close()
    return RunStopped(step, signum)


def resume(cfg: Config, train_step: TrainStep, log: MetricsLog,
           stream: Optional[StreamWindows] = None) -> Tuple[int, str]:
    """The step to continue after and the run's id: those of the checkpoint `checkpoint.resume`
    names (if intact and trained with these settings; a stream at the window and position it
    records), or 0 and a new id for a fresh run, an earlier run's files in the run directory set
    aside."""
    path = intact_checkpoint_to_resume(cfg, log.say)
    if path is None:
        set_aside_earlier_run(cfg, log.say)
        return 0, new_run_id()
    check_same_experiment(path, cfg)
    meta = load_checkpoint(path, train_step.dmp, train_step.optimizer)
    step = int(meta["step"])
    if stream is not None:
        stream.check_resume(meta.get("stream"), step, path)
    train_step.load_state_dict(meta)
    advance_schedule(train_step.schedule, step)
    log.say(f"resumed from {path} (step {step})")
    return step, run_of(meta)


def build_sharded_model(cfg: Config, spec, env: DistEnv, say: Callable[[str], None]):
    """The model `model.kind` names with its tables placed, sharded and initialised, the dense
    modules data-parallel as `parallel.dense` says (DDP, or FSDP2's fsdp/hsdp)."""
    require_dense_fits(cfg, spec, env.world_size, env.local_world_size)  # before building it
    kind = model_kind(cfg)
    torch.manual_seed(cfg.train.seed)  # the dense layers: identical on every rank
    model = kind.build(spec)
    attach_embedding_optimizer(model.embedding_bags, cfg.optim, env.device)
    plan = job_plan(cfg, table_specs(cfg, spec), env)
    say(describe(plan))
    for line in kind.plan_lines(plan, model):
        say(line)
    replaced = describe_lookups(model.lookups, cfg)
    if replaced:
        say(replaced)
    exchange, why = choose_exchange(cfg, plan)
    say(f"embedding exchange: {exchange} ({why})")
    dmp = shard_model(model, plan, env.device, env.local_world_size, cfg.parallel.comm_precision,
                      exchange, cfg.parallel.dense, cfg.parallel.hsdp_shard_size)
    init_tables(dmp, [part for lookup in model.lookups for part in lookup.tables], cfg.train.seed)
    return dmp, plan


def evaluate_and_log(dmp, dataset, kind: ModelKind, env: DistEnv, log: MetricsLog, step: int,
                     mlperf: MLPerfLog, run: RunSchedule) -> Dict[str, float]:
    mlperf.eval_start(run.mlperf_metadata(step))
    start = time.perf_counter()
    metrics = kind.evaluate(dmp, dataset, env)
    if metrics is None:
        return {}
    if "val_auc" in metrics:
        mlperf.eval_stop(metrics["val_auc"], run.mlperf_metadata(step))
    log.record({"step": step, **metrics, "eval_s": time.perf_counter() - start})
    log.say(f"eval step {step}: {metrics_text(metrics)}")
    return metrics


def evaluate_window(dmp, dataset, kind: ModelKind, env: DistEnv, log: MetricsLog, step: int,
                    stream: StreamWindows, window: int, how: str) -> None:
    """After the windows before `window` are trained: `window`'s rows ("next") or the
    validation split ("heldout"), read as split "window" (metrics `window_auc`...)."""
    first, end = stream.rows(window) if how == "next" else (0, dataset.num_samples("val"))
    dataset.add_rows("window", "train" if how == "next" else "val", first, end)
    start = time.perf_counter()
    metrics = kind.evaluate(dmp, dataset, env, "window")
    if metrics is None:
        return
    where = f"window {window} (training rows {first:,}-{end - 1:,})" if how == "next" else \
        "the validation split"
    log.record({"step": step, "windows_trained": window, "evaluated": where, **metrics,
                "eval_s": time.perf_counter() - start})
    log.say(f"eval step {step}, {window} window{'s' if window > 1 else ''} trained, on "
            f"{where}: {metrics_text(metrics)}")


class TargetWatch:
    """`train.target_auc`: whether an evaluation reached it, and how long after the run's start
    (the training and evaluation before it, as MLPerf times a run)."""

    def __init__(self, target_auc: float) -> None:
        self.target_auc, self.wanted = target_auc, target_auc > 0
        self.started = time.perf_counter()
        self.hit, self.seconds = False, math.nan

    def reached(self, metrics: Dict[str, float], env: DistEnv) -> bool:
        """Every rank learns rank 0's answer (only rank 0 has the metrics)."""
        if not self.wanted:
            return False
        verdict = torch.tensor(float(metrics.get("val_auc", 0.0) >= self.target_auc),
                               device=env.device)
        dist.broadcast(verdict, src=0)
        if verdict.item() and not self.hit:
            self.hit, self.seconds = True, time.perf_counter() - self.started
        return self.hit

    def fields(self) -> Dict[str, float]:
        """For the done line and metrics.jsonl: the target, and the seconds to it (nan: missed)."""
        if not self.wanted:
            return {}
        return {"target_auc": self.target_auc, "time_to_target_s": self.seconds}


def global_mean(local_value: torch.Tensor, env: DistEnv) -> float:
    total = local_value.detach().clone()
    dist.all_reduce(total)
    return total.item() / env.world_size
