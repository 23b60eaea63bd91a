"""One training step, as the training loop and the benchmark run it."""

from __future__ import annotations

import base64
import contextlib
import logging
import re
import warnings
from typing import Iterator

import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.optimizers import in_backward_optimizer_filter

from dlrm_hybrid.data.batch import Batch
from dlrm_hybrid.train.cuda_graphs import DenseGraph, graphs_wanted
from dlrm_hybrid.train.precision import Precision


class TrainStep:
    """Forward under the configured precision, backward (the embedding update is fused into
    it), the dense optimizer step, and the LR schedule.

    Pipelined (`train.pipeline`), torchrec's TrainPipelineSparseDist runs it: batch i+1's
    host-to-device copy and id all-to-all overlap batch i's compute on their own CUDA streams.
    """

    def __init__(self, dmp, optimizer, schedule, train_cfg, device: torch.device) -> None:
        self.dmp, self.optimizer, self.schedule, self.device = dmp, optimizer, schedule, device
        dense_params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        model = dmp.module
        graphs = graphs_wanted(train_cfg.cuda_graphs, model, device)
        self.precision = Precision(train_cfg.precision, device, graphs,
                                   train_cfg.precision_fallback, dense_params)
        if self.precision.scaler is not None:
            model.embedding_grad_transform = self.precision.split_at_embeddings
            # A step the scaler skips still advances the schedule (and the data): not a mistake.
            skipped = re.escape("Detected call of `lr_scheduler.step()` before")
            warnings.filterwarnings("ignore", message=skipped)
        self.graph = DenseGraph(model, device) if graphs else None
        pipelined = train_cfg.pipeline == "enabled" or (train_cfg.pipeline == "auto"
                                                   and device.type == "cuda")
        self.pipeline = _Pipeline(self, device) if pipelined else None

    def __call__(self, batches: Iterator[Batch]) -> torch.Tensor:
        """Train on the next batch; its mean loss (detached: reading it waits for the device)."""
        if self.graph is not None:  # the loader's threads must not touch CUDA during capture
            self.graph.capture_guard = getattr(batches, "quiesced", contextlib.nullcontext)
        if self.pipeline is not None:
            loss = self.pipeline.progress(batches)
        else:
            self.optimizer.zero_grad()  # also hands the scheduled LR to the fused embedding optimizer
            loss = self.forward(next(batches))
            self.precision.backward(loss)
            self.precision.step(self.optimizer)
        self.schedule.step()
        return loss.detach()

    @property
    def driver(self) -> str:
        """What runs the steps, for the run's record: torchrec's train pipeline, or this step."""
        return "torchrec pipeline" if self.pipeline is not None else "plain"

    def forward(self, batch: Batch) -> torch.Tensor:
        with self.precision.autocast():
            return self.dmp(batch.dense, batch.sparse, batch.labels)

    def state_dict(self) -> dict:
        """The step's own state for a checkpoint's meta.json: the fp16 loss scaler's, and the
        random generator's (dropout draws from it), so that a resumed run draws what the
        uninterrupted one drew. Every rank seeds it alike and draws alike: rank 0's stands for
        all."""
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {**self.precision.state_dict(),
                "rng": {k: base64.b64encode(v.numpy().tobytes()).decode() for k, v in rng.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.precision.load_state_dict(state)
        for kind, text in state.get("rng", {}).items():  # none in earlier versions' checkpoints
            if kind == "cuda" and self.device.type != "cuda":
                continue  # a GPU run resumed on CPU: its dropout draws differ from here on
            saved = torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
            if kind == "cuda":
                torch.cuda.set_rng_state(saved, self.device)
            else:
                torch.set_rng_state(saved)

    def pause(self) -> None:
        """Before using the model for anything else (evaluation): the pipeline gives back the
        sharded forward it took over; the next step takes it again."""
        if self.pipeline is not None:
            self.pipeline.detach()


class _Pipeline(TrainPipelineSparseDist):
    """torchrec's pipeline with this project's step: autocast forward, backward and optimizer
    step through the fp16 loss scaler. It calls `optimizer.zero_grad()` itself."""

    def __init__(self, step: TrainStep, device: torch.device) -> None:
        # pipeline_postproc: compositional features' id transform (model.lookup_ids, no
        # parameters) runs ahead with the id exchange; without it the lookup is not pipelined.
        super().__init__(step.dmp, step.optimizer, device, execute_all_batches=True,
                         pipeline_postproc=True,
                         custom_model_fwd=lambda batch: _loss_and_output(step.forward(batch)))
        self.precision = step.precision
        if device.type == "cpu":  # CPU has no streams to race on; torchrec warns of NaNs anyway
            logging.getLogger("torchrec.distributed.train_pipeline.postproc").setLevel(logging.ERROR)

    def _backward(self, losses: torch.Tensor) -> None:
        self.precision.backward(losses)

    def _optimizer_step(self) -> None:
        self.precision.step(self._optimizer)


def _loss_and_output(loss: torch.Tensor):
    return loss, loss.detach()
