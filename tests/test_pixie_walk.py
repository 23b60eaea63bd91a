"""Pixie walks against what they must give: the exact visit distribution on small hand-made graphs
(numpy's solve of v = y P, y = alpha e_q + (1 - alpha) v), components never crossed, the restart
probability, the step split and the multi-hit boost, early stopping at its step, seeds; and
`pixie query` as a user meets it.

Tolerances: a walk of N steps estimates v with a total variation error of about
0.4 * sqrt(k c / N) over k items, c <= (2 - alpha) / alpha the steps' correlation; plus at most
W / (alpha N) from W walkers' unfinished last walks. At N = 200,000, W = 256, k <= 16 and
alpha >= 0.2 that is under 0.012; the worst of seeds 1..10 on these graphs was 0.005, so
TV_TOLERANCE = 0.02 leaves a margin of four (the restart test's relative 3% and 5%: twice the
worst seen). Seeds are fixed (SEED)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import failure, run_cli
from dlrm_hybrid.graph.bipartite import Pruning, build_graph
from dlrm_hybrid.graph.pixie import PixieParams, PixieWalker, allocate_steps

SEED = 0
STEPS = 200_000
WALKERS = 256
TV_TOLERANCE = 0.02


def graph_of(users: int, items: int, edges):
    u, i = (np.array(side, np.int64) for side in zip(*edges))
    return build_graph(users, items, u, i, Pruning())[0]


def star(n: int = 6):
    """One user with n items: every step lands on a uniformly drawn item."""
    return graph_of(1, n, [(0, i) for i in range(n)])


def chain(n: int):
    """item 0 - user 0 - item 1 - user 1 - ... - item n-1: a lazy walk along a line."""
    return graph_of(n - 1, n, [(u, i) for u in range(n - 1) for i in (u, u + 1)])


def random_graph():
    rng = np.random.default_rng(SEED)
    edges = {(int(rng.integers(0, 10)), i) for i in range(16)}  # every item has a user
    edges |= set(zip(rng.integers(0, 10, 40).tolist(), rng.integers(0, 16, 40).tolist()))
    return graph_of(10, 16, sorted(edges))


def transition(graph) -> np.ndarray:
    """P[i, j]: item i -> a uniform user of it -> a uniform item of that user lands on j."""
    a = np.zeros((graph.items, graph.users))
    for i in range(graph.items):
        a[i, graph.item_users[graph.item_indptr[i]:graph.item_indptr[i + 1]]] = 1
    to_user = a / np.maximum(a.sum(1, keepdims=True), 1)
    to_item = a.T / np.maximum(a.T.sum(1, keepdims=True), 1)
    return to_user @ to_item


def exact_visits(graph, query: int, alpha: float) -> np.ndarray:
    """v = y P, y = alpha e_q + (1 - alpha) v, i.e. v (I - (1 - alpha) P) = alpha e_q P."""
    p = transition(graph)
    return np.linalg.solve((np.eye(graph.items) - (1 - alpha) * p).T, alpha * p[query])


def walk_counts(graph, queries, weights=None, **params) -> tuple:
    """(visits per item from every query, summed; the PixieResult), query items kept."""
    settings = dict(steps=STEPS, walkers=WALKERS, early_stop_candidates=0, boost=False,
                    seed=SEED)
    settings.update(params)
    result = PixieWalker(graph).walk(queries, weights, PixieParams(**settings),
                                     keep_queries=True)
    counts = np.zeros(graph.items)
    counts[result.items] = result.scores
    return counts, result


def total_variation(counts: np.ndarray, exact: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - exact).sum())


@pytest.mark.parametrize("graph, query", [(star(), 2), (chain(8), 0), (chain(8), 3),
                                          (random_graph(), 5)],
                         ids=["star", "chain_end", "chain_middle", "random"])
def test_the_visits_follow_the_exact_restart_distribution(graph, query):
    exact = exact_visits(graph, query, 0.5)
    if graph.users == 1:
        assert exact == pytest.approx(np.full(graph.items, 1 / graph.items))
    counts, result = walk_counts(graph, [query])
    assert counts.sum() == STEPS == result.walked.sum()
    assert total_variation(counts, exact) < TV_TOLERANCE


def test_a_walker_never_crosses_into_another_component(monkeypatch):
    # items 0..4 with users 0..2; items 5..9 with users 3..5: ids interleave in the CSR arrays
    left = [(0, 0), (0, 1), (1, 1), (1, 2), (1, 3), (2, 3), (2, 4)]
    graph = graph_of(6, 10, left + [(u + 3, i + 5) for u, i in left])
    counts, _ = walk_counts(graph, [4])
    assert (counts[:5] > 0).all() and (counts[5:] == 0).all()
    counts, _ = walk_counts(graph, [7], alpha=0.1)
    assert (counts[5:] > 0).all() and (counts[:5] == 0).all()


def test_the_restart_probability_is_alpha():
    """On a long chain walked from its end, each step's expected change of the distance d from
    the query is 0 except +1/2 from d = 0, so in the stationary walk alpha * mean_v(d) =
    y_0 / 2 with y_0 = alpha + (1 - alpha) v_0 (the share of steps that start at the query,
    restarts included): alpha = v_0 / (2 mean_v(d) - 1 + v_0), read off the visits alone."""
    graph = chain(40)
    distance = np.arange(40)
    means = {}
    for alpha in (0.2, 0.8):
        counts, _ = walk_counts(graph, [0], alpha=alpha)
        v = counts / counts.sum()
        means[alpha] = float(v @ distance)
        assert means[alpha] == pytest.approx(exact_visits(graph, 0, alpha) @ distance, rel=0.03)
        estimate = v[0] / (2 * means[alpha] - 1 + v[0])
        assert estimate == pytest.approx(alpha, rel=0.05)
    assert means[0.8] < 0.6 * means[0.2]


def test_allocate_steps_follows_weight_degree_and_the_source_scaling():
    degrees, weights = np.array([5, 10_000, 300, 0, 5]), np.array([1, 1, 2.5, 1, 3])
    steps = allocate_steps(degrees, weights, 100_003, max_degree=10_000)
    share = weights * degrees * (10_000 - np.log(np.maximum(degrees, 1)))
    exact = 100_003 * share / share.sum()
    assert steps.sum() == 100_003 and steps.dtype == np.int64
    assert (np.abs(steps - exact) < 1).all() and steps[3] == 0
    assert steps[1] > 1000 * steps[0] and steps[4] == pytest.approx(3 * steps[0], abs=3)
    assert allocate_steps(np.array([0, 0]), np.array([1, 1]), 50, 10).tolist() == [0, 0]
    # weights only in proportion: huge ones (their product with the scale past a float's
    # range) split the steps as 1 and 2.5 do, not into a traceback
    huge = allocate_steps(degrees, weights * 1e307, 100_003, max_degree=10_000)
    assert huge.tolist() == steps.tolist()


@pytest.mark.parametrize("counts_bytes", [None, 4], ids=["one_group", "a_group_per_query"])
def test_each_query_walks_its_budget_and_each_component_gets_exactly_it(monkeypatch,
                                                                        counts_bytes):
    if counts_bytes:
        monkeypatch.setattr("dlrm_hybrid.graph.pixie.COUNTS_BYTES", counts_bytes)
    left = [(0, 0), (0, 1), (1, 1), (1, 2), (2, 0), (2, 2)]  # items 0..2, degree 2 each
    graph = graph_of(6, 7, left + [(u + 3, i + 3) for u, i in left] + [(3, 6)])
    counts, result = walk_counts(graph, [0, 4, 6], [3, 1, 1], steps=40_001)
    assert result.budget.tolist() == allocate_steps(np.array([2, 2, 1]), np.array([3, 1, 1]),
                                                    40_001, 2).tolist()
    assert result.walked.tolist() == result.budget.tolist() and result.steps_saved == 0
    assert not result.stopped_early.any()
    assert counts[:3].sum() == result.budget[0]
    assert counts[3:].sum() == result.budget[1] + result.budget[2]


def test_the_multi_hit_boost_ranks_an_item_of_two_queries_above_a_busier_one_of_one():
    """Query 0 shares five users with item 3 and two with item 4; query 1 the same with items 5
    and 4. Item 3 gets 1.25x the visits of item 4 (plain sums rank it first), but
    (sum_q sqrt(visits_q))^2 ranks item 4, reached from both queries, first by 1.27x."""
    edges, user = [], 0
    for q, own in ((0, 3), (1, 5)):
        for item in [own] * 5 + [4] * 2:
            edges += [(user, q), (user, item)]
            user += 1
    graph = graph_of(user, 6, edges)
    budget = allocate_steps(np.array([7, 7]), np.ones(2), STEPS, 7)
    from_0, from_1 = (b * exact_visits(graph, q, 0.5) for q, b in zip((0, 1), budget))
    plain, boosted = from_0 + from_1, (np.sqrt(from_0) + np.sqrt(from_1)) ** 2
    assert plain[3] > 1.2 * plain[4] and boosted[4] > 1.2 * boosted[3]
    counts, _ = walk_counts(graph, [0, 1])
    assert counts[3] > counts[4] and counts == pytest.approx(plain, rel=0.05)
    scores, _ = walk_counts(graph, [0, 1], boost=True)
    assert scores[4] > scores[3] and scores[[3, 4]] == pytest.approx(boosted[[3, 4]], rel=0.05)
    top = PixieWalker(graph).walk([0, 1], params=PixieParams(steps=STEPS, seed=SEED), k=3)
    assert top.items[0] == 4 and set(top.items[1:]) == {3, 5}  # boosted, queries left out


def threshold_items(counts: np.ndarray, visits: int) -> int:
    return int((counts >= visits).sum())


@pytest.mark.parametrize("walkers", [1, 16])
def test_early_stopping_stops_in_the_round_its_candidate_reaches_the_visits(walkers):
    """A walk of W walkers over r * W steps replays the first r rounds of a longer walk with the
    same seed; so the round where the n_p-th item first reaches n_v visits is found by
    replaying, and the early-stopped walk must end exactly there (one step with one walker)."""
    graph, n_p, n_v = random_graph(), 6, 25
    stopped_counts, result = walk_counts(graph, [5], walkers=walkers, steps=4000 * walkers,
                                         early_stop_candidates=n_p, early_stop_visits=n_v)
    walked = int(result.walked[0])
    assert result.stopped_early.tolist() == [True] and walked % walkers == 0
    assert result.steps_saved == 4000 * walkers - walked > 0
    before, _ = walk_counts(graph, [5], walkers=walkers, steps=walked - walkers)
    at, _ = walk_counts(graph, [5], walkers=walkers, steps=walked)
    assert threshold_items(before, n_v) < n_p <= threshold_items(at, n_v)
    assert np.array_equal(stopped_counts, at)
    if walkers == 1:
        assert threshold_items(at, n_v) == n_p and n_v in at


def test_early_stopping_off_or_out_of_reach_walks_the_whole_budget():
    graph = random_graph()
    for n_p in (0, graph.items + 1):  # off; more candidates than the graph has
        _, result = walk_counts(graph, [5], steps=20_000, early_stop_candidates=n_p)
        assert result.walked.tolist() == [20_000] and result.steps_saved == 0
        assert not result.stopped_early.any()


def test_the_same_seed_gives_the_same_candidates_and_another_seed_others():
    graph, params = random_graph(), dict(steps=30_000, walkers=512, early_stop_candidates=0)
    walker = PixieWalker(graph)
    first, again, other = (walker.walk([5, 9], [1, 2], PixieParams(**params, seed=seed))
                           for seed in (3, 3, 4))
    assert np.array_equal(first.items, again.items) and np.array_equal(first.scores,
                                                                       again.scores)
    assert not np.array_equal(first.scores, other.scores)



def test_a_repeated_query_item_is_one_query_with_its_weights_summed():
    graph, params = random_graph(), PixieParams(steps=30_000, walkers=512, seed=3)
    walker = PixieWalker(graph)
    repeated, once = walker.walk([5, 9, 5], [1, 2, 1], params), walker.walk([5, 9], [2, 2], params)
    assert np.array_equal(repeated.items, once.items)
    assert np.array_equal(repeated.scores, once.scores)


# `pixie query` as a user meets it: two clusters of users and items, made into a dataset and a
# graph through the CLI; every engagement is an edge (--splits train,val,test)
@pytest.fixture(scope="module")
def graph_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pixie_walk")
    lines = [f"{side}u{u},{side}{i},{t}" for t, (side, u, i) in enumerate(
        (side, u, i) for side in "ab" for u in range(6) for i in range(5) if (u + i) % 5 != 4)]
    (folder / "log.csv").write_text("\n".join(lines) + "\n")
    for args in (["preprocess", "interactions", "--input", str(folder / "log.csv"), "--columns",
                  "user,item,timestamp", "--output", str(folder / "data")],
                 ["pixie", "build", "--data", str(folder / "data"), "--out", str(folder / "g"),
                  "--splits", "train,val,test"]):
        result = run_cli(args)
        assert result.returncode == 0, failure(result)
    return folder / "g"


def query(graph: Path, *args: str):
    return run_cli(["pixie", "query", "--graph", str(graph), *args])


def test_pixie_query_walks_from_items_with_weights_or_a_user(graph_folder):
    result = query(graph_folder, "--items", "a0:3,b0", "--steps", "40000", "--early-stop", "0",
                   "--json")
    assert result.returncode == 0, failure(result)
    answer = json.loads(result.stdout)
    assert answer["steps"] == 40_000 and answer["steps_saved"] == 0
    assert sorted(answer["items"]) == ["a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"]
    mass = {side: sum(s for i, s in zip(answer["items"], answer["scores"]) if i[0] == side)
            for side in "ab"}
    assert mass["a"] / mass["b"] == pytest.approx(3, rel=0.1)  # the clusters are alike
    result = query(graph_folder, "--user", "bu0")  # bu0 engaged b0..b3: they are the queries
    assert result.returncode == 0, failure(result)
    *rows, summary = result.stdout.strip().splitlines()
    assert [row.split("\t")[0] for row in rows] == ["b4"]
    steps = dict(kv.split("=") for kv in summary.removeprefix("pixie: ").split())
    assert steps == {"steps": "100000", "steps_saved": "0"}  # 5 items: never 1000 candidates
    result = query(graph_folder, "--user", "bu0", "--early-stop", "2,50", "--json")
    assert result.returncode == 0, failure(result)
    answer = json.loads(result.stdout)
    assert answer["steps"] + answer["steps_saved"] == 100_000 and answer["steps_saved"] > 0


def test_pixie_query_bad_inputs_are_one_line_errors(graph_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    cases = [  # (arguments, what the error names)
        (["--items", "a0,zz"], "unknown item 'zz'"),
        (["--user", "nobody"], "unknown user 'nobody'"),
        (["--items", "a0:-1"], "weights must be finite, 0 or more"),
        (["--items", "a0:0,b0:0"], "not all 0"),
        (["--items", "a0:x"], "write ITEM or ITEM:WEIGHT"),
        (["--items", "a0", "--early-stop", "many"], "--early-stop: 'many'"),
        (["--items", "a0", "--early-stop=-1,20"], "--early-stop: give N_P,N_V"),
        (["--items", "a0", "--alpha", "0"], "--alpha: the restart probability must be in"),
        (["--items", "a0", "--alpha", "1.5"], "--alpha: the restart probability must be in"),
        (["--items", "a0", "--steps", "0"], "--steps: must be at least 1"),
        (["--items", "a0", "--walkers", "0"], "--walkers: must be at least 1"),
        (["--items", "a0", "--k", "0"], "--k must be at least 1"),
        (["--items", "a0", "--device", "gpu0"], "--device: 'gpu0' is not a device"),
        (["--items", "a0", "--device", "meta"], "--device: meta is not available here"),
        (["--items", "a0", "--graph", str(tmp_path / "empty")], "give a folder `pixie build`")]
    for args, expected in cases:
        result = query(graph_folder, *args)
        assert result.returncode == 2 and expected in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_random_share_is_a_share_of_one_query_commands_not_all_or_none(graph_folder, tmp_path,
                                                                           capsys):
    """Each `pixie query` shows one list: with the random-order draw seeded by --seed, every
    query of one seed drew alike (seed 0: never random at a share of 0.5, so an item-to-item
    log never got the random traffic Memboost's position curve needs)."""
    from dlrm_hybrid.cli import main
    from dlrm_hybrid.serve.impressions import read_impressions

    log = tmp_path / "shown.tsv"
    for _ in range(20):  # both kinds of request by chance: 1 - 2 x 0.5 ** 20
        main(["pixie", "query", "--graph", str(graph_folder), "--items", "a0", "--k", "3",
              "--random-share", "0.5", "--log-impressions", str(log)])
    capsys.readouterr()
    assert set(read_impressions(str(log)).random.tolist()) == {False, True}


def test_an_item_id_with_a_colon_is_an_item_not_an_item_and_a_weight(tmp_path):
    """Raw ids such as `spotify:track:7` name an item (weight 1); `ID:W` still weighs one."""
    lines = [f"u{u},sp:track:{i},{t}" for t, (u, i) in enumerate(
        (u, i) for u in range(6) for i in range(5) if (u + i) % 5 != 4)]
    (tmp_path / "log.csv").write_text("\n".join(lines) + "\n")
    for args in (["preprocess", "interactions", "--input", str(tmp_path / "log.csv"),
                  "--columns", "user,item,timestamp", "--output", str(tmp_path / "data")],
                 ["pixie", "build", "--data", str(tmp_path / "data"), "--out",
                  str(tmp_path / "g"), "--splits", "train,val,test"]):
        assert run_cli(args).returncode == 0
    plain = query(tmp_path / "g", "--items", "sp:track:1", "--json", "--steps", "20000")
    weighed = query(tmp_path / "g", "--items", "sp:track:1:2", "--json", "--steps", "20000")
    assert plain.returncode == 0 and weighed.returncode == 0, failure(plain)
    assert json.loads(plain.stdout) == json.loads(weighed.stdout)  # one query: weight is moot
    assert "sp:track:1" not in json.loads(plain.stdout)["items"]


def test_pixie_query_logs_what_it_showed_for_memboost(graph_folder, tmp_path):
    """--log-impressions appends an item query's rows (query: the query items) and a user's;
    --random-share 1 shows the same items in another order and logs them as random; bad
    settings are one line and write nothing."""
    from dlrm_hybrid.serve.impressions import read_impressions

    log = tmp_path / "shown.tsv"
    plain = json.loads(query(graph_folder, "--items", "a0,a1", "--k", "3", "--json",
                             "--log-impressions", str(log)).stdout)
    shuffled = [json.loads(query(graph_folder, "--items", "a0,a1", "--k", "3", "--json",
                                 "--random-share", "1").stdout)
                for _ in range(8)]  # drawn afresh: all 8 as shown plainly by 6 ** -8
    assert all(sorted(s["items"]) == sorted(plain["items"]) and s["random_order"]
               for s in shuffled) and any(s["items"] != plain["items"] for s in shuffled)
    result = query(graph_folder, "--user", "bu0", "--random-share", "1", "--log-impressions",
                   str(log))
    assert result.returncode == 0, failure(result)
    rows = read_impressions(str(log))
    assert rows.item.tolist()[:3] == plain["items"] and rows.query.tolist()[0] == "a0,a1"
    assert rows.kind.tolist() == [1, 1, 1, 0] and rows.query.tolist()[3] == "bu0"
    assert rows.random.tolist() == [False] * 3 + [True] and rows.position.tolist() == [1, 2, 3, 1]
    for args, says in ((["--random-share", "2"], "--random-share must be between 0 and 1"),
                       (["--log-impressions", str(graph_folder / "items.txt")],
                        "--log-impressions")):
        before = sorted(p.name for p in graph_folder.iterdir())
        result = query(graph_folder, "--items", "a0", *args)
        assert result.returncode == 2 and says in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert sorted(p.name for p in graph_folder.iterdir()) == before
