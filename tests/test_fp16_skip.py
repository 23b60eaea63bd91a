"""fp16: one job-wide decision to skip a step, for the tables and the MLPs alike, even when the
overflow is on one rank only and only in an MLP's gradients (2 real gloo processes)."""

import json
import math
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlrm_hybrid.train.precision import Precision


def _one_rank(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    table = torch.nn.Parameter(torch.randn(10, 4))
    table_grads = []  # a fused table update would run where this hook runs
    table.register_hook(lambda grad: table_grads.append(grad.clone()))
    mlp = torch.nn.Linear(4, 1)
    precision = Precision("fp16", torch.device("cpu"), fallback=False,
                          dense_params=list(mlp.parameters()))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    record = []
    for step in range(2):
        overflow_here = rank == 1 and step == 0  # this rank's MLP gradient alone overflows
        hook = mlp.weight.register_hook(
            lambda grad: torch.full_like(grad, math.inf)) if overflow_here else None
        optimizer.zero_grad()
        pooled = precision.split_at_embeddings(table[torch.tensor([1, 2, 3])])
        with precision.autocast():
            # halved: at the initial scale 2^16 the mean's bias gradient would be 65536, past
            # fp16's 65504, an overflow on every rank by itself that hides the one rank's
            loss = 0.5 * mlp(pooled).float().mean()
        weight = mlp.weight.detach().clone()
        precision.backward(loss)
        precision.step(optimizer)
        record.append({"table_updates": len(table_grads),
                       "mlp_changed": not torch.equal(weight, mlp.weight.detach()),
                       "skipped": precision.skipped_steps(),
                       "scale": precision.scaler.get_scale()})
        if hook is not None:
            hook.remove()
    with open(f"{out_dir}/rank_{rank}.json", "w") as f:
        json.dump(record, f)
    dist.destroy_process_group()
    # Leave as the CLI does (cli._exit): gloo's C++ threads torn down at interpreter exit
    # sometimes abort a finished rank ("terminate called without an active exception").
    os._exit(0)


def test_an_overflow_on_one_rank_skips_tables_and_mlps_on_every_rank(tmp_path):
    # Forked, not spawned (as test_retrieval_loss.py's ranks): ~0.2 s instead of ~5 s of
    # importing torch twice. Safe here: each rank runs torch on one thread (no OpenMP pool
    # inherited) and gloo starts its own threads.
    mp.start_processes(_one_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="fork")
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # the same decisions and scale everywhere
    skipped, taken = ranks[0]
    assert skipped["table_updates"] == 0 and not skipped["mlp_changed"]
    assert skipped["skipped"] == 1 and skipped["scale"] == 2.0**15  # backed off from 2^16
    assert taken["table_updates"] == 1 and taken["mlp_changed"] and taken["skipped"] == 1
