"""Every plan the planner returns trains every table: a property over random Criteo-like models,
world sizes, hosts and budgets from tight to roomy, for both strategies; and what `plan --out`
and `train` do with a plan that leaves a table out."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.greedy_search import STRATEGIES, plan_tables
from dlrm_hybrid.parallel.plan import PlacementError, Plan, Shard
from dlrm_hybrid.parallel.plan_file import check_plan, load_plan, save_plan
from dlrm_hybrid.parallel.tables import TableSpec

BATCH = 65536


def assert_every_table_trained_whole(plan, tables, budget):
    """Each table replicated, or its shards covering its columns once on distinct ranks, and
    no rank over the budget: checked here from the shards, not by the planner's own check."""
    for t in tables:
        shards = sorted(plan.shards_of(t.name), key=lambda s: s.col_offset)
        if t.name in plan.replicated:
            assert not shards, t.name
            continue
        assert shards, f"{t.name} is on no rank"
        assert [s.col_offset for s in shards] == [sum(x.cols for x in shards[:k])
                                                 for k in range(len(shards))], t.name
        assert sum(s.cols for s in shards) == t.dim, t.name
        assert len({s.rank for s in shards}) == len(shards), t.name
        assert all(0 <= s.rank < plan.world_size for s in shards), t.name
    assert {s.table for s in plan.shards} <= {t.name for t in tables}
    assert plan.loads[0].max() <= budget


criteo_like = st.lists(st.tuples(st.floats(0.5, 7.9), st.sampled_from([16, 32, 64, 128])),
                       min_size=20, max_size=260)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.data_too_large])
@given(spec=criteo_like, optimizer=st.sampled_from(["rowwise_adagrad", "sgd", "adagrad"]),
       layout=st.sampled_from([(8, None), (16, 8), (16, None), (64, 8), (4, 2)]),
       fill=st.one_of(st.floats(0.88, 1.02), st.floats(0.3, 3.0)),
       strategy=st.sampled_from(STRATEGIES))
def test_every_plan_places_every_table_or_refuses_in_one_line(spec, optimizer, layout, fill,
                                                              strategy):
    """`fill`: the tables' bytes over all ranks' budgets; near 1 the searches fall back to
    memory alone (where tables were once left on no rank)."""
    tables = [TableSpec(f"t{i}", max(1, int(10 ** rows)), dim, optimizer=optimizer)
              for i, (rows, dim) in enumerate(spec)]
    world, per_host = layout
    budget = max(1, int(sum(t.bytes for t in tables) / world / fill))
    try:
        plan = plan_tables(tables, world, budget, BATCH, strategy, per_host)
    except PlacementError as e:
        assert "\n" not in str(e) and "planner bug" not in str(e)
        return
    assert_every_table_trained_whole(plan, tables, budget)


def test_the_memory_fallback_keeps_the_tables_it_replicates():
    """27 Criteo-like tables on 2 hosts x 2 ranks at 97% of their memory: balancing traffic
    fails, memory alone fits them. The fallback once placed the first try's shards, which left
    out the tables it meant to replicate, and replicated none: 12 tables on no rank."""
    import random
    rng = random.Random(2)
    rng.randint(20, 120)
    tables = [TableSpec(f"t{i}", int(10 ** rng.uniform(0.5, 7.9)), 128, optimizer="rowwise_adagrad")
              for i in range(27)]
    budget = int(sum(t.bytes for t in tables) / 4 / 0.97)
    plan = plan_tables(tables, 4, budget, BATCH, "greedy", 2)
    assert plan.replicated, "the case must reach the fallback with replicated tables"
    assert_every_table_trained_whole(plan, tables, budget)


def test_a_plan_with_a_table_on_no_rank_is_refused_by_train_and_by_sharding(tmp_path):
    tables = {"a": TableSpec("a", 100, 8), "b": TableSpec("b", 100, 8)}
    holed = Plan(2, "greedy", 10**9, 64, tables, [Shard("a", 0, 0, 8)])
    assert holed.unplaced() == "table b is on no rank and not replicated"
    path = tmp_path / "plan.json"
    save_plan(holed, path)
    assert json.loads(path.read_text())["tables"]["b"]["ranks"] == []
    with pytest.raises(ConfigError, match="table b is on no rank"):
        check_plan(load_plan(str(path)), str(path), list(tables.values()), 2)
    from dlrm_hybrid.parallel.sharding import sharding_plan
    with pytest.raises(PlacementError, match="table b is on no rank"):
        sharding_plan(None, holed, 2, "cpu")  # refused before the model is looked at


@pytest.mark.parametrize("shards, problem", [
    ([Shard("a", 0, 0, 4)], "table a has shards [0:4], not its 8 columns once each"),
    ([Shard("a", 0, 0, 4), Shard("a", 0, 4, 4)], "table a has shards on ranks [0, 0]"),
])
def test_unplaced_names_what_is_wrong(shards, problem):
    plan = Plan(2, "greedy", 10**9, 64, {"a": TableSpec("a", 100, 8)}, shards)
    assert plan.unplaced().startswith(problem)


def test_the_planner_refuses_a_plan_of_its_own_that_leaves_a_table_out(monkeypatch):
    """Whatever a search returns is checked before `plan_tables` hands it on: one line."""
    from dlrm_hybrid.parallel import greedy_search

    tables = [TableSpec("a", 100, 8), TableSpec("b", 100, 8)]
    monkeypatch.setattr(greedy_search._Search, "plan", lambda search: search.make(
        [Shard("a", 0, 0, 8)]))
    with pytest.raises(PlacementError, match=r"^the greedy placement failed its check \(table b "
                                             r"is on no rank and not replicated\); this is a "
                                             r"planner bug") as e:
        plan_tables(tables, 2, 10**9, BATCH, "greedy")
    assert "\n" not in str(e.value)
    monkeypatch.setattr(greedy_search._Search, "plan", lambda search: search.make(
        [Shard("a", 0, 0, 8), Shard("b", 0, 0, 8)]))
    with pytest.raises(PlacementError, match=r"rank 0 holds .* over its 4.0KiB budget"):
        plan_tables(tables, 2, 4096, BATCH, "greedy")
