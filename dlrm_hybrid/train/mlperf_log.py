"""MLPerf Training's log of a DLRM-DCNv2 or DLRMv4 run (`train.mlperf_log`; DLRMv4 where the
ranker has `model.sequence: hstu`), written with the official `mlperf-logging` package (mllog) by
rank 0: the keys the closed-division ruleset of the benchmark (dlrm_dcnv2 in 6.0.0, dlrmv4 and the
common rules in 6.1.0) requires, with the values this run uses, so `python -m mlperf_logging.compliance_checker` can
check it. Other ranks, and runs without the setting, log nothing."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from mlperf_logging.mllog import constants as c
from mlperf_logging.mllog.mllog import MLLogger

from dlrm_hybrid.config import Config, ConfigError
from dlrm_hybrid.train.mlperf_dlrmv4 import EVAL_EVERY_DATA_PCT, is_dlrmv4

BENCHMARK, DLRMV4 = "dlrm_dcnv2", "dlrmv4"
ORG = "dlrm_hybrid"
CACHE_CLEARED_ENV = "MLPERF_CACHE_CLEARED"  # the launcher sets it to 1 after dropping caches


class MLPerfLog:
    """One run's MLPerf log; every method is a no-op where the log is off."""

    def __init__(self, path: Optional[Path]) -> None:
        self._mllog: Optional[MLLogger] = None
        self._running, self._epoch_num = False, 0.0
        self._began = False  # run_start logged: from then on the log is the run's record
        if path is None:
            return
        self._path = path
        self._made = [f for f in (path.parent, *path.parent.parents) if not f.exists()]
        path.parent.mkdir(parents=True, exist_ok=True)  # in the run directory (open checked)
        logger = logging.getLogger(f"dlrm_hybrid.mlperf.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(path, mode="w")
        logger.addHandler(self._handler)
        self._mllog = MLLogger(logger=logger)

    @staticmethod
    def open(cfg: Config, rank: int, resuming: bool) -> "MLPerfLog":
        """The run's log (on rank 0, if configured), after refusing to overwrite a finished one
        or to log a resumed run as if it were one."""
        if not cfg.train.mlperf_log:
            return MLPerfLog(None)
        if resuming:
            raise ConfigError("train.mlperf_log: an MLPerf run starts from scratch, and this one "
                              "would resume a checkpoint; set checkpoint.resume=none (or another "
                              "train.run_dir)")
        path = Path(cfg.train.mlperf_log)
        if path.exists() and path.stat().st_size:
            raise ConfigError(f"train.mlperf_log: {path} already holds a run's log; give another "
                              f"path or move it away")
        in_run_dir = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(cfg.train.run_dir))
        if not path.parent.is_dir() and not (in_run_dir and not path.parent.exists()):
            raise ConfigError(f"train.mlperf_log: folder {path.parent} does not exist")
        if dist.is_initialized():  # every rank has looked before rank 0 creates it
            dist.barrier()
        return MLPerfLog(path if rank == 0 else None)

    def init_start(self) -> None:
        if self._mllog is not None:
            self._mllog.event(key=c.CACHE_CLEAR, value=os.environ.get(CACHE_CLEARED_ENV) == "1")
            self._mllog.start(key=c.INIT_START)

    def run_start(self, cfg: Config, env, train_samples: int, eval_samples: int,
                  precision: str = "fp32", spec=None) -> None:
        """The submission's and the run's settings, then init_stop and run_start (`precision`:
        the training step's, e.g. bf16; `spec`: the dataset's, for the division)."""
        log, o = self._mllog, cfg.optim
        if log is None:
            return
        events = {
            c.SUBMISSION_BENCHMARK: DLRMV4 if is_dlrmv4(cfg) else BENCHMARK, c.SUBMISSION_ORG: ORG,
            c.SUBMISSION_DIVISION: division(cfg, spec), c.SUBMISSION_STATUS: c.ONPREM,
            c.SUBMISSION_PLATFORM: platform(env),
            c.GLOBAL_BATCH_SIZE: cfg.data.global_batch_size,
            c.GRADIENT_ACCUMULATION_STEPS: 1, c.SEED: cfg.train.seed,
            c.TRAIN_SAMPLES: train_samples, c.EVAL_SAMPLES: eval_samples,
        }
        if is_dlrmv4(cfg):
            events.update(dlrmv4_events(cfg, env, precision))
        else:
            events.update({
                c.OPT_NAME: optimizer_name(cfg), c.OPT_BASE_LR: o.dense_lr,
                c.OPT_ADAGRAD_LR_DECAY: 0, c.OPT_WEIGHT_DECAY: 0,  # neither exists here
                c.OPT_ADAGRAD_INITIAL_ACCUMULATOR_VALUE: 0,  # torch's, fbgemm's Adagrad start at 0
                c.OPT_ADAGRAD_EPSILON: o.eps, c.OPT_LR_WARMUP_STEPS: o.warmup_steps,
                c.OPT_LR_DECAY_START_STEP: o.decay_start_step, c.OPT_LR_DECAY_STEPS: o.decay_steps,
            })
        for key, value in events.items():
            log.event(key=key, value=value)
        log.end(key=c.INIT_STOP)
        log.start(key=c.RUN_START)
        log.start(key=c.EPOCH_START, metadata={c.EPOCH_NUM: 0})
        self._running = self._began = True

    def eval_start(self, metadata: Optional[dict]) -> None:
        """`metadata`: the schedule's (epoch_num, and DLRMv4's samples_count); None: unlogged."""
        if self._mllog is not None and metadata is not None:
            self._mllog.start(key=c.EVAL_START, metadata=metadata)

    def eval_stop(self, auc: float, metadata: Optional[dict]) -> None:
        if metadata is None:
            return
        self._epoch_num = metadata[c.EPOCH_NUM]
        if self._mllog is not None:
            self._mllog.event(key=c.EVAL_ACCURACY, value=auc, metadata=metadata)
            self._mllog.end(key=c.EVAL_STOP, metadata=metadata)

    def run_stop(self, success: bool, epoch_num: float) -> None:
        """success: stopped at the evaluation that reached the target (run_stop, then the
        epoch's end, as the reference logs them); otherwise the epoch, or the run, ended
        without reaching it (the epoch's end, then run_stop aborted)."""
        log = self._mllog
        if log is None:
            return
        status = {c.STATUS: c.SUCCESS if success else c.ABORTED, c.EPOCH_NUM: epoch_num}
        if success:
            log.end(key=c.RUN_STOP, metadata=status)
        log.end(key=c.EPOCH_STOP, metadata={c.EPOCH_NUM: 0})
        if not success:
            log.end(key=c.RUN_STOP, metadata=status)
        self.close()

    def abort(self) -> None:
        """A run that stopped on an error: aborted, if it had started and not yet stopped; one
        refused before run_start leaves no log (nor the folders made for it), so its rerun with
        the settings corrected may write there."""
        if self._running:
            self.run_stop(False, self._epoch_num)
        if self._mllog is not None and not self._began:
            self.close()
            self._path.unlink(missing_ok=True)
            for folder in self._made:
                try:
                    folder.rmdir()
                except OSError:  # the run's own files are in it
                    break
        self.close()

    def close(self) -> None:
        if self._mllog is not None:
            self._handler.close()
            self._mllog = None
        self._running = False


