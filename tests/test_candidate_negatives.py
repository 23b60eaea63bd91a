"""The ranker trained on the funnel's own candidates (`preprocess interactions --labels
--candidates`, data/interactions/ranking_negatives.py; serve/candidate_sources.py) and the
learning-to-rank losses (model/task_heads.py's `ranking_loss`): candidate negatives are never
what the split must not draw, and in train an evaluation item as often as another; the rows are
those after the candidate models' data; models that trained on an evaluation pair are refused;
the features are the sources' ranks and scores; the pairwise and listwise losses equal a hand
computation and train."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import failure, run_cli
from test_recommend import RANKER as RECOMMEND_RANKER
from test_recommend import TWO_TOWER, cli, config_with
from dlrm_hybrid.data.interactions.ranking_negatives import CandidatePool, candidate_blocks
from dlrm_hybrid.model.task_heads import ranking_loss
from dlrm_hybrid.serve.candidate_sources import (CANDIDATE_FEATURES, RANKER_CANDIDATE,
                                                 RECENT, candidate_features,
                                                 similarity_features)

WIDTH = len(CANDIDATE_FEATURES)


def pool_of(users: int, candidates: dict) -> CandidatePool:
    pool = CandidatePool(np.zeros(users, np.int64))
    for user, items in candidates.items():
        pool.items[user] = np.array(items, np.int64)
        pool.features[user] = np.arange(len(items) * WIDTH, dtype=np.float32).reshape(-1, WIDTH)
    return pool


def test_candidate_negatives_are_never_engaged_nor_evaluation_items():
    catalogue, negatives, ratio = 40, 8, 0.75
    pool = pool_of(2, {0: range(12), 1: range(20, 26)})
    engaged = {0: [1, 2, 3, 30], 1: [20, 21, 22, 23, 24]}  # user 1: one free candidate (25)
    evaluation = {0: [4, 5], 1: [31]}  # held pairs: never drawn either
    keys = np.unique([u * catalogue + i for d in (engaged, evaluation) for u, its in d.items()
                      for i in its])
    users = np.array([0] * 50 + [1] * 50)
    items = np.array([1] * 50 + [20] * 50)
    keep, blocks, features, _ = candidate_blocks(
        users, items, np.ones(100, np.int64), pool, keys, catalogue, negatives, ratio, WIDTH,
        np.random.default_rng(0))
    assert keep.all() and blocks.shape == (100, 1 + negatives)
    drawn = blocks[:, 1:]
    assert not np.isin(users[:, None] * catalogue + drawn, keys).any()
    from_pool = round(negatives * ratio)
    assert np.isin(drawn[:50, :from_pool], [0, *range(6, 12)]).all()
    assert (drawn[50:, :from_pool] == 25).all()
    assert len(np.unique(drawn[:50, from_pool:])) > 10  # the rest uniform over the catalogue
    # every row carries its item's candidate features, zeros where no source found it
    np.testing.assert_array_equal(features[0, 0], pool.features[0][1])
    outside = blocks[:50] >= 12
    assert outside.any() and (features[:50][outside] == 0).all()


def test_only_engagements_after_the_cut_that_the_candidates_hold_are_kept():
    pool = pool_of(3, {0: [5, 6, 7], 1: [5]})
    pool.cut[:] = [10, 10, -1]  # user 2: the candidate models do not know it
    users = np.array([0, 0, 0, 0, 1, 2])
    items = np.array([5, 6, 7, 9, 5, 5])
    positions = np.array([9, 10, 11, 12, 11, 11])  # 10: the models' own last row
    engaged = np.unique(users * 20 + items)
    keep, blocks, _, left = candidate_blocks(users, items, positions, pool, engaged, 20, 2, 0.5,
                                             WIDTH, np.random.default_rng(0))
    assert keep.tolist() == [False, False, True, False, True, False]
    assert blocks[:, 0].tolist() == [7, 5]
    assert left == {"before_cut": 2, "user_without_candidates": 1, "not_a_candidate": 1,
                    "user_engaged_every_item": 0}


def test_candidate_features_are_the_sources_ranks_and_scores():
    lists = {"two_tower": (np.array([7, 3]), np.array([0.9, 0.5])),
             "history": (np.array([3]), np.array([0.7])),
             "pixie": (np.array([3, 7, 8]), np.array([40.0, 20.0, 10.0]))}
    got = candidate_features(lists, np.array([3, 7, 9]))
    r = lambda rank: 60 / (60 + rank)  # noqa: E731
    want = [[r(2), 0.5, r(1), 0.7, r(1), 1.0, r(2) + r(1) + r(1)],
            [r(1), 0.9, 0, 0, r(2), 0.5, r(1) + r(2)],
            [0] * 7]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert list(CANDIDATE_FEATURES) == ["rrf_two_tower", "score_two_tower", "rrf_history",
                                        "score_history", "rrf_pixie", "score_pixie", "rrf_merged"]


def test_similarity_features_are_cosines_to_the_latest_history_items():
    vectors = np.array([[1, 0], [0, 2], [1, 1], [3, 0], [0, -1], [5, 5], [-1, 0]], np.float32)
    history = [1, 0, 2, 4, 3, 6]  # most recent first; item 6 is beyond the RECENT read
    assert RECENT == 5
    got = similarity_features(vectors, np.array(history), np.array([0, 5]))
    h = math.sqrt(0.5)
    np.testing.assert_allclose(got, [[1, (0 + 1 + h + 0 + 1) / 5],
                                     [1, (h + h + 1 - h + h) / 5]], rtol=1e-6)
    assert (similarity_features(vectors, np.zeros(0, np.int64), np.array([0, 5])) == 0).all()


def test_the_similarity_history_reads_only_the_candidate_models_pairs():
    """A planted leak: a user's latest rows are an evaluation pair and an engagement after the
    cut (rows the candidate models never trained on): the history the similarity features
    read is the RECENT latest trained pairs, newest first, and never holds them."""
    from dlrm_hybrid.data.interactions.ranking_negatives import recent_before_cut

    catalogue = 10
    log_users = np.array([0, 0, 1, 0, 0, 0, 1, -1, 0, 1, 0, 0])
    log_items = np.array([1, 2, 0, 3, 4, 5, 9, 3, 6, 8, 7, 8])
    trained = np.unique([0 * catalogue + i for i in (1, 2, 3, 4, 5, 6)] + [1 * catalogue + 9])
    chronology = np.arange(len(log_users))  # rows 9 (user 1), 10 and 11 (user 0): not trained
    got = recent_before_cut(trained, catalogue, log_users, log_items, chronology)
    assert sorted(got) == [0, 1]
    assert got[0].tolist() == [6, 5, 4, 3, 2] and got[1].tolist() == [9]


# Two requests of three rows, two tasks; task 1's label of row 5 missing.
LOGITS = torch.tensor([[2.0, 0.5], [0.0, 1.0], [1.0, -1.0], [0.3, 0.2], [-0.2, 0.4], [0.1, 0.0]])
LABELS = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0],
                       [0.0, 0.0], [1.0, 0.0], [0.0, float("nan")]])
WEIGHTS = torch.tensor([1.0, 2.0])


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_pairwise_loss_is_ranknet_over_each_requests_pairs():
    # task 0: request 1 pairs (0>1), (0>2); request 2 pairs (4>3), (4>5)
    task0 = (softplus(0.0 - 2.0) + softplus(1.0 - 2.0) + softplus(0.3 - (-0.2))
             + softplus(0.1 - (-0.2)))
    # task 1: request 1 pairs (0>2), (1>2); request 2 has no positive
    task1 = softplus(-1.0 - 0.5) + softplus(-1.0 - 1.0)
    got = ranking_loss(LOGITS, LABELS, WEIGHTS, "pairwise", 3)
    assert got.item() == pytest.approx((1 * task0 + 2 * task1) / 2, rel=1e-6)


def test_listwise_loss_is_the_softmax_cross_entropy_of_each_request():
    def log_softmax(z, i):
        return z[i] - math.log(sum(math.exp(v) for v in z))

    task0 = -log_softmax([2.0, 0.0, 1.0], 0) - log_softmax([0.3, -0.2, 0.1], 1)
    task1 = -(0.5 * log_softmax([0.5, 1.0, -1.0], 0) + 0.5 * log_softmax([0.5, 1.0, -1.0], 1))
    got = ranking_loss(LOGITS, LABELS, WEIGHTS, "listwise", 3)  # request 2, task 1: no positive
    assert got.item() == pytest.approx((1 * task0 + 2 * task1) / 2, rel=1e-6)


@pytest.mark.parametrize("kind", ["pairwise", "listwise"])
def test_a_ranking_loss_trains_a_scorer_to_put_the_positive_first(kind):
    """Requests of one positive and four negatives; a linear scorer of 3 features, where the
    positive's first feature is higher, learns to put it first."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, 3, generator=gen)
    x[:, 0, 0] += 1.5
    labels = torch.zeros(64 * 5, 1)
    labels[::5] = 1
    w = torch.zeros(3, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=0.5)
    first = None
    for _ in range(60):
        loss = ranking_loss((x @ w).reshape(-1, 1), labels, torch.ones(1), kind, 5)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.8 * first
    top = (x @ w).detach().argmax(1)
    assert (top == 0).float().mean() > 0.7


