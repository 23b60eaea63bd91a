"""benchmarks/recommend_planted.py: the planted log it writes is a u.data that `preprocess
interactions` reads, rated by its documented rule, in the planted log's own draw order; the
teacher's ceiling is computed on the funnel's test items; its table and last line say whether
each stage is at or above the one before it."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import failure, load_script, run_cli

from dlrm_hybrid.config import DataConfig
from dlrm_hybrid.data.interactions.interaction_data import open_interactions
from dlrm_hybrid.data.interactions.planted_interactions import (draws, planted_interactions,
                                                                teacher, teacher_scores)

CFG = dict(users=40, items=300, interactions_per_user=12, seed=5)
EDGES = (0.6, 0.8, 0.9, 0.96)  # the documented rule's: ratings 2, 3, 4, 5 start at these shares


@pytest.fixture(scope="module")
def bench():
    """benchmarks/recommend_planted.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/recommend_planted.py", "recommend_planted_bench")


@pytest.fixture(scope="module")
def dataset(bench, tmp_path_factory):
    """(the log written, the retrieval dataset `preprocess interactions` made of it, as
    recommend.py makes it)."""
    root = tmp_path_factory.mktemp("planted")
    assert bench.write_udata(root / "u.data", DataConfig(**CFG)) == CFG["users"] * CFG[
        "interactions_per_user"]
    result = run_cli(["preprocess", "interactions", "--input", str(root / "u.data"), "--output",
                      str(root / "retrieval"), "--positive", "rating>=4"])
    assert result.returncode == 0, failure(result)
    return root / "u.data", root / "retrieval"


def rows_of(log: Path) -> np.ndarray:
    table = np.loadtxt(log, dtype=np.int64, delimiter="\t", ndmin=2)
    assert table.shape[1] == 4  # user, item, rating, timestamp
    return table


def test_the_log_is_the_planted_draws_in_time_order_and_preprocess_reads_it(dataset):
    log, retrieval = dataset
    table = rows_of(log)
    users, items, rating, time = table.T - np.array([[1], [1], [0], [1]])
    assert (np.diff(time) >= 0).all()  # rows in time order
    planted = planted_interactions(DataConfig(**CFG))  # its test item: each user's last draw
    for user in range(CFG["users"]):
        mine = np.argsort(time[users == user], kind="stable")
        drawn = items[users == user][mine]
        assert len(set(drawn.tolist())) == CFG["interactions_per_user"]
        assert drawn[-1] == planted.pairs["test"][1][user]
        assert drawn[-2] == planted.pairs["val"][1][user]
    # preprocess: every row read, the liked ones kept; leave-last-out's test item is each
    # user's last liked draw
    data = open_interactions(str(retrieval))
    raw_user = np.loadtxt(retrieval / "users.txt", dtype=np.int64) - 1
    raw_item = np.loadtxt(retrieval / "items.txt", dtype=np.int64) - 1
    kept = sum(len(data.pairs[s][0]) for s in ("train", "val", "test"))
    assert kept == (rating >= 4).sum()
    test_users, test_items = data.pairs["test"]
    assert len(test_users) > CFG["users"] // 2
    for user, item in zip(raw_user[test_users], raw_item[test_items]):
        liked = (users == user) & (rating >= 4)
        assert item == items[liked][np.argmax(time[liked])]


def test_draws_are_the_teachers_softmax_without_replacement_in_draw_order():
    """planted_interactions.draws, which the log and the planted dataset share: the first draw
    follows softmax(scores), the next one the softmax over the items not drawn yet."""
    p = np.array([0.5, 0.25, 0.15, 0.1])
    cfg = DataConfig(users=40_000, items=4, interactions_per_user=3)
    drawn = draws(cfg, np.tile(np.log(p), (cfg.users, 1)), np.random.default_rng(0))
    assert drawn.shape == (cfg.users, 3)
    assert (np.sort(drawn, axis=1)[:, 1:] != np.sort(drawn, axis=1)[:, :-1]).all()
    assert np.abs(np.bincount(drawn[:, 0], minlength=4) / cfg.users - p).max() < 0.01
    after_first = drawn[drawn[:, 0] == 0, 1]  # p without item 0: 0.5, 0.3, 0.2
    assert np.abs(np.bincount(after_first, minlength=4)[1:] / len(after_first)
                  - p[1:] / p[1:].sum()).max() < 0.015
    cfg.interactions_per_user = 9  # never more than the catalogue
    assert draws(cfg, np.zeros((2, 4)), np.random.default_rng(0)).shape == (2, 4)


