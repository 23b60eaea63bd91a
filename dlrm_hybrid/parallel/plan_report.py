"""Human-readable plans: the per-rank table rank 0 prints, the side-by-side comparison of
strategies, a bar chart of per-rank memory and all-to-all load, and what compositional
embeddings save."""

from __future__ import annotations

from pathlib import Path
from typing import List, Union

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.interactions.interaction_meta import HISTORY
from dlrm_hybrid.model.compositional import FeatureLookup
from dlrm_hybrid.model.compositional import describe as describe_lookup
from dlrm_hybrid.parallel.cost_model import StepTime
from dlrm_hybrid.parallel.explain import explain
from dlrm_hybrid.parallel.plan import Plan, format_bytes
from dlrm_hybrid.parallel.tables import BYTES_PER_WEIGHT, PER_SHARD_ROW_STATE, TableSpec
from dlrm_hybrid.output_paths import temporary_beside


def describe(plan: Plan) -> str:
    """Per rank: shards, memory, all-to-all bytes sent and the modeled step time in its parts;
    per host totals; replicated tables once; imbalances, the modeled max and the constants;
    a warning where a table's split changes its updates."""
    hosts = f", {plan.world_size // plan.gpus_per_node} hosts x {plan.gpus_per_node}" \
        if plan.gpus_per_node else ""
    modeled = plan.step_time()
    sent = plan.loads[1]
    replicated = [plan.tables[n] for n in sorted(plan.replicated)]
    lines = [f"plan ({plan.strategy}): {len(plan.tables)} tables, {len(plan.shards)} shards on "
             f"{plan.world_size} ranks{hosts}; budget {format_bytes(plan.budget_bytes)} per rank; "
             f"traffic per step at global batch {plan.batch_size:,}; modeled ms per step (all-to-all "
             f"intra and inter host)",
             f"{'host':>4} {'rank':>5} {'shards':>6} {'rows':>13} {'weights':>10} {'optimizer':>10} "
             f"{'total':>10} {'budget':>7} {'a2a sent':>10} {'step':>7} {'lookup':>7} "
             f"{'intra':>7} {'inter':>7} {'fixed':>7} {'allred':>7}  tables"]
    rep_rows = sum(t.rows for t in replicated)
    rep_weights = sum(t.rows * t.dim * BYTES_PER_WEIGHT[t.precision] for t in replicated)
    for rank in range(plan.world_size):
        shards = plan.shards_on(rank)
        specs = [plan.tables[s.table] for s in shards]
        rows = sum(t.rows for t in specs) + rep_rows
        weights = rep_weights + sum(t.rows * s.cols * BYTES_PER_WEIGHT[t.precision]
                                    for t, s in zip(specs, shards))
        total = plan.loads[0, rank]
        names = ", ".join(s.table if s.cols == plan.tables[s.table].dim
                          else f"{s.table}[{s.col_offset}:{s.col_offset + s.cols}]" for s in shards)
        times = " ".join(f"{1e3 * getattr(modeled, part)[rank]:>7.3f}" for part in modeled.PARTS)
        lines.append(f"{plan.host_of(rank):>4} {rank:>5} {len(shards):>6} {rows:>13,} "
                     f"{format_bytes(weights):>10} {format_bytes(total - weights):>10} "
                     f"{format_bytes(total):>10} {100 * total / plan.budget_bytes:>6.1f}% "
                     f"{format_bytes(sent[rank]):>10} {1e3 * modeled.total_s[rank]:>7.3f} "
                     f"{times}  {names}")
        if plan.gpus_per_node and (rank + 1) % plan.gpus_per_node == 0:
            host = slice(rank + 1 - plan.gpus_per_node, rank + 1)
            lines.append(f"{plan.host_of(rank):>4} {'all':>5} {'':>6} {'':>13} {'':>10} {'':>10} "
                         f"{format_bytes(plan.loads[0, host].sum()):>10} {'':>7} "
                         f"{format_bytes(sent[host].sum()):>10}  (host total)")
    if replicated:
        lines.append(f"replicated on every rank (data_parallel, in each rank's figures): "
                     f"{', '.join(t.name for t in replicated)}")
    lines.append(_imbalance_line(plan))
    lines.append(_modeled_line(plan, modeled, float(sent.sum())))
    split = [n for n in sorted(plan.tables) if plan.sharding_type(n) == "column_wise"
             and plan.tables[n].optimizer in PER_SHARD_ROW_STATE]
    if split:
        lines.append(f"warning: {', '.join(split)} split column-wise keep {plan.tables[split[0]].optimizer} "
                     f"state per row of each shard, so their updates differ from an unsplit "
                     f"run's; to avoid it give ranks more memory (parallel.memory_per_rank), use "
                     f"sgd or adagrad, or shrink them (model.compositional: qr or hash)")
    return "\n".join(lines)


