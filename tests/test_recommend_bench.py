"""benchmarks/recommend.py: its hit rates count a user's test item only among a stage's first K,
and its last line is the one scripts read."""


import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bench():
    """benchmarks/recommend.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/recommend.py", "recommend_bench")


def test_hit_rates_count_the_test_item_among_each_stages_first_k(bench):
    ranked = np.arange(100, 400)  # the test item 7 at place 30 (0-based) of `merged`
    merged = np.concatenate([np.arange(1000, 1030), [7], np.arange(2000, 2100)])
    stages = [{"pixie": np.array([7, 1]), "two_tower": np.arange(20, 40),
               "history": np.zeros(0, np.int64), "merged": merged, "ranked": ranked},
              {"pixie": np.arange(50), "two_tower": np.array([9] + list(range(10, 60))),
               "history": np.array([3, 4]), "merged": np.array([5, 9]),
               "ranked": np.array([*range(200, 209), 9])}]
    hr = bench.hit_rates(stages, np.array([7, 9]))  # user 1's test item is 9
    assert hr == {"pixie_hr@10": 1.0, "pixie_hr@50": 1.0, "two_tower_hr@10": 0.5,
                  "two_tower_hr@50": 0.5, "history_hr@10": 0.0, "history_hr@50": 0.0,
                  "merged_hr@10": 0.5, "merged_hr@50": 1.0, "ranked_hr@10": 0.5,
                  "ranked_hr@50": 0.5}
    line = bench.summary_line("ml-100k", hr, [float(ms) for ms in range(1, 101)])
    assert line == ("recommend: data=ml-100k hr@10_pixie=1.0000 hr@10_two_tower=0.5000 "
                    "hr@10_history=0.0000 hr@10_merged=0.5000 hr@10_ranked=0.5000 "
                    "p50_ms=50.50 p99_ms=99.01")
    line = bench.summary_line("ml-100k", hr, [1.0], {"pointwise": hr, "listwise":
                                                     {"ranked_hr@10": 0.25}})
    assert line.endswith("hr@10_ranked=0.5000 hr@10_ranked_pointwise=0.5000 "
                         "hr@10_ranked_listwise=0.2500 p50_ms=1.00 p99_ms=1.00")
    three = {"merged_hr@10": 0.5, "first_stage_hr@10": 0.75, "ranked_hr@10": 0.25}
    line = bench.summary_line("ml-100k", hr, [1.0], None, (three, [2.0, 4.0], [1.0, 2.0]),
                              [0.5])
    assert line.endswith("hr@10_ranked=0.5000 p50_ms=1.00 p99_ms=1.00 p50_cpu_ms=0.50 "
                         "p99_cpu_ms=0.50 hr@10_first_stage=0.7500 "
                         "hr@10_ranked_three_stage=0.2500 p50_ms_three_stage=3.00 "
                         "p99_ms_three_stage=3.98 p50_cpu_ms_three_stage=1.50 "
                         "p99_cpu_ms_three_stage=1.99")
    assert bench.value_text({"watched": 0.5, "liked": 1.0, "disliked": -2.0}) == \
        "0.5 P(watched) + 1 P(liked) - 2 P(disliked)"


def test_the_test_items_asked_for_leave_out_re_watches(bench, tmp_path):
    """A test item the user engaged with in train or validation is never returned (seen items
    are left out), so the benchmark does not ask for it (docs/retrieval.md's rule)."""
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData, write_interactions
    from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta

    pairs = {"train": (np.array([0, 0, 1, 2]), np.array([1, 2, 3, 0])),
             "val": (np.array([0, 1, 2]), np.array([3, 0, 4])),
             "test": (np.array([0, 1, 2]), np.array([2, 4, 4]))}  # u0: train's 2; u2: val's 4
    data = InteractionData(InteractionMeta(3, 5), pairs, np.zeros((3, 0), np.int64),
                           np.zeros((5, 0), np.int64))
    write_interactions(data, str(tmp_path / "log"))
    users, items = bench.findable_test(tmp_path / "log")
    assert users.tolist() == [1] and items.tolist() == [4]
