"""torchrec's own stack on the model of a bench config: what a torchrec user following torchrec's
DLRM example (facebookresearch/dlrm `torchrec_dlrm/dlrm_main.py`) writes, for `bench` to time
beside ours in the same process on the same batches.

As the example does: `torchrec.models.dlrm.DLRM` (`DLRM_DCN` for `dcn`) wrapped in `DLRMTrain`,
its `EmbeddingBagCollection` on the meta device, the embedding optimizer fused into the backward
(`apply_optimizer_in_backward`; `optim.embedding` names it: row-wise Adagrad, SGD, Adagrad,
Adam on GPU), `EmbeddingShardingPlanner`'s plan over `get_default_sharders()`,
`DistributedModelParallel`, the dense optimizer in a `KeyedOptimizerWrapper` beside
`dmp.fused_optimizer` in a `CombinedOptimizer`, an LR schedule, and
`TrainPipelineSparseDist.progress` for each step.

Where it departs from the example, so that peer and ours train one model (same losses, step
for step: tests/test_torchrec_peer.py) and a test can tell a wrong peer; none changes the work
of a step:
- the tables start from the values ours start from (`init_tables`' seeded blocks of
  U(-1/sqrt(rows), 1/sqrt(rows)), the range of torchrec's default init, whose own draw would
  depend on the world size), the dense layers from the same seed;
- the optimizers and schedule are ours (`build_optimizer`): the example's, plus one thing it
  leaves out: a table the planner replicates (`data_parallel`, small tables) gets no fused
  optimizer, and the example's filter would hand it to the dense optimizer; here it gets the
  embedding optimizer, as in ours (the same whenever both optimizers are alike, as in the
  example's Adagrad/Adagrad);
- on a GPU the planner is told the memory free on the card (beside ours), not torchrec's
  default 32 GiB, under which it would move tables that fit to host memory (UVM caching).

On CPU (gloo) the pipeline runs as it is: without CUDA its copy and input-dist "streams" are
None, so it overlaps nothing, but it still rewrites the sharded module's forward, starts the
next batch's input all-to-all before this batch's forward and keeps two batches ahead; run on
torchrec 1.8.0, 1 and 2 gloo ranks (tests/test_torchrec_peer.py).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from types import SimpleNamespace
from typing import Iterator

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LambdaLR
from torchrec.datasets.utils import Batch as TorchrecBatch
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRM_DCN, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from dlrm_hybrid.data.batch import Batch
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.model.compositional import lookups_of
from dlrm_hybrid.parallel.process_group import DistEnv
from dlrm_hybrid.parallel.sharding import init_tables
from dlrm_hybrid.train.optim import attach_embedding_optimizer, build_optimizer


def torchrec_peer_step(cfg, spec, env: DistEnv) -> "PeerStep":
    """The peer for `cfg` (a Config) over a dataset of `spec` (a DataSpec), on `env.device`, in
    the process group already started (ours, `init_distributed`): a callable taking an iterator
    of our `Batch`es (this rank's slice, any device) and returning the loss of a step.
    Seeds torch's generators with `train.seed` (as building ours does)."""
    model = DLRMTrain(peer_model(cfg.model, spec, env.device, cfg.train.seed))
    # apply_optimizer_in_backward(optim.embedding's class, the tables, its LR and eps)
    attach_embedding_optimizer(model.model.sparse_arch, cfg.optim, env.device)
    with _planner_notices_quiet():
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=env.world_size, local_world_size=env.local_world_size,
                              compute_device=env.device.type,
                              hbm_cap=_free_device_memory(env.device)),
            batch_size=cfg.data.global_batch_size // env.world_size)
        plan = planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(module=model, device=env.device, plan=plan)
    _init_tables_as_ours(dmp, cfg.model, spec, cfg.train.seed)
    optimizer, schedule = build_optimizer(dmp, cfg.optim)
    return PeerStep(dmp, TrainPipelineSparseDist(dmp, optimizer, env.device), schedule)