def _modeled_line(plan: Plan, modeled: StepTime, sent: float) -> str:
    d, slow = plan.device, int(modeled.total_s.argmax())
    return (f"modeled step {plan.strategy}: max {1e3 * modeled.max_s:.3f} ms (rank {slow}), mean "
            f"{1e3 * modeled.total_s.mean():.3f} ms, embeddings only; all-to-all "
            f"{sent / 2**20:.1f} MiB sent in all; {d.name}: memory "
            f"{_rate(d.memory_bandwidth)}, in host {_rate(d.intra_host_bandwidth)}, "
            f"across hosts {_rate(d.inter_host_bandwidth)}, {1e6 * d.shard_fixed_s:g} us "
            f"per shard, {1e6 * d.message_fixed_s:g} us per message ({d.source})")


def _rate(bytes_per_s: float) -> str:
    """3.35 TB/s, 450 GB/s, 1.91 GB/s: decimal units, as datasheets give bandwidths."""
    return (f"{bytes_per_s / 1e12:.3g} TB/s" if bytes_per_s >= 1e12
            else f"{bytes_per_s / 1e9:.3g} GB/s")


def explain_table(plan: Plan, name: str, split_rowwise: bool, replicate: bool) -> str:
    """Each way to shard `name` with the modeled step time of the plan were it sharded so."""
    t = plan.tables[name]
    lines = [f"{name}: {t.rows:,} rows x {t.dim}, {t.optimizer}, {t.hotness:g} ids per sample, "
             f"{format_bytes(t.bytes)}; the rest of the plan as it is, modeled ms per step at "
             f"the slowest rank ({plan.device.name}):",
             f"  {'sharding':<16} {'step':>8} {'lookup':>7} {'intra':>7} {'inter':>7} "
             f"{'fixed':>7} {'allred':>7}  ranks"]
    for option in explain(plan, name, split_rowwise, replicate):
        mark = "*" if option.chosen else " "
        if option.time is None:
            lines.append(f"{mark} {option.sharding:<16} {'-':>8}  {option.note}")
            continue
        slow = int(option.time.total_s.argmax())
        parts = " ".join(f"{1e3 * getattr(option.time, p)[slow]:>7.3f}" for p in StepTime.PARTS)
        note = f"  ({option.note})" if option.note else ""
        lines.append(f"{mark} {option.sharding:<16} {1e3 * option.time.max_s:>8.3f} {parts}  "
                     f"{option.ranks}{note}")
    lines.append("* the plan's choice")
    return "\n".join(lines)


def describe_lookups(lookups: List[FeatureLookup], cfg) -> str:
    """Each hashed, QR or mixed-dimension feature's tables, and the bytes (weights and optimizer
    state) they take against the full table's; "" when every table is full."""
    size = lambda name, rows, dim: TableSpec(name, rows, dim, cfg.model.embedding_precision,  # noqa: E731
                                             cfg.optim.embedding).bytes
    kinds = (["compositional"] if any(lk.technique != "full" for lk in lookups) else []) + (
        ["mixed-dimension"] if any(p.projected for lk in lookups for p in lk.parts) else [])
    lines = [f"{' and '.join(kinds)} embeddings (weights + optimizer state: full table -> "
             f"parts):"]
    full_total = parts_total = 0
    for lookup in lookups:
        text = describe_lookup(lookup)
        if text is None:
            continue
        full = size(lookup.feature, lookup.rows, lookup.dim)
        parts = sum(size(p.table, p.rows, p.dim) for p in lookup.parts)
        full_total, parts_total = full_total + full, parts_total + parts
        lines.append(f"  {text}: {format_bytes(full)} -> {format_bytes(parts)}")
    if len(lines) == 1:
        return ""
    saved = full_total - parts_total
    lines.append(f"  {len(lines) - 1} features: {format_bytes(full_total)} -> "
                 f"{format_bytes(parts_total)}, {format_bytes(saved)} saved "
                 f"({100 * saved / max(full_total, 1):.1f}%)")
    return "\n".join(lines)