def test_a_ranking_loss_needs_tasks_and_a_group_dividing_the_batch():
    from dlrm_hybrid.config import Config, ConfigError, TaskConfig
    from dlrm_hybrid.config_checks import validate

    cfg = Config()
    cfg.model.tasks = [TaskConfig("click")]
    cfg.model.ranking_loss.kind, cfg.model.ranking_loss.group = "listwise", 6
    with pytest.raises(ConfigError, match="model.ranking_loss.group"):
        validate(cfg, 1)
    cfg.model.ranking_loss.group = 8
    validate(cfg, 1)
    cfg.model.ranking_loss.kind = "softmax"
    with pytest.raises(ConfigError, match="model.ranking_loss.kind"):
        validate(cfg, 1)


# --- end to end: a planted log, its early models, the candidate dataset, the served ranker ---

USERS, ITEMS, CLUSTERS = 80, 40, 4
# test_recommend's models, smaller: a listwise ranker of two tasks
TOWER = config_with(TWO_TOWER, {
    "model.embedding_dim": 8, "model.user_tower.mlp": [16, 8], "model.item_tower.mlp": [16, 8],
    "data.global_batch_size": 64, "train.max_steps": 40, "train.log_every": 40})
RANKER = config_with(RECOMMEND_RANKER, {
    "model.tasks": [{"name": "watched"}, {"name": "liked"}],
    "model.ranking_loss": {"kind": "listwise", "group": 4}, "data.global_batch_size": 64,
    "train.max_steps": 20, "train.log_every": 20, "value_model": {"watched": 0.5, "liked": 1.0}})