def _free_device_memory(device: torch.device):
    """Bytes free on a CUDA device now, the caching allocator's unused blocks given back first
    (ours holds the rest); None (torchrec's default) on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


@contextlib.contextmanager
def _planner_notices_quiet():
    """torchrec's planner and DMP notices about how the example builds them (a Topology made
    directly, its storage reservation, a replicated table's missing sharding spec): a `bench`
    user reads five lines that say nothing about the comparison."""
    loggers = [logging.getLogger(name) for name in (
        "torchrec.distributed.planner.types", "torchrec.distributed.planner.storage_reservations")]
    levels = [logger.level for logger in loggers]
    no_spec = lambda record: "Sharding spec not found" not in record.getMessage()  # noqa: E731
    root = logging.getLogger()
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        root.addFilter(no_spec)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*HeuristicalStorageReservation",
                                    category=FutureWarning)
            yield
    finally:
        root.removeFilter(no_spec)
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def peer_model(model_cfg, spec, device: torch.device, seed: int,
               embedding_device: torch.device = torch.device("meta")) -> DLRM:
    """torchrec's DLRM (dot) or DLRM_DCN (dcn, stacked, one expert) of our model's shape: one
    table `t_<feature>` per feature, the same MLPs, dense layers drawn from `seed` in our order
    (bottom MLP, then top MLP), so on CPU they start equal to ours. The tables on
    `embedding_device`: meta for sharding, as the example (a real one: tests' unsharded copy)."""
    require_torchrec_shape(model_cfg)
    tables = [EmbeddingBagConfig(name=f"t_{name}", embedding_dim=model_cfg.embedding_dim,
                                 num_embeddings=rows, feature_names=[name])
              for name, rows in zip(spec.feature_names, spec.cardinalities)]
    shape = dict(embedding_bag_collection=EmbeddingBagCollection(tables, device=embedding_device),
                 dense_in_features=spec.num_dense, dense_arch_layer_sizes=model_cfg.bottom_mlp,
                 over_arch_layer_sizes=model_cfg.top_mlp, dense_device=device)
    torch.manual_seed(seed)
    if model_cfg.interaction == "dcn":
        return DLRM_DCN(**shape, dcn_num_layers=model_cfg.dcn.layers,
                        dcn_low_rank_dim=model_cfg.dcn.rank)
    return DLRM(**shape)


def torchrec_models(model_cfg) -> bool:
    """Whether torchrec's DLRM can be the model of `model_cfg` (bench's default peers)."""
    return not _unlike_torchrec(model_cfg)


def require_torchrec_shape(model_cfg) -> None:
    """torchrec's models have one full fp32 table per feature, the dot interaction without self
    pairs or a stacked low-rank DCN, one logit: refuse the rest, naming it."""
    unlike = _unlike_torchrec(model_cfg)
    if unlike:
        raise UserError(f"torchrec peer: torchrec's DLRM has no {unlike[0]}; it models dot "
                        f"(no self pairs) or stacked one-expert dcn, full fp32 tables, one logit")


def _unlike_torchrec(model_cfg) -> list:
    dcn = model_cfg.dcn
    return [what for what, differs in [
        (f"model.kind {model_cfg.kind}", model_cfg.kind != "dlrm"),
        (f"model.interaction {model_cfg.interaction}", model_cfg.interaction not in ("dot", "dcn")),
        ("model.self_interaction", model_cfg.interaction == "dot" and model_cfg.self_interaction),
        (f"model.dcn.structure {dcn.structure}",
         model_cfg.interaction == "dcn" and dcn.structure != "stacked"),
        (f"model.dcn.experts {dcn.experts}", model_cfg.interaction == "dcn" and dcn.experts > 1),
        ("model.compositional", bool(model_cfg.compositional)),
        (f"model.embedding_precision {model_cfg.embedding_precision}",
         model_cfg.embedding_precision != "fp32"),
        ("model.tasks", bool(model_cfg.tasks))] if differs]


def _init_tables_as_ours(dmp: DistributedModelParallel, model_cfg, spec, seed: int) -> None:
    """Our `init_tables` on the peer's shards: it finds a table's state-dict entry by our key
    (`...embedding_bags.embedding_bags.<table>.weight`); the values are views of the live
    shards, so the renamed dict writes into the peer's tables."""
    ours = {key.replace("embedding_bag_collection.embedding_bags", "embedding_bags.embedding_bags"):
            value for key, value in dmp.state_dict().items()}
    parts = [part for lookup in lookups_of(model_cfg, spec) for part in lookup.tables]
    init_tables(SimpleNamespace(state_dict=lambda: ours), parts, seed)


def torchrec_batch(batch: Batch) -> TorchrecBatch:
    """Our batch as torchrec's datasets deliver one (`DLRMTrain` reads these three fields)."""
    return TorchrecBatch(dense_features=batch.dense, sparse_features=batch.sparse,
                         labels=batch.labels)


class PeerStep:
    """One `TrainPipelineSparseDist.progress`: it keeps two batches ahead of the one it trains
    (the first call takes three), so the loss returned is of the batch taken two calls before;
    zero_grad, forward, backward (the fused embedding update inside) and the dense step, then
    the schedule, as the example's loop."""

    def __init__(self, dmp: DistributedModelParallel, pipeline: TrainPipelineSparseDist,
                 schedule: LambdaLR) -> None:
        self.dmp, self.pipeline, self.schedule = dmp, pipeline, schedule

    def __call__(self, batches: Iterator[Batch]) -> torch.Tensor:
        loss, _, _ = self.pipeline.progress(map(torchrec_batch, batches))
        self.schedule.step()
        return loss