def describe_towers(plan: Plan, lookups: List[FeatureLookup], kind: str = "two_tower") -> str:
    """two_tower: one line per tower (user, item): its tables' count, rows and bytes (weights
    and optimizer state), and where each table is; "" for the ranker, whose features belong
    to no tower. hstu: the sequence's items, then the item table, so."""
    lines = []
    for side in ("user", "item"):
        names = [part.table for lookup in lookups if lookup.feature.startswith(f"{side}_")
                 for part in lookup.tables]
        history = [(part.table, len(part.keys) - 1) for lookup in lookups
                   for part in lookup.parts if len(part.keys) > 1 and part.keys[-1].startswith(
                       HISTORY)]
        if side == "user" and history:
            table, length = history[0]
            lines.append((f"sequence: the user's last {length} items" if kind == "hstu" else
                          f"user tower: no tables of its own, the last {length} items of the "
                          f"user's history") + f" looked up in {table} ({_where(plan, table)})")
        if not names:
            continue
        specs = [plan.tables[n] for n in names]
        lines.append(f"{'items' if kind == 'hstu' else side + ' tower'}: {len(names)} tables, "
                     f"{sum(t.rows for t in specs):,} rows, "
                     f"{format_bytes(sum(t.bytes for t in specs))}: "
                     f"{', '.join(f'{n} {_where(plan, n)}' for n in names)}")
    return "\n".join(lines)


def _where(plan: Plan, table: str) -> str:
    if table in plan.replicated:
        return "on every rank (replicated)"
    ranks = sorted({s.rank for s in plan.shards_of(table)})
    return f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def compare(plans: List[Plan]) -> str:
    """Per-rank memory and all-to-all of several plans side by side, then their imbalances."""
    head = f"{'rank':>5} " + " ".join(f"{p.strategy + ' memory':>16} {p.strategy + ' a2a':>14}"
                                      for p in plans)
    lines = [head]
    for rank in range(plans[0].world_size):
        lines.append(f"{rank:>5} " + " ".join(
            f"{format_bytes(p.loads[0, rank]):>16} {format_bytes(p.loads[1, rank]):>14}"
            for p in plans))
    lines += [_imbalance_line(p) for p in plans]
    return "\n".join(lines)


def _imbalance_line(plan: Plan) -> str:
    i = plan.imbalance()
    return (f"imbalance {plan.strategy} (max/mean): memory {i['memory']:.3f} "
            f"a2a {i['a2a']:.3f} lookup {i['lookup']:.3f}")


def plot_format(path: Union[str, Path]) -> str:
    """The image format `path`'s suffix names (png without one), or a one-line error."""
    from matplotlib.backend_bases import FigureCanvasBase

    kind = Path(path).suffix[1:].lower() or "png"
    if kind not in FigureCanvasBase.get_supported_filetypes():
        raise ConfigError(f"--plot: {path} is no image name matplotlib writes; end it in one of "
                          f"{', '.join('.' + k for k in FigureCanvasBase.get_supported_filetypes())}")
    return kind


def plot(plans: List[Plan], path: Path) -> None:
    """Bars of per-rank memory and all-to-all bytes, one group per strategy, written whole or
    not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.35 * plans[0].world_size + 3), 6),
                             sharex=True)
    ranks = np.arange(plans[0].world_size)
    width = 0.8 / len(plans)
    for k, plan in enumerate(plans):
        for ax, row, scale in ((axes[0], 0, 2**30), (axes[1], 1, 2**20)):
            ax.bar(ranks + k * width, plan.loads[row] / scale, width,
                   label=f"{plan.strategy} (max/mean {plan.imbalance()['memory' if row == 0 else 'a2a']:.2f})")
    axes[0].axhline(plans[0].budget_bytes / 2**30, color="red", linestyle="--", label="budget")
    axes[0].set_ylabel("tables + optimizer, GiB")
    axes[1].set_ylabel("all-to-all per step, MiB")
    axes[1].set_xlabel("rank")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"{len(plans[0].tables)} tables on {plans[0].world_size} ranks, "
                 f"global batch {plans[0].batch_size:,}")
    fig.tight_layout()
    partial = temporary_beside(path)
    try:
        fig.savefig(partial, dpi=100, format=plot_format(path))
        partial.replace(path)
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)