def planted_rows() -> list:
    """(user, item, rating, timestamp): each user rates 14 items, mostly of its cluster."""
    rng = np.random.default_rng(1)
    rows = []
    for u in range(USERS):
        per = ITEMS // CLUSTERS
        mine = (u % CLUSTERS) * per + rng.choice(per, 8, replace=False)
        other = rng.choice(np.setdiff1d(np.arange(ITEMS), mine), 6, replace=False)
        items = rng.permutation(np.concatenate([mine, other]))
        rows += [(f"u{u}", f"i{i}", 5 if i in mine else int(rng.integers(1, 4)), 100 * t + u)
                 for t, i in enumerate(items)]
    return rows


@pytest.fixture(scope="module")
def early(tmp_path_factory):
    """The log's retrieval dataset, its early one (--holdout-recent 3), the early two-tower
    model and graph, and the ranking dataset made from their candidates."""
    root = tmp_path_factory.mktemp("candidates")
    rows = planted_rows()
    (root / "log.csv").write_text("".join(",".join(map(str, r)) + "\n" for r in rows))
    read = ["preprocess", "interactions", "--input", str(root / "log.csv"),
            "--columns", "user,item,rating,timestamp"]
    cli(*read, "--output", str(root / "ret"))
    cli(*read, "--output", str(root / "early"), "--holdout-recent", "3")
    (root / "tt.yaml").write_text(TOWER)
    for data, tower in (("early", "T_early"), ("ret", "T")):
        cli("train", "--config", str(root / "tt.yaml"), "--set", f"data.path={root / data}",
            "--set", f"train.run_dir={root / (tower + '_run')}")
        cli("export", "--retrieval", "--checkpoint",
            str(root / f"{tower}_run/checkpoints/step_40"),
            "--out", str(root / tower))
    cli("pixie", "build", "--data", str(root / "early"), "--out", str(root / "G_early"))
    cli("pixie", "build", "--data", str(root / "ret"), "--out", str(root / "G"))
    ranking = [*read, "--labels", "watched,liked:rating>=4", "--ranking-negatives", "3",
               "--holdout", str(root / "ret"), "--candidate-ratio", "0.67"]
    made = cli(*ranking, "--output", str(root / "rank"), "--candidates",
               f"{root / 'T_early'},{root / 'G_early'}")
    return root, rows, ranking, made.stdout


