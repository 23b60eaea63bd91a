"""Plans as JSON: what `plan --out` writes and `train --set parallel.plan=FILE` uses unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, List

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.cost_model import DEVICES, DeviceConstants
from dlrm_hybrid.parallel.column_split import column_split_counts
from dlrm_hybrid.parallel.plan import Plan, Shard
from dlrm_hybrid.parallel.tables import REPLICABLE_OPTIMIZERS, TableSpec
from dlrm_hybrid.output_paths import temporary_beside

SHARDINGS = ("table_wise", "column_wise", "data_parallel")  # what sharding.py hands torchrec


def plan_to_dict(plan: Plan) -> dict:
    tables = {}
    for name, spec in plan.tables.items():
        shards = sorted(plan.shards_of(name), key=lambda s: s.col_offset)
        tables[name] = {
            "sharding": plan.sharding_type(name), "ranks": [s.rank for s in shards],
            "columns": [s.cols for s in shards], "bytes": spec.bytes, "rows": spec.rows,
            "dim": spec.dim, "precision": spec.precision, "optimizer": spec.optimizer,
            "hotness": spec.hotness, "bags": spec.bags,
        }
    modeled = plan.step_time()
    ranks = [{"rank": r, "host": plan.host_of(r), "tables": plan.tables_on(r),
              "bytes": int(plan.loads[0, r]), "a2a_bytes": int(plan.loads[1, r]),
              "lookup_bytes": int(plan.loads[2, r]),
              "step_s": {part: float(getattr(modeled, part)[r]) for part in modeled.PARTS}}
             for r in range(plan.world_size)]
    return {"world_size": plan.world_size, "gpus_per_node": plan.gpus_per_node,
            "strategy": plan.strategy, "budget_bytes": plan.budget_bytes,
            "batch_size": plan.batch_size, "tables": tables, "ranks": ranks,
            "imbalance": plan.imbalance(), "modeled_max_step_s": modeled.max_s,
            "device": dataclasses.asdict(plan.device)}


def save_plan(plan: Plan, path: Path) -> None:
    """Atomically: an interrupted write leaves no half plan."""
    partial = temporary_beside(path)
    try:
        partial.write_text(json.dumps(plan_to_dict(plan), indent=1) + "\n")
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def load_plan(path: str) -> Plan:
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8-sig"))  # an editor's BOM
        tables = {name: TableSpec(name, t["rows"], t["dim"], t["precision"], t["optimizer"],
                                  t["hotness"], t.get("bags", 1)) for name, t in raw["tables"].items()}
        shards = []
        for name, t in raw["tables"].items():
            offset = 0
            for rank, cols in zip(t["ranks"], t["columns"]):
                shards.append(Shard(name, rank, offset, cols))
                offset += cols
        for name, t in raw["tables"].items():
            if t["sharding"] not in SHARDINGS:
                raise ConfigError(f"parallel.plan: table {name} in {path} has sharding "
                                  f"{t['sharding']!r}; this trainer builds {', '.join(SHARDINGS)}")
        replicated = frozenset(name for name, t in raw["tables"].items()
                               if t["sharding"] == "data_parallel")
        device = DeviceConstants(**raw["device"]) if "device" in raw else DEVICES["h100"]
        return Plan(raw["world_size"], raw["strategy"], raw["budget_bytes"], raw["batch_size"],
                    tables, shards, raw.get("gpus_per_node"), replicated, device)
    except OSError as e:
        raise ConfigError(f"parallel.plan: cannot read {path} ({e.strerror})")
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"parallel.plan: {path} is not a plan file ({type(e).__name__}: {e}); "
                          f"write one with `python -m dlrm_hybrid plan --out`")


def check_plan(plan: Plan, path: str, model_tables: List[TableSpec], world_size: int) -> None:
    """Refuse a plan made for another world size or other tables, or with column shards torchrec
    would not build as written, naming the difference."""
    if plan.world_size != world_size:
        raise ConfigError(f"parallel.plan: {path} is for {plan.world_size} ranks, this job has "
                          f"{world_size}; make one with `plan --world-size {world_size}`")
    problem = plan.unplaced()
    if problem is not None:
        raise ConfigError(f"parallel.plan: {path}: {problem}; make the plan with `python -m "
                          f"dlrm_hybrid plan --out`")
    expected: Dict[str, TableSpec] = {t.name: t for t in model_tables}
    for name in sorted(set(expected) | set(plan.tables)):
        mine, theirs = expected.get(name), plan.tables.get(name)
        if mine is None or theirs is None:
            where = "the model" if mine is None else "the plan"
            raise ConfigError(f"parallel.plan: table {name} is missing from {where} ({path}); "
                              f"make the plan from this job's config")
        if (mine.rows, mine.dim) != (theirs.rows, theirs.dim):
            raise ConfigError(f"parallel.plan: table {name} is {theirs.rows}x{theirs.dim} in {path} "
                              f"but {mine.rows}x{mine.dim} in the model; make the plan from this "
                              f"job's config")
    for name in plan.tables:
        if name not in plan.replicated:
            _check_shards(plan, name, path, world_size)
        elif expected[name].optimizer not in REPLICABLE_OPTIMIZERS:
            raise ConfigError(f"parallel.plan: table {name} is replicated (data_parallel) in "
                              f"{path}, but {expected[name].optimizer} would update a replicated "
                              f"table unlike a sharded one; shard it, or train it with "
                              f"{', '.join(REPLICABLE_OPTIMIZERS)}")


def _check_shards(plan: Plan, name: str, path: str, world_size: int) -> None:
    """The shards cover the columns on real ranks, split as torchrec's `column_wise(ranks=...)`
    splits (evenly, widths divisible by 4): sharding.py hands it only the ranks."""
    dim = plan.tables[name].dim
    shards = plan.shards_of(name)
    widths = [s.cols for s in sorted(shards, key=lambda s: s.col_offset)]
    if sum(widths) != dim or not all(0 <= s.rank < world_size for s in shards):
        raise ConfigError(f"parallel.plan: table {name} in {path} has shards that do not cover "
                          f"its {dim} columns on ranks 0..{world_size - 1}")
    counts = column_split_counts(dim)
    if len(widths) not in counts or len(set(widths)) > 1:
        splits = ", ".join(f"{n}x{dim // n}" for n in counts if n <= world_size)
        raise ConfigError(f"parallel.plan: table {name} in {path} has columns {widths}, a split "
                          f"torchrec does not build; give it one of {splits} (count x width), or "
                          f"make the plan with `plan --out`")
