"""The dense part's memory per rank (bottom MLP, interaction, top MLP), from the config alone:
`plan` reports it without torch, and a training job refuses a dense part that does not fit in
`parallel.reserve_per_rank` before it builds anything on the device.

The parameter shapes are those model/dlrm.py builds (torchrec's DenseArch, OverArch and cross
nets; DHEN as docs/dhen.md writes it out), grouped in the units fully_shard wraps: the bottom
MLP, the interaction (each DHEN layer on its own), the top MLP. Per rank, in fp32: parameters
(4 B), gradients (4 B) and the dense optimizer's state (`STATE_BYTES`); ddp holds all of it on
every rank; fsdp/hsdp hold each parameter's rows ceil(rows / shards) (fully_shard pads dim 0 to a
multiple of the shard count), plus, transiently, the largest unit's full parameters and
gradients while it is all-gathered. Activations are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from dlrm_hybrid.config import RETRIEVAL_KINDS, ConfigError, parse_bytes
from dlrm_hybrid.data.interactions.interaction_meta import HISTORY
from dlrm_hybrid.model.alignment import aligned
from dlrm_hybrid.model.compositional import lookups_of
from dlrm_hybrid.parallel.plan import format_bytes

Shape = Tuple[int, ...]
STATE_BYTES = {"sgd": 0, "adagrad": 4, "adam": 8}  # per parameter: Adagrad's sum, Adam's 2 moments
PARAM_BYTES = GRAD_BYTES = 4
MODES = ("ddp", "fsdp", "hsdp")


@dataclass(frozen=True)
class Unit:
    """One fully_shard unit: its modules' parameter shapes, in module order."""

    name: str
    modules: Dict[str, List[Shape]]

    @property
    def shapes(self) -> List[Shape]:
        return [s for shapes in self.modules.values() for s in shapes]

    @property
    def count(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


@dataclass(frozen=True)
class DenseMemory:
    """One rank's dense bytes under `mode`, one copy sharded over `shards` ranks (ddp: 1)."""

    mode: str
    shards: int
    parameters: int
    gradients: int
    optimizer: int
    transient: int  # the largest unit's full parameters and gradients while all-gathered
    largest: str  # that unit

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.transient


def _linear(n_in: int, n_out: int, bias: bool = True) -> List[Shape]:
    return [(n_out, n_in), (n_out,)] if bias else [(n_out, n_in)]


def _mlp(n_in: int, sizes: List[int]) -> List[Shape]:
    """torchrec's MLP (and DenseArch): Linear + bias per layer."""
    shapes = []
    for n_out in sizes:
        shapes += _linear(n_in, n_out)
        n_in = n_out
    return shapes


def _last_layer(n_in: int, m) -> List[Shape]:
    """The top MLP's logit layer, or with model.tasks the task heads in its place (and the
    MMoE experts and gates): model/task_heads.py."""
    if not m.tasks:
        return _linear(n_in, 1)
    shapes, head_in = [], n_in
    if m.mmoe.experts:
        for _ in range(m.mmoe.experts):
            shapes += _mlp(n_in, m.mmoe.expert_mlp)
        shapes += _linear(n_in, m.mmoe.experts * len(m.tasks))
        head_in = m.mmoe.expert_mlp[-1]
    for task in m.tasks:
        shapes += _mlp(head_in, [*task.head, 1])
    return shapes


def _cross_net(n: int, layers: int, rank: int, experts: int) -> List[Shape]:
    """torchrec's LowRankCrossNet (experts 1) or LowRankMixtureCrossNet."""
    if experts == 1:
        return [(n, rank), (rank, n), (n,)] * layers
    per_layer = [(experts, n, rank), (experts, rank, n), (n, 1), (experts, rank, rank)]
    return per_layer * layers + [(1, n)] * experts  # the gates: Linear(n, 1, bias=False) each


def _dhen_module(name: str, l_in: int, l_out: int, d: int) -> List[Shape]:
    """docs/dhen.md's parameters of one module, reading [B, l_in, d] and returning [B, l_out, d]."""
    w = [(l_out, l_in)]
    if name == "linear":
        return w
    if name == "self_attention":  # nn.TransformerEncoderLayer(d, heads, 4 d)
        return [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,),
                (d,), (d,), (d,), (d,)] + w
    if name == "conv":
        return [(1, 1, 3, 3), (1,)] + w
    if name == "dot":
        return _linear(l_in * (l_in - 1) // 2, l_out * d)
    if name == "dcn":
        return [(l_out, d), (l_out, d)]
    raise ValueError(f"model.dhen.modules: unknown module {name!r}")


def _dhen_layers(cfg, features: int, d: int) -> List[Unit]:
    width = cfg.width or features + 1
    units = []
    for i in range(cfg.layers):
        l_in = features + 1 if i == 0 else width
        modules = {name: _dhen_module(name, l_in, width, d) for name in cfg.modules}
        if cfg.ensemble == "concat":
            modules["concat projection"] = [(width, len(cfg.modules) * width)]
        if l_in != width:
            modules["skip"] = [(width, l_in)]
        modules["norm"] = [(d,), (d,)]
        units.append(Unit(f"dhen layer {i + 1}", modules))
    return units


def model_dense_units(model_cfg, spec) -> List[Unit]:
    """The dense units of the configured model over a dataset's features (`spec`)."""
    if model_cfg.kind == "hstu":
        return hstu_units(model_cfg, model_cfg.hstu.max_length, model_cfg.hstu.time_buckets)
    if model_cfg.kind != "two_tower" and model_cfg.sequence != "none":
        # the history's item and action slots fold into the sequence's one vector
        slots = sum(n.startswith(HISTORY) for n in spec.feature_names)
        return (dense_units(model_cfg, spec.num_dense, len(spec.cardinalities) - 2 * slots + 1)
                + hstu_units(model_cfg, slots + 1, 0, candidate=True))
    if model_cfg.kind != "two_tower":
        return (dense_units(model_cfg, spec.num_dense, len(spec.cardinalities))
                + projection_units(lookups_of(model_cfg, spec)))
    units = []
    for side in ("user", "item"):
        tower = getattr(model_cfg, f"{side}_tower")
        width = (tower.embedding_dim or model_cfg.embedding_dim) * sum(
            name.startswith(f"{side}_") for name in spec.feature_names)
        units.append(Unit(f"{side} tower", {"mlp": _mlp(width, tower.mlp)}))
    return units


def projection_units(lookups) -> List[Unit]:
    """Mixed-dimension tables' projections (model/mixed_dimensions.py), one [out, in] weight
    per narrowed table; none without them."""
    shapes = [(p.projected, p.dim) for lookup in lookups for p in lookup.parts if p.projected]
    return [Unit("table projections", {"projection": shapes})] if shapes else []


def hstu_units(model_cfg, length: int, time_buckets: int, candidate: bool = False
               ) -> List[Unit]:
    """HSTU (model/hstu.py) over sequences of `length`: the position table (and the ranker's
    candidate marker), then per layer W_uvqk, the output linear and the relative bias
    (positions and time buckets)."""
    h, d = model_cfg.hstu, model_cfg.embedding_dim
    dqk, dv = h.attention_dim or d // h.heads, h.linear_dim or d // h.heads
    units = [Unit("hstu positions", {"position": [(length, d)],
                                     **({"candidate": [(d,)]} if candidate else {})})]
    for i in range(h.layers):
        units.append(Unit(f"hstu layer {i + 1}", {
            "uvqk": [(d, h.heads * (2 * dv + 2 * dqk))], "out": _linear(h.heads * dv, d),
            "rab": [(length,), (time_buckets + 1,)]}))
    return units


def dense_units(model_cfg, num_dense: int, features: int) -> List[Unit]:
    """The dense parameters' shapes for `features` categorical features (F) and `num_dense`
    dense ones, unit by unit."""
    m, d = model_cfg, model_cfg.embedding_dim
    bottom = m.bottom_mlp[-1]
    n = features + 1
    top = m.top_mlp
    interaction: List[Unit] = []
    if m.interaction == "dot":
        width = aligned(bottom + (n * (n + 1) // 2 if m.self_interaction else n * (n - 1) // 2))
    elif m.interaction == "cat":
        width = bottom + features * d
    elif m.interaction == "fm":
        width = bottom + 2
    elif m.interaction == "dhen":
        interaction = _dhen_layers(m.dhen, features, d)
        width = (m.dhen.width or n) * d
    elif m.interaction == "dcn":
        width = n * d
        interaction = [Unit("dcn cross network",
                            {"cross": _cross_net(width, m.dcn.layers, m.dcn.rank, m.dcn.experts)})]
    else:
        raise ValueError(f"model.interaction: unknown interaction {m.interaction!r}")
    if m.interaction == "dcn" and m.dcn.structure == "parallel":
        hidden = top[:-1]  # on x_0, beside the cross net; the last layer reads both
        top_shapes = _mlp(width, hidden) + _last_layer(width + (hidden[-1] if hidden else width), m)
    else:
        top_shapes = _mlp(width, top[:-1]) + _last_layer(top[-2] if len(top) > 1 else width, m)
    if m.tasks and m.task_dot_dim:  # model/task_dots.py: projections, then per-pair weights
        interaction.append(Unit("per-task dots", {"projection": [(len(m.tasks) * m.task_dot_dim,
                                                                   d)]}))
        top_shapes = top_shapes + [(len(m.tasks), n * (n - 1) // 2)]
    return [Unit("bottom MLP", {"mlp": _mlp(aligned(num_dense), m.bottom_mlp)}), *interaction,
            Unit("top MLP", {"mlp": top_shapes})]


def dense_layout(mode: str, hsdp_shard_size: int, world_size: int,
                 local_world_size: int) -> Tuple[int, int]:
    """(replicas, shards): how many copies of the dense modules the job keeps, and over how
    many ranks each copy is split. hsdp's groups: `hsdp_shard_size` ranks, 0 one host's."""
    if mode == "ddp":
        return world_size, 1
    if mode == "fsdp":
        return 1, world_size
    shards = hsdp_shard_size or local_world_size
    if world_size % shards:
        raise ConfigError(f"parallel.hsdp_shard_size: groups of {shards} ranks do not divide "
                          f"the world size {world_size}; use a divisor of {world_size}")
    return world_size // shards, shards


def per_rank(units: List[Unit], mode: str, shards: int, optimizer: str) -> DenseMemory:
    """One rank's bytes: under ddp everything; under fsdp/hsdp its padded share of each
    parameter and the largest unit's all-gathered parameters and gradients."""
    if mode == "ddp":
        local = sum(u.count for u in units)
        transient, largest = 0, ""
    else:
        local = sum(_share(s, shards) for u in units for s in u.shapes)
        full = {u.name: sum(_share(s, shards) * shards for s in u.shapes) for u in units}
        largest = max(full, key=full.get)
        transient = full[largest] * (PARAM_BYTES + GRAD_BYTES)
    return DenseMemory(mode, 1 if mode == "ddp" else shards, local * PARAM_BYTES,
                       local * GRAD_BYTES, local * STATE_BYTES[optimizer], transient, largest)


def _share(shape: Shape, shards: int) -> int:
    """Elements of one rank's shard: dim 0 padded to a multiple of `shards`, split evenly."""
    return math.ceil(shape[0] / shards) * math.prod(shape[1:])


def all_modes(cfg, spec, world_size: int, ranks_per_host: int) -> Dict[str, DenseMemory]:
    units = model_dense_units(cfg.model, spec)
    return {mode: per_rank(units, mode, dense_layout(mode, cfg.parallel.hsdp_shard_size, world_size,
                                                     ranks_per_host)[1], cfg.optim.dense)
            for mode in MODES}


def describe_dense(cfg, spec, world_size: int, ranks_per_host: Optional[int]) -> str:
    """`plan`'s dense block: parameters by unit and module, the configured mode's bytes per rank,
    the other modes' in one line, and whether they fit in parallel.reserve_per_rank."""
    units = model_dense_units(cfg.model, spec)
    memory = all_modes(cfg, spec, world_size, ranks_per_host or world_size)
    mode, reserve = cfg.parallel.dense, cfg.parallel.reserve_per_rank
    mine = memory[mode]
    lines = [f"dense part: {sum(u.count for u in units):,} parameters (fp32)"]
    for u in units:
        parts = ", ".join(f"{name} {sum(math.prod(s) for s in shapes):,}"
                          for name, shapes in u.modules.items() if shapes)
        lines.append(f"  {u.name:<18} {u.count:>13,}" + (f"  ({parts})" if len(u.modules) > 1
                                                          else ""))
    lines.append(f"dense per rank, parallel.dense={mode}{_over(mine)}: "
                 f"{_bytes(mine, cfg.optim.dense)}; activations not counted")
    others = [m for m in runnable_modes(cfg.model) if m != mode]
    lines.append("other modes per rank: " + ("; ".join(
        f"{m} {format_bytes(memory[m].total)}{_over(memory[m])}" for m in others) if others else
        "none (this model's dense part runs under ddp only)"))
    if mine.total <= parse_bytes(reserve, "parallel.reserve_per_rank"):
        lines.append(f"dense part fits in parallel.reserve_per_rank {reserve}")
    else:
        lines.append(f"dense part does not fit in parallel.reserve_per_rank {reserve}: "
                     f"{_remedy(memory, mode, reserve, runnable_modes(cfg.model))}")
    return "\n".join(lines)


def runnable_modes(model_cfg) -> Tuple[str, ...]:
    """The parallel.dense modes the model runs with: the retrieval kinds and the ranker's
    sequence feature read their dense layers outside FSDP's reach (config_checks refuses it)."""
    if model_cfg.kind in RETRIEVAL_KINDS or model_cfg.sequence != "none":
        return ("ddp",)
    return MODES


def _bytes(m: DenseMemory, optimizer: str) -> str:
    text = (f"{format_bytes(m.total)} = parameters {format_bytes(m.parameters)} + gradients "
            f"{format_bytes(m.gradients)} + {optimizer} state {format_bytes(m.optimizer)}")
    if m.transient:
        text += f" + all-gather of the largest unit ({m.largest}) {format_bytes(m.transient)}"
    return text


def _over(m: DenseMemory) -> str:
    return f" (sharded over {m.shards} ranks)" if m.mode != "ddp" else " (replicated)"


def _remedy(memory: Dict[str, DenseMemory], mode: str, reserve: str,
            modes: Tuple[str, ...] = MODES) -> str:
    """The other modes (of `modes`) that would fit, or a reserve as large as the need."""
    need = parse_bytes(reserve, "parallel.reserve_per_rank")
    fitting = [f"parallel.dense={m} ({format_bytes(memory[m].total)})" for m in modes
               if m != mode and memory[m].total <= need]
    use = f"use {' or '.join(fitting)}, or " if fitting else ""
    return f"{use}raise parallel.reserve_per_rank to {_rounded_up(memory[mode].total)}"


def _rounded_up(n: int) -> str:
    """A size at least `n` in format_bytes' style, so that it can be set as it is."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{math.ceil(10 * n / size) / 10:g}{unit}"
    return f"{n}B"


def require_dense_fits(cfg, spec, world_size: int, ranks_per_host: int) -> None:
    """A training job's check, before the model reaches the device: one line naming the need,
    the reserve and the way out."""
    memory = all_modes(cfg, spec, world_size, ranks_per_host)
    mode, reserve = cfg.parallel.dense, cfg.parallel.reserve_per_rank
    need = memory[mode]
    if need.total > parse_bytes(reserve, "parallel.reserve_per_rank"):
        gathered = f", {need.largest} gathered" if need.transient else ""
        raise ConfigError(f"parallel.reserve_per_rank: the dense part needs "
                          f"{format_bytes(need.total)} per rank under parallel.dense={mode} "
                          f"(parameters, gradients, {cfg.optim.dense} state{gathered}), more than "
                          f"the {reserve} kept free of tables; "
                          f"{_remedy(memory, mode, reserve, runnable_modes(cfg.model))}")