def pairs_of(folder: Path, split: str):
    """(user, item) raw ids of each row of a ranking split, and its first label."""
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    users = (folder / "users.txt").read_text().split()
    items = (folder / "items.txt").read_text().split()
    data = SplitBinaryDataset(str(folder))
    data.use_tasks(list(data.label_names), str(folder))
    c = data.columns(split, 0, data.num_samples(split))
    return ([(users[u], items[i]) for u, i in zip(c.ids[0][:, 0], c.ids[1][:, 0])],
            c.labels[:, 0], c.dense)


def held(retrieval: Path) -> set:
    users = (retrieval / "users.txt").read_text().split()
    items = (retrieval / "items.txt").read_text().split()
    return {(users[u], items[i]) for s in ("val", "test")
            for u, i in zip(np.load(retrieval / f"{s}_user.npy"),
                            np.load(retrieval / f"{s}_item.npy"))}


def test_candidate_dataset_rows_come_after_the_early_models_and_negatives_mark_no_evaluation_item(
        early):
    """Engagements after the early models' data; validation and test negatives never an
    engagement nor an evaluation item; train negatives never a train engagement, but an
    evaluation item (--holdout's, the dataset's validation and test) among them as any other
    candidate, or a ranker would learn that the candidate never drawn is the one to rank."""
    root, rows, _, stdout = early
    engaged = {(u, i) for u, i, _, _ in rows}
    evaluation = held(root / "ret")
    when = {(u, i): t for u, i, _, t in rows}
    left = {}  # the rows --holdout leaves, by user, in time order: leave-last-out's split
    for u, i, _, t in sorted(rows, key=lambda r: r[3]):
        if (u, i) not in evaluation:
            left.setdefault(u, []).append((u, i))
    trained = {p for pairs in left.values() for p in pairs[:-2]}
    users = (root / "early/users.txt").read_text().split()
    items = (root / "early/items.txt").read_text().split()
    last_early = {}
    for u, i in zip(np.load(root / "early/train_user.npy"),
                    np.load(root / "early/train_item.npy")):
        last_early[users[u]] = max(last_early.get(users[u], -1), when[(users[u], items[i])])
    train_negatives = set()
    for split in ("train", "val", "test"):
        pairs, label, dense = pairs_of(root / "rank", split)
        assert len(pairs) % 4 == 0 and (label[::4] == 1).all()
        assert (label.reshape(-1, 4)[:, 1:] == 0).all()
        for (u, i), positive in zip(pairs, label):
            if positive:  # an engagement after every pair the candidate models trained on
                assert when[(u, i)] > last_early[u]
            elif split == "train":
                assert (u, i) not in trained
                train_negatives.add((u, i))
            else:
                assert (u, i) not in engaged and (u, i) not in evaluation
        assert dense.shape[1] == 2 + len(RANKER_CANDIDATE)
        assert (dense[::4, 2:].max(1) > 0).all()  # every engagement is a candidate
    assert train_negatives & (engaged - trained)  # evaluation items drawn too
    assert "candidates engagements left out" in stdout


