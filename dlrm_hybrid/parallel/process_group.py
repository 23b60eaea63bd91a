"""Join the job torchrun started (or become a one-process job) with NCCL on GPUs, gloo on CPUs."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlrm_hybrid.config import ConfigError


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str = "auto") -> DistEnv:
    """`backend`: auto (NCCL when CUDA is present, else gloo), nccl, or gloo."""
    if "RANK" not in os.environ:  # started without torchrun: a job of one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if local_world > gpus:
            raise ConfigError(f"parallel.backend: nccl needs one GPU per local rank, found {gpus} "
                              f"GPUs for {local_world} ranks; use fewer ranks or parallel.backend=gloo")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend=backend, rank=rank, world_size=world)
    return DistEnv(rank, world, local_rank, local_world, backend, device)


def shutdown(finished: bool = True) -> None:
    """After a finished run, leave together: a rank tearing down its connections while another
    still has work on them can abort the other. After a failure, do not wait for peers."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
