"""MLPerf Training's log of a DLRM-DCNv2 run (`train.mlperf_log`), written with the official
`mlperf-logging` package (mllog) by rank 0: the keys the closed-division dlrm_dcnv2 ruleset
requires, with the values this run uses, so `python -m mlperf_logging.compliance_checker` can
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

BENCHMARK = "dlrm_dcnv2"
ORG = "dlrm_hybrid"
CACHE_CLEARED_ENV = "MLPERF_CACHE_CLEARED"  # the launcher sets it to 1 after dropping caches


class MLPerfLog:
    """One run's MLPerf log; every method is a no-op where the log is off."""

    def __init__(self, path: Optional[Path]) -> None:
        self._mllog: Optional[MLLogger] = None
        self._running, self._epoch_num = False, 0.0
        if path is None:
            return
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
        if not path.parent.is_dir():
            raise ConfigError(f"train.mlperf_log: folder {path.parent} does not exist")
        if dist.is_initialized():  # every rank has looked before rank 0 creates it
            dist.barrier()
        return MLPerfLog(path if rank == 0 else None)

    def init_start(self) -> None:
        if self._mllog is not None:
            self._mllog.event(key=c.CACHE_CLEAR, value=os.environ.get(CACHE_CLEARED_ENV) == "1")
            self._mllog.start(key=c.INIT_START)

    def run_start(self, cfg: Config, env, train_samples: int, eval_samples: int) -> None:
        """The submission's and the run's settings, then init_stop and run_start."""
        log, o = self._mllog, cfg.optim
        if log is None:
            return
        events = {
            c.SUBMISSION_BENCHMARK: BENCHMARK, c.SUBMISSION_ORG: ORG,
            c.SUBMISSION_DIVISION: division(cfg), c.SUBMISSION_STATUS: c.ONPREM,
            c.SUBMISSION_PLATFORM: platform(env),
            c.GLOBAL_BATCH_SIZE: cfg.data.global_batch_size,
            c.GRADIENT_ACCUMULATION_STEPS: 1, c.SEED: cfg.train.seed,
            c.TRAIN_SAMPLES: train_samples, c.EVAL_SAMPLES: eval_samples,
            c.OPT_NAME: optimizer_name(cfg), c.OPT_BASE_LR: o.dense_lr,
            c.OPT_ADAGRAD_LR_DECAY: 0, c.OPT_WEIGHT_DECAY: 0,  # neither exists here
            c.OPT_ADAGRAD_INITIAL_ACCUMULATOR_VALUE: 0,  # torch's and fbgemm's Adagrad start at 0
            c.OPT_ADAGRAD_EPSILON: o.eps, c.OPT_LR_WARMUP_STEPS: o.warmup_steps,
            c.OPT_LR_DECAY_START_STEP: o.decay_start_step, c.OPT_LR_DECAY_STEPS: o.decay_steps,
        }
        for key, value in events.items():
            log.event(key=key, value=value)
        log.end(key=c.INIT_STOP)
        log.start(key=c.RUN_START)
        log.start(key=c.EPOCH_START, metadata={c.EPOCH_NUM: 0})
        self._running = True

    def eval_start(self, epoch_num: float) -> None:
        if self._mllog is not None:
            self._mllog.start(key=c.EVAL_START, metadata={c.EPOCH_NUM: epoch_num})

    def eval_stop(self, auc: float, epoch_num: float) -> None:
        self._epoch_num = epoch_num
        if self._mllog is not None:
            self._mllog.event(key=c.EVAL_ACCURACY, value=auc, metadata={c.EPOCH_NUM: epoch_num})
            self._mllog.end(key=c.EVAL_STOP, metadata={c.EPOCH_NUM: epoch_num})

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
        """A run that stopped on an error: aborted, if it had started and not yet stopped."""
        if self._running:
            self.run_stop(False, self._epoch_num)
        self.close()

    def close(self) -> None:
        if self._mllog is not None:
            self._handler.close()
            self._mllog = None
        self._running = False


def division(cfg: Config) -> str:
    """`closed`, or `open` where the embeddings are not the reference's tables: hashed or QR
    features (configs/mlperf_dcnv2_qr.yaml) change the model, which the closed division forbids."""
    return c.OPEN if cfg.model.compositional else c.CLOSED


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
