"""Run under torchrun (or alone, one rank) by test_dense_sharding.py: a tiny DHEN trained 4
steps with each `parallel.dense` mode on this world size; rank 0 writes OUT/result.json: the
per-step losses, and (--save) what each mode keeps on a rank (dense bytes, Adagrad's state).

usage: dense_sharding_job.py OUT [--save | --resume DIR]
  (neither): each mode with dense SGD and with dense Adagrad
  --save: each mode with Adagrad, checkpointed at step 2 (steps 3-4 are its continuation)
  --resume DIR: each mode with SGD; each Adagrad run of DIR (a --save launch's OUT) resumed
                from its step 2 in the next mode of the cycle ddp -> fsdp -> hsdp -> ddp; fsdp
                with Adagrad under torchrec's train pipeline; ddp and fsdp with fp16, and
                fp16's skipped step under fsdp (`fp16_skip`)
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from dlrm_hybrid.config_loading import load_config  # noqa: E402
from dlrm_hybrid.data.source import open_dataset  # noqa: E402
from dlrm_hybrid.parallel.dense_sharding import dense_param_names  # noqa: E402
from dlrm_hybrid.parallel.process_group import init_distributed, shutdown  # noqa: E402
from dlrm_hybrid.train.loop import build_sharded_model, train  # noqa: E402
from dlrm_hybrid.train.optim import build_optimizer  # noqa: E402

# A two-layer DHEN: each layer is its own FSDP group, and so are the mixed-dimension tables'
# projections. Every table sharded (the same plan on every world size). The first steps of Adagrad move a weight by about +-lr whatever its
# gradient's size: a small lr keeps rounding of another summation order out of the losses.
COMMON = ["train.max_steps=4", "train.log_every=1", "train.eval_every=0",
          "train.progress_bar=false", "data.global_batch_size=256", "data.train_samples=8192",
          "data.val_samples=512", "model.interaction=dhen", "model.dhen.layers=2",
          "model.dhen.modules=[dot,linear]", "optim.embedding=sgd", "parallel.replicate=false",
          "model.mixed_dimensions.temperature=0.3", "checkpoint.resume=none"]
OPTIMIZERS = {"sgd": ["optim.dense=sgd", "optim.dense_lr=0.5"],
              "adagrad": ["optim.dense=adagrad", "optim.dense_lr=0.01"]}
NEXT = {"ddp": "fsdp", "fsdp": "hsdp", "hsdp": "ddp"}


def mode_overrides(mode: str, world_size: int) -> list:
    """hsdp: 2 x 2 on 4 ranks; elsewhere one group of the host's ranks (hsdp_shard_size 0)."""
    shard = ["parallel.hsdp_shard_size=2"] if mode == "hsdp" and world_size == 4 else []
    return [f"parallel.dense={mode}", *shard]


def config(run_dir: Path, mode: str, optimizer: str, env, extra=()):
    return load_config(str(ROOT / "configs/demo.yaml"),
                       COMMON + OPTIMIZERS[optimizer] + mode_overrides(mode, env.world_size)
                       + [f"train.run_dir={run_dir}", *extra], env.world_size)


def held_on_rank(mode: str, env) -> dict:
    """What the dense modules and dense Adagrad keep on this rank under `mode`."""
    cfg = config(Path("unused"), mode, "adagrad", env)
    dmp, _ = build_sharded_model(cfg, open_dataset(cfg.data).spec, env, lambda line: None)
    optimizer, _ = build_optimizer(dmp, cfg.optim)
    params = dict(dmp.module.named_parameters())
    dense = [params[name] for name in dense_param_names(dmp.module)]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in dense]
    state = optimizer.state_dict()["state"]
    top = next(k for k in state if "over_arch" in k and k.endswith("weight"))
    total_sum = state[top]["sum"]
    return {"groups": [name for name, module in dmp.module.named_modules()
                       if isinstance(module, FSDPModule)],
            "ddp": isinstance(dmp._dmp_wrapped_module, DistributedDataParallel),
            "dense_bytes": sum(t.numel() * t.element_size() for t in local),
            "full_bytes": sum(p.numel() * p.element_size() for p in dense),
            "sum_type": type(total_sum).__name__,
            "sum_placements": [str(p) for p in getattr(total_sum, "placements", ())],
            "sum_local_rows": (total_sum.to_local() if hasattr(total_sum, "to_local")
                               else total_sum).shape[0],
            "sum_rows": total_sum.shape[0]}


def fp16_skip(env) -> list:
    """fp16 under fsdp when only rank 1's embedding gradient overflows, at step 1 of 2: every
    rank must skip, even one whose shard of the first dense gradient is empty (w0: 1 row).
    Per step: whether this rank's shards changed, and the loss scale."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dlrm_hybrid.train.precision import Precision

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Linear(1, 4))
    fully_shard(mlp, mesh=init_device_mesh("cpu", (env.world_size,)), reshard_after_forward=True)
    precision = Precision("fp16", torch.device("cpu"), fallback=False,
                          dense_params=list(mlp.parameters()))
    optimizer = torch.optim.SGD(mlp.parameters(), lr=0.1)
    record = []
    for step in range(2):
        optimizer.zero_grad()
        pooled = precision.split_at_embeddings(torch.randn(8, 4, requires_grad=True))
        if env.rank == 1 and step == 0:
            pooled.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        before = [p.to_local().clone() for p in mlp.parameters()]
        with precision.autocast():
            loss = mlp(pooled).float().mean()
        precision.backward(loss)
        precision.step(optimizer)
        changed = any(not torch.equal(b, p.to_local()) for b, p in zip(before, mlp.parameters()))
        record.append([changed, precision.scaler.get_scale()])
    return record


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed("gloo")
    save, resume = "--save" in sys.argv, "--resume" in sys.argv
    optimizers = ["adagrad"] if save else ["sgd"] if resume else list(OPTIMIZERS)
    result = {"losses": {}}
    if save:
        result["held"] = {mode: held_on_rank(mode, env) for mode in NEXT}
    for mode in NEXT:
        for optimizer in optimizers:
            name = f"{mode}-{optimizer}"
            result["losses"][name] = train(config(
                out / name, mode, optimizer, env, ["checkpoint.every=2"] if save else []),
                env).losses
    if resume:
        earlier = Path(sys.argv[sys.argv.index("--resume") + 1])
        for mode, then in NEXT.items():
            step_2 = earlier / f"{mode}-adagrad" / "checkpoints" / "step_2"
            result["losses"][f"{mode}-adagrad-then-{then}"] = train(config(
                out / f"{mode}-then-{then}", then, "adagrad", env,
                [f"checkpoint.resume={step_2}"]), env).losses
        result["losses"]["fsdp-adagrad-pipelined"] = train(config(
            out / "pipelined", "fsdp", "adagrad", env, ["train.pipeline=enabled"]), env).losses
        for mode in ("ddp", "fsdp"):  # fp16's loss scaler over the dense gradients' shards
            # without the projections: their first Adagrad steps move by +-lr whatever a
            # near-zero gradient's size, so fp16's rounding in another reduction order shows
            result["losses"][f"{mode}-fp16"] = train(config(
                out / f"{mode}-fp16", mode, "adagrad", env,
                ["train.precision=fp16", "train.precision_fallback=false",
                 "model.mixed_dimensions.temperature=0"]), env).losses
        result["fp16_skip"] = [None] * env.world_size
        dist.all_gather_object(result["fp16_skip"], fp16_skip(env))
    if env.is_main:
        (out / "result.json").write_text(json.dumps(result))
    shutdown()


if __name__ == "__main__":
    main()
