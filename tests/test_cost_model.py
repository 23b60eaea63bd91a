"""The cost model's step time, against figures worked out by hand."""

import pytest

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.parallel.cost_model import (DEVICES, DeviceConstants, a2a_bytes, device_constants,
                                             device_kind, step_time)
from dlrm_hybrid.parallel.plan import Plan, Shard
from dlrm_hybrid.parallel.tables import TableSpec

# round numbers: bytes/s for memory, in host, across hosts; seconds per shard and per message
UNIT = DeviceConstants("unit", 1e3, 100.0, 10.0, 1.0, 0.5, "test")


def two_hosts_plan():
    """4 ranks in 2 hosts of 2, global batch 8 (2 samples a rank). Table a (100 x 16, one id a
    sample: 64 bytes pooled, 8 + 4 of id and length) whole on rank 0; table r (10 x 8, 320 bytes)
    replicated."""
    tables = {"a": TableSpec("a", 100, 16), "r": TableSpec("r", 10, 8)}
    return Plan(4, "greedy", 10**6, 8, tables, [Shard("a", 0, 0, 16)], 2, frozenset({"r"}))


def test_step_time_of_a_two_host_plan_is_the_hand_computed_one():
    modeled = step_time(two_hosts_plan(), UNIT)
    # rank 0 owns a: to rank 1 (its host) it sends 2 samples x 64 pooled and gets 2 x (12 + 64)
    # ids and gradients: the larger, 152 B at 100 B/s; to each of ranks 2, 3 across hosts the
    # same: 2 x 152 = 304 B at 10 B/s. Ranks 2, 3 send 152 B and get 128 B across hosts.
    assert modeled.a2a_intra_s.tolist() == pytest.approx([1.52, 1.52, 0, 0])
    assert modeled.a2a_inter_s.tolist() == pytest.approx([30.4, 0, 15.2, 15.2])
    # a's lookups: 2 x 8 samples x 16 x 4 B = 1024 B on rank 0; r on every rank: its 2 samples'
    # lookups (2 x 2 x 8 x 4 = 128 B) and its whole update (weights and gradient, read and
    # written: 2 x (320 + 320) = 1280 B)
    assert modeled.lookup_s.tolist() == pytest.approx([2.432, 1.408, 1.408, 1.408])
    # rank 0: 2 shards (a and r) + 3 messages of pooled vectors; the others: r + ids and
    # gradients to rank 0
    assert modeled.fixed_s.tolist() == pytest.approx([2 * 1.0 + 3 * 0.5] + [1.0 + 2 * 0.5] * 3)
    # r's 320-byte gradient, ring all-reduce across hosts: 2 x 3/4 x 320 B at 10 B/s
    assert modeled.allreduce_s.tolist() == pytest.approx([48.0] * 4)
    assert modeled.max_s == pytest.approx(2.432 + 1.52 + 30.4 + 3.5 + 48)
    intra, inter = a2a_bytes(two_hosts_plan())
    assert intra.tolist() == [128, 152, 0, 0] and inter.tolist() == [256, 0, 152, 152]


def test_one_host_sends_everything_inside_it():
    plan = two_hosts_plan()
    plan.gpus_per_node = None
    modeled = step_time(plan, UNIT)
    assert not modeled.a2a_inter_s.any()
    assert modeled.a2a_intra_s.tolist() == pytest.approx([4.56, 1.52, 1.52, 1.52])
    assert modeled.allreduce_s.tolist() == pytest.approx([4.8] * 4)  # at 100 B/s in the host


def test_device_kind_follows_the_gpu_name_when_auto():
    assert device_kind("auto", None) == "cpu_gloo"
    assert device_kind("auto", "NVIDIA H200") == "h200"
    assert device_kind("auto", "NVIDIA A100-SXM4-80GB") == "a100"
    assert device_kind("auto", "Tesla V100-SXM2-32GB") == "h100"
    assert device_kind("a100", "NVIDIA H100 80GB HBM3") == "a100"


def test_overrides_replace_constants_and_say_so_in_the_source():
    changed = device_constants("h100", {"inter_host_bandwidth": 25e9})
    assert changed.inter_host_bandwidth == 25e9
    assert changed.memory_bandwidth == DEVICES["h100"].memory_bandwidth
    assert changed.source.endswith("parallel.cost_model sets inter_host_bandwidth")
    with pytest.raises(ConfigError, match="^parallel.cost_model.name: unknown constant"):
        device_constants("h100", {"name": 1.0})


@pytest.mark.parametrize("world, per_host", [(16, 4), (8, None), (1, None)])
def test_placers_kept_scores_are_the_cost_models_totals_bit_for_bit(world, per_host):
    """greedy_state's `_AddScores` keeps terms between shards; each score must be exactly
    `rank_totals` of the sums with the shard added (a last-bit difference can change a plan)."""
    import numpy as np

    from dlrm_hybrid.parallel.column_split import _Piece
    from dlrm_hybrid.parallel.cost_model import RankSums, rank_totals, shard_terms
    from dlrm_hybrid.parallel.greedy_search import _Search
    from dlrm_hybrid.parallel.greedy_state import _State

    rng = np.random.default_rng(world)
    tables = [TableSpec(f"t{i}", int(rng.integers(10, 10**6)), int(rng.choice([8, 16, 64])),
                        "fp32", "sgd", float(rng.choice([1.0, 2.5, 7.0])), int(rng.integers(1, 3)))
              for i in range(12)]
    search = _Search(tables, world, 2**40, 6144, "greedy", per_host, DEVICES["h100"], False, True)
    state = _State(search, frozenset())
    for step in range(300):
        t = tables[int(rng.integers(0, 3 if step % 50 < 40 else 12))]  # mostly equal terms
        piece = _Piece(t, 0, t.dim // 2, 2)
        dp, di, dl = shard_terms(t, piece.cols, search.batch)
        now = state.rank_sums()
        expected = rank_totals(RankSums(
            now.pooled + dp, now.ids + di, now.lookup + dl, now.shards + 1, now.host_pooled + dp,
            now.host_ids + di, state.total_pooled + dp, state.total_ids + di,
            state.owners + (now.shards == 0)), state.layout, search.device)
        assert np.array_equal(state.scores.totals(state, (dp, di, dl)), expected), step
        if state.rank_of and rng.random() < 0.3:  # take one away, or replicate a table
            gone = list(state.rank_of)[int(rng.integers(0, len(state.rank_of)))]
            state.add(gone, state.rank_of[gone], -1)
            if rng.random() < 0.2:
                state.set_replicated(state.replicated | {gone.table.name})
        elif piece not in state.rank_of:
            state.add(piece, int(rng.integers(0, world)))