def test_training_rows_similarity_is_to_the_latest_early_items_never_an_evaluation_one(early):
    """Each train engagement's similarity features are the cosines (early tower's vectors)
    to its user's RECENT latest early training items: recomputed here from the early dataset
    they match, and a history that also held the user's evaluation items (a leak) would not."""
    root = early[0]
    vectors = np.load(root / "T_early/item_vectors.npy")
    tower_item = {n: i for i, n in enumerate((root / "T_early/items.txt").read_text().split())}
    users = (root / "early/users.txt").read_text().split()
    items = (root / "early/items.txt").read_text().split()
    latest = {}
    for u, i, p in sorted(zip(np.load(root / "early/train_user.npy"),
                              np.load(root / "early/train_item.npy"),
                              np.load(root / "early/train_position.npy")), key=lambda r: -r[2]):
        latest.setdefault(users[u], []).append(tower_item[items[i]])
    evaluation = {}
    for u, i in held(root / "ret"):
        evaluation.setdefault(u, []).append(tower_item[i])
    pairs, _, dense = pairs_of(root / "rank", "train")
    want, leaky = np.zeros((len(pairs), 2)), np.zeros((len(pairs), 2))
    for row, (u, i) in enumerate(pairs):
        item = np.array([tower_item[i]])
        want[row] = similarity_features(vectors, np.array(latest[u]), item)[0]
        leaky[row] = similarity_features(vectors, np.array(evaluation[u] + latest[u]), item)[0]
    np.testing.assert_allclose(dense[:, -2:], want, atol=2e-3)  # stored as float16
    assert np.abs(leaky - want).max(1).mean() > 0.05


def test_candidate_models_that_saw_an_evaluation_pair_are_refused(early, tmp_path):
    """A planted leak: the early tower's training items gain one test pair of the retrieval
    dataset (its features would then carry the evaluation split): refused in one line. The
    full retrieval model (trained on the ranking dataset's validation and test rows) too."""
    root, _, ranking, _ = early
    leaky = tmp_path / "T_leaky"
    shutil.copytree(root / "T_early", leaky)
    ret_users = (root / "ret/users.txt").read_text().split()
    ret_items = (root / "ret/items.txt").read_text().split()
    user = ret_users[np.load(root / "ret/test_user.npy")[0]]
    item = ret_items[np.load(root / "ret/test_item.npy")[0]]
    users = (leaky / "users.txt").read_text().split()
    items = (leaky / "items.txt").read_text().split()
    indptr, seen = np.load(leaky / "seen_indptr.npy"), np.load(leaky / "seen_items.npy")
    u = users.index(user)
    seen = np.insert(seen, indptr[u], items.index(item))
    indptr[u + 1:] += 1
    np.save(leaky / "seen_indptr.npy", indptr)
    np.save(leaky / "seen_items.npy", seen)
    for tower, graph in ((leaky, root / "G_early"), (root / "T", root / "G")):
        result = run_cli([*ranking, "--output", str(tmp_path / f"out_{tower.name}"),
                          "--candidates", f"{tower},{graph}"])
        assert result.returncode != 0 and "evaluation pairs" in result.stderr, failure(result)
        assert not (tmp_path / f"out_{tower.name}").exists()


@pytest.fixture(scope="module")
def ranker(early) -> Path:
    """A ranker trained (listwise) on the candidate dataset, exported."""
    root = early[0]
    (root / "rk.yaml").write_text(RANKER)
    cli("train", "--config", str(root / "rk.yaml"), "--set", f"data.path={root / 'rank'}",
        "--set", f"train.run_dir={root / 'rk'}")
    cli("export", "--checkpoint", str(root / "rk/checkpoints/step_20"), "--out",
        str(root / "M.pt"))
    return root / "M.pt"


def test_the_served_ranker_reads_the_candidate_features_of_the_request(early, ranker):
    """`Recommender` passes each merged candidate's features from its own sources, the ones
    candidate_features computes."""
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    root = early[0]
    rec = Recommender(str(root / "T"), str(root / "G"), str(ranker),
                      settings=RecommendSettings(k=5, per_source=10, rank_top=20))
    seen_rows = []
    rows = rec.features.rows
    rec.features.rows = (lambda u, items, extra=None, at=None:
                         seen_rows.append(extra) or rows(u, items, extra, at))
    user = 0
    history = rec.retriever.seen(user)
    answer = rec.recommend_dense(user, history, history)
    lists = {s: rec.sources.source(s, user, history, history) for s in ("two_tower", "history",
                                                                         "pixie")}
    merged = answer.stages["merged"][:20]
    np.testing.assert_allclose(seen_rows[0], np.concatenate(
        [candidate_features(lists, merged),
         similarity_features(rec.retriever.item_vectors, history, merged)], axis=1), rtol=1e-6)
    assert (seen_rows[0].max(1) > 0).all() and len(answer.items) == 5
    with pytest.raises(Exception, match="candidate features"):
        rows(0, np.array([0, 1]))


