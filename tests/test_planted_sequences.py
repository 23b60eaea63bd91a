"""The planted sequential log (data/interactions/planted_sequences.py): a seeded world that
preprocess reads as generated, and exact scores: the oracle and the filter against brute force
on a tiny world, the oracle's corner case, the oracle above popularity, and the benchmark's --work
folder of each world."""

import itertools

import numpy as np
import yaml

from conftest import load_script, run_cli
from dlrm_hybrid.data.interactions import planted_sequences as ps


def failure(result):
    return f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


def test_a_seed_gives_one_log_with_strictly_increasing_times_and_no_repeats():
    a, b = ps.planted_sequences(200, 300, seed=3), ps.planted_sequences(200, 300, seed=3)
    for field in ("user", "item", "time", "topic", "new_session", "home", "weights"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.item, ps.planted_sequences(200, 300, seed=4).item)
    lengths = np.diff(a.starts)
    assert (np.diff(a.user) >= 0).all() and lengths.min() >= a.world.min_len
    same_user = np.diff(a.user) == 0
    assert (np.diff(a.time)[same_user] > 0).all()  # the split's order is the generation's
    gaps = np.diff(a.time)[same_user]
    starts = a.new_session[1:][same_user]
    assert gaps[starts].min() > ps.IN_SESSION[1] >= gaps[~starts].max()  # the times show them
    assert len(np.unique(a.user * a.world.items + a.item)) == len(a.item)
    assert a.new_session[a.starts[:-1]].all()


def test_the_log_preprocesses_as_generated(tmp_path):
    log = ps.planted_sequences(60, 300, seed=1)
    ps.write_log(tmp_path / "u.data", log)
    result = run_cli(["preprocess", "interactions", "--input", str(tmp_path / "u.data"),
                      "--output", str(tmp_path / "data")])
    assert result.returncode == 0, failure(result)
    meta = yaml.safe_load((tmp_path / "data/interactions.yaml").read_text())
    assert meta["extra"]["not_positive"] == 0 and meta["timestamps"]
    assert sum(meta["samples"].values()) == len(log.item)
    assert meta["users"] == 60 and meta["items"] == len(np.unique(log.item))
    users = np.array((tmp_path / "data/users.txt").read_text().split(), np.int64) - 1
    items = np.array((tmp_path / "data/items.txt").read_text().split(), np.int64) - 1
    for split, back in (("test", 1), ("val", 2)):
        u = users[np.load(tmp_path / f"data/{split}_user.npy")]
        i = items[np.load(tmp_path / f"data/{split}_item.npy")]
        assert sorted(u) == list(range(60))
        np.testing.assert_array_equal(i[np.argsort(u)], log.item[log.starts[1:] - back])


def brute_force(log, user, timed):
    """P(home, current topic | the items before the last) by summing every path of topics and
    session starts: the model's definition written out, no filter."""
    w = log.world
    x = log.item[log.starts[user]:log.starts[user + 1] - 1]
    starts = log.new_session[log.starts[user]:log.starts[user + 1] - 1]
    post = np.zeros((w.topics, w.topics))
    for h in range(w.topics):
        for path in itertools.product(range(w.topics), repeat=len(x)):
            for fresh in itertools.product((False, True), repeat=len(x) - 1):
                if timed and list(fresh) != list(starts[1:]):
                    continue
                p = (w.home_q * (path[0] == h) + (1 - w.home_q - w.drift) / w.topics
                     + w.drift / w.topics) / w.topics  # item 0 starts a session: no drift yet
                for t in range(1, len(x)):
                    if not fresh[t - 1]:
                        p *= w.continue_p * (path[t] == path[t - 1])
                    else:
                        p *= (1 - w.continue_p) * (
                            w.home_q * (path[t] == h) + w.drift * (path[t] == (path[t - 1] + 1)
                                                                   % w.topics)
                            + (1 - w.home_q - w.drift) / w.topics)
                for t, z in enumerate(path):
                    p *= log.weights[z, x[t]] / (1 - log.weights[z, x[:t]].sum())
                post[h, path[-1]] += p
    return post / post.sum()


