"""`plan --explain TABLE`: every way to shard one table, each placed by the greedy rule into the
rest of a plan, with the modeled step time it would give and why the search would not take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from dlrm_hybrid.parallel.column_split import _shards_to_fit, column_split_counts
from dlrm_hybrid.parallel.cost_model import StepTime
from dlrm_hybrid.parallel.greedy_search import _Search
from dlrm_hybrid.parallel.greedy_state import _State
from dlrm_hybrid.parallel.plan import Plan
from dlrm_hybrid.parallel.tables import REPLICABLE_OPTIMIZERS

NO_REPLICATION = ("parallel.replicate is false, or the job asks for the des exchange or fp16, "
                  "which replicated tables do not run with")


@dataclass
class Option:
    """One way to shard a table, and the plan's modeled step time were it sharded so."""
    sharding: str  # table_wise, column_wise xK, data_parallel
    time: Optional[StepTime]  # None: it does not fit
    ranks: str
    chosen: bool
    note: str = ""  # why the search would not take it


def explain(plan: Plan, name: str, split_rowwise: bool = False,
            replicate: bool = True) -> List[Option]:
    """Every sharding of table `name` (each column split torchrec builds on these ranks, and
    replication), placed by the greedy rule into the rest of `plan`, which stays as it is."""
    search = _Search(list(plan.tables.values()), plan.world_size, plan.budget_bytes,
                     plan.batch_size, "greedy", plan.gpus_per_node, plan.device, split_rowwise,
                     replicate)
    state = _State.of(plan, search)
    t = plan.tables[name]
    fewest = _shards_to_fit(t, plan.budget_bytes)
    current = None if name in plan.replicated else len(plan.shards_of(name))
    options = []
    for count in [c for c in column_split_counts(t.dim) if c <= plan.world_size] + [None]:
        if count is None and plan.world_size == 1:
            continue
        trial = state.copy()
        fits = trial.apply(t, count)
        label = "data_parallel" if count is None else \
            "table_wise" if count == 1 else f"column_wise x{count}"
        note = "does not fit" if not fits else ""
        if count is None and t.optimizer not in REPLICABLE_OPTIMIZERS:
            note = f"{t.optimizer}'s update of a replicated table is not the sharded one's"
        elif count is None and not replicate:
            note = NO_REPLICATION
        elif count is not None and count > max(fewest, 1) and not search.can_split(t, count - 1) \
                and fits:
            note = (f"{t.optimizer} keeps state per row of each shard: the split changes its "
                    f"updates (parallel.split_rowwise)")
        ranks = "all" if count is None else ",".join(str(r) for r in trial.holders.get(name, []))
        options.append(Option(label, trial.step() if fits else None, ranks, count == current,
                              note))
    return options
