"""How the dense modules (bottom MLP, interaction, top MLP) are data-parallel: `parallel.dense`.

ddp: every rank holds them whole and all-reduces their gradients (torchrec's DMP wraps them in
DDP). fsdp: torch's FSDP2 `fully_shard` splits each parameter's rows over the ranks, all-gathers
a module's parameters just before it runs (and again in the backward) and reduce-scatters its
gradients, so parameters, gradients and the dense optimizer state (DTensor shards) cost 1/P of
ddp's per rank. hsdp: a 2-D mesh, sharded within groups of `parallel.hsdp_shard_size` ranks
(one host's by default, where the all-gathers are cheap) and replicated across the groups.
The embedding tables stay sharded by the plan either way.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard



def dense_units(model: nn.Module) -> List[nn.Module]:
    """The modules sharded as one group each, bottom-up: mixed-dimension tables' projections
    (where the model has them), the bottom MLP, the interaction (a stack's `layers` one by one,
    then the interaction itself if it holds parameters besides them; a parameter-free one is
    left out; model.task_dot_dim's per-task dots wrap a stack), the top MLP."""
    interaction = model.interaction
    layers = getattr(getattr(interaction, "inner", interaction), "layers", None)
    layers = list(layers) if isinstance(layers, nn.ModuleList) else []
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    widen = getattr(model, "widen_parts", None)
    units = ([widen] if widen is not None else []) + [model.dense_arch, *layers]
    if any(id(p) not in in_layers for p in interaction.parameters()):
        units.append(interaction)
    return [*units, model.over_arch]


def dense_param_names(model: nn.Module) -> List[str]:
    """The dense modules' parameter names in `model` (what DDP must leave to FSDP2)."""
    return [name for name, _ in model.named_parameters()
            if name.split(".")[0] in ("widen_parts", "dense_arch", "interaction", "over_arch")]


def shard_dense(model: nn.Module, mode: str, device: torch.device,
                layout: Tuple[int, int]) -> None:
    """`fully_shard` the dense modules of `model` in place over a mesh of `layout` (fsdp: 1-D,
    hsdp: (replicate, shard)); a job of one rank too, on a mesh of one. Each group frees its
    gathered parameters after its forward: holding only the shards between uses is what the
    modes are for."""
    mesh = (init_device_mesh(device.type, layout[1:], mesh_dim_names=("shard",)) if mode == "fsdp"
            else init_device_mesh(device.type, layout, mesh_dim_names=("replicate", "shard")))
    for unit in dense_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