def test_the_filter_and_the_oracle_are_the_models_probabilities():
    log = ps.planted_sequences(6, 12, seed=5, topics=3, topic_size=8, min_len=4, max_len=4,
                               drift=0.0, home_q=0.4, continue_p=0.6)
    rows = np.arange(6)
    for timed in (True, False):
        got = ps._posterior(log, rows, timed)
        for user in rows:
            np.testing.assert_allclose(got[user], brute_force(log, user, timed), atol=1e-12)
    state = ps._state(log, rows)
    score = ps._mixture(log, rows, state)
    w = log.world
    for user in rows:
        seen = log.item[log.starts[user]:log.starts[user + 1] - 1]
        z, h = log.topic[log.starts[user + 1] - 2], log.home[user]
        left = np.ones(w.items, bool)
        left[seen] = False
        own = log.weights[z] * left / (log.weights[z] * left).sum()
        new = sum((w.home_q * (t == h) + (1 - w.home_q - w.drift) / w.topics)
                  * log.weights[t] * left / (log.weights[t] * left).sum() for t in range(3))
        np.testing.assert_allclose(score[user][left], (w.continue_p * own + (1 - w.continue_p)
                                                       * new)[left], atol=1e-12)


def test_the_drift_moves_to_the_next_topic_in_the_filter_as_in_the_world():
    log = ps.planted_sequences(8, 40, seed=2, topics=4, topic_size=10, min_len=3, max_len=3,
                               drift=1.0, home_q=0.0, continue_p=0.0)
    for user in range(8):  # every item starts a session on the next topic: all known from one
        topics = log.topic[log.starts[user]:log.starts[user + 1]]
        np.testing.assert_array_equal(np.diff(topics) % 4, 1)
        post = ps._posterior(log, np.array([user]), timed=True)[0]
        assert post.sum(0)[topics[-2]] > 0.99  # 10 items a topic, step 10: no overlap


def test_one_topic_of_ten_items_always_hits_at_ten():
    log = ps.planted_sequences(30, 10, seed=0, topics=1, topic_size=10, min_len=3, max_len=9)
    found = ps.ceiling(log)
    assert found["hr@10"] == 1.0 and found["bayes_hr@10"] == 1.0
    ranks = []  # one topic: the oracle ranks the unseen items by their weight, exactly
    for user in range(30):
        mine = log.item[log.starts[user]:log.starts[user + 1]]
        weight = log.weights[0]
        ranks.append((np.delete(weight, mine) > weight[mine[-1]]).sum())
    assert abs(found["mrr"] - np.mean(1.0 / (np.array(ranks) + 1.0))) < 1e-12


def test_the_oracle_beats_popularity_and_the_times_are_worth_something():
    found = ps.ceiling(ps.planted_sequences(600, 500, seed=0, topics=20, topic_size=50,
                                            max_len=30))
    assert found["hr@10"] > 2 * found["popularity_hr@10"] + 0.1
    assert found["hr@10"] >= found["bayes_hr@10"] - 0.02
    assert found["bayes_mrr"] > found["bayes_untimed_mrr"]
    assert found["users"] == 600


def test_the_benchmark_keeps_each_worlds_dataset_in_its_own_work_folder(tmp_path, monkeypatch):
    """benchmarks/sequential_planted.py --work run again (with other --users) measures its own
    world's dataset: neither refused by preprocess nor the first log's dataset read again; a
    relative --work is where the script runs."""
    sequential_planted = load_script("benchmarks/sequential_planted.py", "sequential_planted")
    asked = []
    fields = ("hstu_hr@10", "sasrec_hr@10", "hstu_hr@10_se", "sasrec_hr@10_se",
              "hstu_ndcg@10", "sasrec_ndcg@10")
    monkeypatch.setattr(sequential_planted, "sequential",
                        lambda folder, args: asked.append(folder) or dict.fromkeys(fields, 0.1))
    monkeypatch.chdir(tmp_path)  # --work relative to here (preprocess runs in the checkout)
    for users in (40, 60, 40):
        monkeypatch.setattr("sys.argv", ["sequential_planted.py", "--quick", "--users",
                                          str(users), "--work", "work"])
        sequential_planted.main()
        assert len(np.load(asked[-1] / "test_user.npy")) == users
    assert asked[0] == asked[2] != asked[1]
