"""Bytes the embedding exchange sends per training step, on each rank, for both paths, and the
path `parallel.exchange: auto` picks. Plain Python (no torch), for `plan`.

With P ranks, a local batch of B samples and e bytes per value (parallel.comm_precision), a rank
owning pooled columns C_r of C in all (a table's width times its pooled vectors per sample):

- pooled: forward, its pooled vectors of every other rank's samples, (P - 1) B C_r e; backward,
  the gradients of its own samples' vectors owned elsewhere, B (C - C_r) e.
- des: forward, a reduce-scatter of its partial sums ([P B, K] in, [B, K] out): (P - 1) B K e;
  backward, the all-gather of their gradients: the same. K = H, the first top layer's width,
  for `cat`; D + 2 for `fm`.

Summed over ranks, des / pooled = P K / C: H P / (T D) for `cat`, (D + 2) / (T_p D) for `fm`
with T_p = T / P tables per rank (and the first-order tables' columns in C).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from dlrm_hybrid.config import RETRIEVAL_KINDS, ConfigError
from dlrm_hybrid.parallel.plan import Plan, format_bytes


@dataclass(frozen=True)
class ExchangeBytes:
    forward: List[int]  # bytes each rank sends per step
    backward: List[int]

    @property
    def total(self) -> int:
        return sum(self.forward) + sum(self.backward)

    @property
    def per_rank(self) -> List[int]:
        return [f + b for f, b in zip(self.forward, self.backward)]


def value_bytes(comm_precision: str) -> int:
    """Bytes per exchanged value, forward and backward (fp16/bf16 codecs halve both)."""
    return 4 if comm_precision == "fp32" else 2


def partial_width(model_cfg) -> Optional[int]:
    """Values per sample a des owner sends: H for cat, D + 2 for fm; None where des does not
    apply (dot and dcn multiply vectors of different tables first; a two-tower model's towers
    read the pooled vectors)."""
    if (model_cfg.kind in RETRIEVAL_KINDS or model_cfg.sequence != "none"
            or model_cfg.mixed_dimensions.temperature > 0):
        return None
    if model_cfg.interaction == "cat":
        return model_cfg.top_mlp[0]
    if model_cfg.interaction == "fm":
        return model_cfg.embedding_dim + 2
    return None


def exchange_bytes(plan: Plan, cfg) -> Dict[str, ExchangeBytes]:
    """{"pooled": ..., "des": ...} (des only where it applies) for `plan`'s world and batch."""
    world, e = plan.world_size, value_bytes(cfg.parallel.comm_precision)
    batch = plan.batch_size // world
    owned = [sum(s.cols * plan.tables[s.table].bags for s in plan.shards_on(r))
             for r in range(world)]
    out = {"pooled": ExchangeBytes([(world - 1) * batch * c * e for c in owned],
                                   [batch * (sum(owned) - c) * e for c in owned])}
    width = partial_width(cfg.model)
    if width is not None:
        per_rank = (world - 1) * batch * width * e
        out["des"] = ExchangeBytes([per_rank] * world, [per_rank] * world)
    return out


def choose_exchange(cfg, plan: Plan) -> Tuple[str, str]:
    """The exchange a job uses and why."""
    asked = cfg.parallel.exchange
    if asked == "des" and plan.replicated:
        raise ConfigError(f"parallel.exchange: des needs every table sharded, the plan replicates "
                          f"{', '.join(sorted(plan.replicated))}; use parallel.exchange=pooled or auto")
    if asked != "auto":
        return asked, f"parallel.exchange={asked}"
    m = cfg.model
    if partial_width(m) is None:
        return "pooled", (f"the {m.kind} model needs the pooled vectors" if m.kind in RETRIEVAL_KINDS
                          else "the sequence feature needs the pooled vectors"
                          if m.sequence != "none"
                          else "mixed-dimension tables' vectors are projected after the exchange"
                          if m.mixed_dimensions.temperature > 0
                          else f"interaction {m.interaction} needs the pooled vectors")
    if any(r.technique == "qr" and r.operation != "concat" for r in m.compositional):
        return "pooled", "qr mult and add features need their parts' pooled vectors"
    if cfg.train.cuda_graphs == "true" or cfg.train.precision == "fp16":
        return "pooled", "des runs neither under CUDA graphs nor with fp16"
    if cfg.parallel.dense != "ddp":
        return "pooled", f"des reads the top MLP that parallel.dense={cfg.parallel.dense} shards"
    if plan.replicated:
        return "pooled", ("des does not run with replicated tables (each rank looks them "
                          "up for its own samples: no owner sends their partial sums)")
    both = exchange_bytes(plan, cfg)
    pooled, des = both["pooled"].total, both["des"].total
    if des < pooled:
        return "des", f"auto: {pooled / des:.2f}x fewer bytes than pooled"
    return "pooled", ("auto: one rank exchanges nothing" if pooled == 0
                      else f"auto: des would send {des / pooled:.2f}x the bytes")


def describe_exchange(plan: Plan, cfg) -> str:
    """Both paths' bytes per step (mean and max over ranks) and the one training would use."""
    lines = [f"embedding exchange per step, bytes a rank sends (forward + backward; "
             f"{plan.world_size} ranks, global batch {plan.batch_size:,}, "
             f"{cfg.parallel.comm_precision}):"]
    for path, counted in exchange_bytes(plan, cfg).items():
        per_rank = counted.per_rank
        lines.append(f"  {path:<6} {format_bytes(sum(counted.forward) / plan.world_size)} + "
                     f"{format_bytes(sum(counted.backward) / plan.world_size)} per rank "
                     f"(max {format_bytes(max(per_rank))})")
    path, why = choose_exchange(cfg, plan)
    lines.append(f"  training uses {path} ({why})")
    return "\n".join(lines)
