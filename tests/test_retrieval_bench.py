"""The peers of benchmarks/retrieval.py (dlrm_hybrid/retrieval/peers.py) are scored by the
two-tower evaluation: their numbers must be the ranks a brute-force scoring gives, with the
user's earlier items left out, and their training must see the training split only."""

import math

import numpy as np
import pytest

from dlrm_hybrid.config import RetrievalConfig
from dlrm_hybrid.data.interactions.interaction_data import InteractionData
from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta
from dlrm_hybrid.retrieval import peers


def interactions(users: int, items: int, train, val, test) -> InteractionData:
    """A log of (user, item) pairs per split, ids only."""
    pairs = {s: (np.array([u for u, _ in p], np.int64), np.array([i for _, i in p], np.int64))
             for s, p in (("train", train), ("val", val), ("test", test))}
    return InteractionData(InteractionMeta(users, items), pairs, np.zeros((users, 0), np.int64),
                           np.zeros((items, 0), np.int64))


EARLIER = {"val": ("train",), "test": ("train", "val")}


def brute_force(scores: np.ndarray, data: InteractionData, ks, split: str) -> dict:
    """`split`'s recall/hr/ndcg@K and mrr from the full score matrix, the earlier splits' items
    masked, and not relevant (a re-watch is never served)."""
    scores = scores.copy()
    earlier = {(int(u), int(i)) for s in EARLIER[split] for u, i in zip(*data.pairs[s])}
    for u, i in earlier:
        scores[u, i] = -np.inf
    relevant = {}
    for u, i in zip(*data.pairs[split]):
        if (int(u), int(i)) not in earlier:
            relevant.setdefault(int(u), set()).add(int(i))
    sums = {}
    for u, items in relevant.items():
        ranks = sorted(int((scores[u] > scores[u, i]).sum()) for i in items)
        for k in ks:
            hits = [r for r in ranks if r < k]
            ideal = sum(1 / math.log2(j + 2) for j in range(min(len(items), k)))
            for name, value in (("recall", len(hits) / min(len(items), k)), ("hr", bool(hits)),
                                ("ndcg", sum(1 / math.log2(r + 2) for r in hits) / ideal)):
                sums[f"{split}_{name}@{k}"] = sums.get(f"{split}_{name}@{k}", 0) + value
        sums[f"{split}_mrr"] = sums.get(f"{split}_mrr", 0) + 1 / (ranks[0] + 1)
    return {k: v / len(relevant) for k, v in sums.items()}, len(relevant)


@pytest.mark.parametrize("split", ["val", "test"])
def test_peer_metrics_are_the_brute_force_ranks_with_earlier_items_left_out(split):
    rng = np.random.default_rng(3)
    users, items = 7, 12
    val = [(u, (u * 5 + 1) % items) for u in range(users)]
    test = [(u, (u * 7 + 4) % items) for u in range(users)] + [(2, 11), (5, 0)]  # 2 for some
    later = set(val + test)
    train = [(u, int(i)) for u in range(users)
             for i in [i for i in rng.permutation(items) if (u, i) not in later][:3]]
    val += [train[0], train[4]]  # re-watches: users 0 and 1 again with a training item
    test += [train[7], val[3]]  # user 2 with a training item, user 3 with its val item
    data = interactions(users, items, train, val, test)
    vectors = rng.normal(size=(users, 4)), rng.normal(size=(items, 4))
    cfg = RetrievalConfig(eval_k=[1, 3, 5])
    got = peers.evaluate_peer(vectors, data, cfg, split, batch=4)  # users over two batches
    want, counted = brute_force(vectors[0] @ vectors[1].T, data, cfg.eval_k, split)
    assert got["users"] == counted == users
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_popularity_ranks_unseen_items_by_training_count():
    # training counts: item 3 x3, items 1 and 4 x2; validation's item 0 x3 is not popularity
    train = [(0, 3), (1, 3), (2, 3), (1, 1), (2, 1), (0, 4), (2, 4)]
    data = interactions(4, 6, train, val=[(0, 5), (1, 0), (2, 0), (3, 0)],
                        test=[(0, 1), (1, 4), (2, 2), (3, 3)])
    got = peers.evaluate_peer(peers.popularity(data), data, RetrievalConfig(eval_k=[1, 2]))
    # each user's test item is the most engaged one in training they have not seen (user 2:
    # items 2 and 5 were never engaged in training, the lower id first)
    assert got["test_recall@1"] == 1.0


def test_popularity_breaks_equal_counts_by_lower_item_id():
    # counts: 3 x2; 1, 2, 4 x1; user 0 saw 2 and wants 4, which ties with 1 (and the seen 2)
    data = interactions(2, 6, [(1, 3), (1, 3), (1, 1), (1, 4), (0, 2)], [], [(0, 4)])
    got = peers.evaluate_peer(peers.popularity(data), data, RetrievalConfig(eval_k=[1, 2]))
    assert got["test_mrr"] == pytest.approx(1 / 3)  # 3, then 1, then 4: no tie flatters 4


@pytest.mark.parametrize("fit", [peers.als, peers.bpr], ids=["als", "bpr"])
def test_implicit_peers_learn_the_training_split_user_by_item(fit, monkeypatch):
    # threadpoolctl, which `implicit` imports, sets this in os.environ; set here, it goes again
    # at the end (tests/conftest.py: later runs would not fork from the zygote)
    monkeypatch.setenv("KMP_DUPLICATE_LIB_OK", "True")
    # two communities of 6 users x 4 items; each user engaged with 3 of their community's items
    # in training; the 4th is their test item, which only the other members' training shows
    users, items, block = 12, 8, 4
    train, test = [], []
    for u in range(users):
        mine = [(u // 6) * block + j for j in range(block)]
        held = mine[u % block]
        train += [(u, i) for i in mine if i != held]
        test.append((u, held))
    data = interactions(users, items, train, [], test)
    matrix = peers.train_matrix(data)
    assert matrix.shape == (users, items) and matrix.nnz == len(train)
    vectors = fit(data, factors=4, iterations=200, seed=1, threads=1)
    got = peers.evaluate_peer(vectors, data, RetrievalConfig(eval_k=[1]))
    assert got["test_recall@1"] == 1.0