def test_a_dataset_made_before_the_similarity_features_still_serves(early, tmp_path):
    """A candidate dataset without the similarity features (as made before them: the two counts
    and CANDIDATE_FEATURES) loads; its rows take the candidate features alone."""
    import yaml

    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    old = tmp_path / "rank_old"
    shutil.copytree(early[0] / "rank", old)
    spec = yaml.safe_load((old / "feature_spec.yaml").read_text())
    dropped = len(RANKER_CANDIDATE) - len(CANDIDATE_FEATURES)
    names = spec["channel_spec"]["numerical"]
    for name in names[-dropped:]:
        del spec["feature_spec"][name]
    for sources in spec["source_spec"].values():
        sources[0]["features"] = names[:-dropped]
    spec["channel_spec"]["numerical"] = names[:-dropped]
    spec["metadata"]["numerical_features"] = spec["metadata"]["numerical_features"][:-dropped]
    (old / "feature_spec.yaml").write_text(yaml.safe_dump(spec))
    for split in ("train", "validation", "test"):
        dense = np.fromfile(old / split / "numerical.bin", np.float16).reshape(-1, len(names))
        dense[:, :-dropped].copy().tofile(old / split / "numerical.bin")
    features = RankingFeatures(str(old))
    assert features.candidate_features and not features.similarity_features
    dense, _ = features.rows(0, np.array([0, 1]), np.ones((2, len(CANDIDATE_FEATURES))))
    assert dense.shape == (2, 2 + len(CANDIDATE_FEATURES))
    assert RankingFeatures(str(early[0] / "rank")).similarity_features


def test_a_stored_users_request_reads_the_latest_training_items_first(early, ranker, tmp_path):
    """`recommend --user` without --history: the history the similarity features read is the
    user's training items newest first (the log's timestamps, as the training rows had them),
    the same answer as that history given with the request; an export without the items' time
    order is refused in one line, not served with arbitrary 'latest' items."""
    from dlrm_hybrid.errors import UserError
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    root, rows = early[0], early[1]
    settings = RecommendSettings(k=5, per_source=10, rank_top=20)
    rec = Recommender(str(root / "T"), str(root / "G"), str(ranker), settings=settings)
    users = (root / "ret" / "users.txt").read_text().split()
    items = (root / "ret" / "items.txt").read_text().split()
    train = set(zip(np.load(root / "ret" / "train_user.npy").tolist(),
                    np.load(root / "ret" / "train_item.npy").tolist()))
    reordered = 0
    for u in range(5):
        newest_first = [i for _, i in sorted(((t, i) for user, i, _, t in rows
                                              if user == users[u]), reverse=True)
                        if (u, items.index(i)) in train]
        stored = [items[i] for i in rec.stored_latest_first(u)]
        assert stored == newest_first
        reordered += stored[:RECENT] != [items[i] for i in rec.retriever.seen(u)][:RECENT]
        asked = rec.recommend(users[u])
        given = rec.recommend(users[u], newest_first)
        assert asked.names == given.names and np.array_equal(asked.value, given.value)
    assert reordered  # the id order would have given the features other items
    old = tmp_path / "T_old"
    shutil.copytree(root / "T", old)
    for name in ("history_indptr.npy", "history_items.npy"):
        (old / name).unlink()
    old_rec = Recommender(str(old), str(root / "G"), str(ranker), settings=settings)
    with pytest.raises(UserError, match="no training items in time order.*export it again"):
        old_rec.recommend(users[0])
    assert old_rec.recommend(users[0], [items[i] for i in rec.stored_latest_first(0)]).names