def test_ratings_follow_the_documented_rule(bench, dataset):
    """Rating 1 + the EDGES at or below the share of the catalogue the user likes less: the
    user's top 10% by affinity rate 4 or 5, a drawn item outside it (drawn for popularity) less."""
    users, items, rating, _ = (rows_of(dataset[0]) - np.array([1, 1, 0, 1])).T
    u, v, _, _, _ = teacher(DataConfig(**CFG))
    affinity = u @ v.T
    below = (affinity[users] < affinity[users, items][:, None]).mean(1)
    expected = 1 + (below[:, None] >= np.array(EDGES)).sum(1)
    assert (rating == expected).all()
    assert set(rating.tolist()) == {1, 2, 3, 4, 5}  # every rating drawn: the rule decides
    every = bench.ratings(u, v)
    assert ((every >= 4).sum(1) == CFG["items"] // 10).all()


def brute_ceiling(retrieval: Path, asked: int, liked_only: bool) -> float:
    """HR@10 of the teacher's score among each test user's unseen items (liked ones only)."""
    cfg = DataConfig(**CFG)
    data = open_interactions(str(retrieval))
    raw_user = np.loadtxt(retrieval / "users.txt", dtype=np.int64) - 1
    raw_item = np.loadtxt(retrieval / "items.txt", dtype=np.int64) - 1
    u, v, log_pop, _, _ = teacher(cfg)
    scores = teacher_scores(cfg, u, v, log_pop)
    affinity = u @ v.T
    hits = []
    for user, item in list(zip(*data.pairs["test"]))[:asked]:
        seen = {i for s in ("train", "val") for uu, i in zip(*data.pairs[s]) if uu == user}
        row, own = scores[raw_user[user]], scores[raw_user[user], raw_item[item]]
        better = 0
        for other in range(data.items):
            liked = (affinity[raw_user[user]] < affinity[raw_user[user], raw_item[other]]
                     ).mean() >= 0.9
            if other not in seen and (liked or not liked_only) and row[raw_item[other]] > own:
                better += 1
        hits.append(better < 10)
    return float(np.mean(hits))


def test_the_ceiling_is_the_teachers_ranking_of_the_funnels_test_items(bench, dataset,
                                                                      tmp_path):
    """On recommend.py's test items and exclusions: exactly the teacher's ranking; popularity
    (a trivial model) below it; the first `asked` users only; another test item changes it."""
    retrieval = dataset[1]
    found = bench.ceilings(DataConfig(**CFG), retrieval, 1000)
    assert found["ceiling"] == brute_ceiling(retrieval, 1000, True)
    assert found["teacher"] == brute_ceiling(retrieval, 1000, False)
    assert found["popularity"] < found["teacher"] <= found["ceiling"] < 1
    assert bench.ceilings(DataConfig(**CFG), retrieval, 7)["ceiling"] == \
        brute_ceiling(retrieval, 7, True)
    # plant a wrong test item: each user's the teacher likes least of its unseen items
    wrong = tmp_path / "wrong"
    shutil.copytree(retrieval, wrong)
    data, cfg = open_interactions(str(wrong)), DataConfig(**CFG)
    u, v, log_pop, _, _ = teacher(cfg)
    raw_user = np.loadtxt(wrong / "users.txt", dtype=np.int64) - 1
    raw_item = np.loadtxt(wrong / "items.txt", dtype=np.int64) - 1
    scores = teacher_scores(cfg, u, v, log_pop)[np.ix_(raw_user, raw_item)]
    for s in ("train", "val"):
        scores[data.pairs[s]] = np.inf
    np.save(wrong / "test_item.npy", np.argmin(scores[data.pairs["test"][0]], axis=1))
    assert bench.ceilings(cfg, wrong, 1000)["teacher"] == 0.0


def test_the_order_of_the_stages_and_the_summary_line(bench):
    hr = {"ceiling": 0.5, "teacher": 0.4, "popularity": 0.1, "pixie": 0.2, "two_tower": 0.3,
          "history": 0.25, "merged": 0.3, "ranked": 0.35, "first_stage": 0.29,
          "ranked_three_stage": 0.33}
    rows = {stage: (before, ok) for stage, _, before, _, ok in bench.order_rows(hr)}
    assert rows == {"pixie": ("popularity", True), "two_tower": ("popularity", True),
                    "history": ("popularity", True), "merged": ("two_tower", True),
                    "ranked": ("merged", True), "first_stage": ("merged", False),
                    "ranked_three_stage": ("first_stage", True)}
    line = bench.summary_line(DataConfig(**CFG), 33, hr)
    assert line == ("recommend_planted: users=40 items=300 per_user=12 test_users=33 "
                    "ceiling=0.5000 teacher=0.4000 popularity=0.1000 pixie=0.2000 "
                    "two_tower=0.3000 history=0.2500 merged=0.3000 ranked=0.3500 "
                    "first_stage=0.2900 ranked_three_stage=0.3300 ordered=false")
    hr["first_stage"] = 0.3
    assert bench.summary_line(DataConfig(**CFG), 33, hr).endswith("ordered=true")
    hr["ranked"] = 0.29
    assert bench.summary_line(DataConfig(**CFG), 33, hr).endswith("ordered=false")
    table = bench.table(hr)
    assert "| ranked | 0.2900 | 0.58 | **no**: merged 0.3000 |" in table
    assert "| merged | 0.3000 | 0.60 | yes: two_tower 0.3000 |" in table


def test_recommends_summary_line_is_read_back(bench):
    """The stages' HR@10 from recommend.py's own summary line (its function) and the number of
    test users it asked."""
    recommend = load_script("benchmarks/recommend.py", "recommend_bench_for_planted")
    hr = {f"{stage}_hr@10": 0.1 * n for n, stage in enumerate(recommend.STAGES)}
    three = {"first_stage_hr@10": 0.7, "ranked_hr@10": 0.8}
    line = recommend.summary_line("planted", hr, [1.0], {"pointwise": {"ranked_hr@10": 0.4}},
                                  (three, [1.0], [1.0]), [1.0])
    found, asked = bench.funnel_hit_rates(f"x\nplanted: 12 test users (...)\n{line}\n")
    assert asked == 12
    assert found == {"pixie": 0.0, "two_tower": 0.1, "history": 0.2, "merged": 0.3,
                     "ranked": 0.4, "first_stage": 0.7, "ranked_three_stage": 0.8}
    with pytest.raises(SystemExit, match="no `recommend:` line"):
        bench.funnel_hit_rates("planted: 12 test users\n")


def test_main_writes_the_log_and_prints_the_table_and_summary(bench, tmp_path, monkeypatch,
                                                              capsys):
    """End to end with recommend.py stood in for by its retrieval dataset and a summary: the log
    kept in --work under a folder named by the data section, the ceiling on the users asked."""
    asked = {}

    def funnel(log, work, forwarded):
        asked["forwarded"] = forwarded
        built = bench.log_folder(work, str(log))  # where recommend.py builds from this log
        result = run_cli(["preprocess", "interactions", "--input", str(log), "--output",
                          str(built / "retrieval"), "--positive", "rating>=4"])
        assert result.returncode == 0, failure(result)
        return {stage: 0.2 for stage in bench.FUNNEL_KEYS}, 9

    monkeypatch.setattr(bench, "run_funnel", funnel)
    sets = [a for k, v in CFG.items() for a in ("--set", f"data.{k}={v}")]
    bench.main([*sets, "--work", str(tmp_path), "--users", "9", "--", "--losses", "pointwise"])
    out = capsys.readouterr().out.strip().splitlines()
    assert asked["forwarded"] == ["--losses", "pointwise", "--users", "9"]
    logs = list(tmp_path.glob("planted_*/u.data"))
    assert len(logs) == 1 and len(rows_of(logs[0])) == 480
    built = bench.log_folder(logs[0].parent / "recommend", str(logs[0]))
    ceiling = brute_ceiling(built / "retrieval", 9, True)
    assert out[-1].startswith(f"recommend_planted: users=40 items=300 per_user=12 test_users=9 "
                              f"ceiling={ceiling:.4f} ")
    fields = dict(word.split("=") for word in out[-1].split()[1:])
    assert fields["ordered"] == ("true" if float(fields["popularity"]) <= 0.2 else "false")
    assert fields["merged"] == "0.2000" and "| ceiling |" in "\n".join(out)
    with pytest.raises(SystemExit, match="error: --set data.users: expected KEY=VALUE"):
        bench.main(["--set", "data.users"])