def dlrmv4_events(cfg: Config, env, precision: str) -> dict:
    """DLRMv4's keys (closed_dlrmv4.yaml and 6.1.0's common rules), the settings check_rules
    admits: dense Adam without weight decay, row-wise Adagrad on the tables, the warm-up from 0."""
    o, h = cfg.optim, cfg.model.hstu
    linear = {"auto": "fp32", "bf16": "bfloat16"}.get(precision, precision)  # mllog's names
    return {
        "max_sequence_length": h.max_length + 1,  # the history and the candidate
        c.OPT_NAME: "Adam", c.OPT_BASE_LR: o.dense_lr, "opt_adam_beta_1": o.dense_betas[0],
        "opt_adam_beta_2": o.dense_betas[1], "opt_adam_epsilon": o.eps,
        c.OPT_WEIGHT_DECAY: 0.0, "opt_gradient_clip_norm": o.dense_clip_norm,
        "opt_sparse_name": "RowWiseAdagrad", "opt_sparse_base_learning_rate": o.embedding_lr,
        c.OPT_LR_WARMUP_STEPS: o.warmup_steps, "opt_learning_rate_warmup_start_lr": 0.0,
        "eval_every_data_pct": EVAL_EVERY_DATA_PCT,
        "lowest_numerical_precision_in_linear": linear,
        "lowest_numerical_precision_in_attn": linear,  # HSTU's attention runs in the step's type
        "lowest_numerical_precision_in_comm": {"bf16": "bfloat16"}.get(
            cfg.parallel.comm_precision, cfg.parallel.comm_precision),
        # tables shard, dense parts replicate (DDP): no tensor, pipeline, context or expert split
        "tensor_parallelism": 1, "pipeline_parallelism": 1, "context_parallelism": 1,
        "expert_parallelism": 1, "micro_batch_size": cfg.data.global_batch_size // env.world_size,
        "config_filename": str(Path(cfg.train.run_dir) / "config.yaml"),  # the run's own, saved
    }


def division(cfg: Config, spec=None) -> str:
    """`closed`, or `open` where the embeddings are not the reference's tables: hashed or QR
    features (configs/mlperf_dcnv2_qr.yaml) change the model, and a DCNv2 dataset (`spec`, of
    data.path) of other hotness or table sizes than the reference's multi-hot Criteo (one-hot,
    or `preprocess multihot` without --rows mlperf) other data; the closed division forbids both."""
    from dlrm_hybrid.data.criteo.multi_hot import MLPERF_HOTNESS, MLPERF_ROWS

    other_data = (spec is not None and bool(cfg.data.path) and not is_dlrmv4(cfg) and
                  (list(spec.hotness), list(spec.cardinalities)) != (MLPERF_HOTNESS, MLPERF_ROWS))
    return c.OPEN if cfg.model.compositional or other_data else c.CLOSED


def optimizer_name(cfg: Config) -> str:
    """MLPerf's name of the optimizers that run: `adagrad` where tables and MLPs both use exact
    Adagrad (fbgemm's EXACT_ADAGRAD and torch.optim.Adagrad, as the reference), else the names
    used (config validation refuses those under train.mlperf_log; row-wise Adagrad keeps one
    accumulator per row, a different algorithm)."""
    used = {cfg.optim.embedding, cfg.optim.dense}
    return used.pop() if len(used) == 1 else "+".join(sorted(used))


def platform(env) -> str:
    """MLPerf's submission_platform: ranks x device."""
    device = (torch.cuda.get_device_name(env.device) if env.device.type == "cuda"
              else "CPU process")
    return f"{env.world_size}x {device}"
