"""The peers of benchmarks/retrieval.py (dlrm_hybrid/retrieval/peers.py) are scored by the
two-tower evaluation: their numbers must be the ranks a brute-force scoring gives, with the
user's earlier items left out, and their training must see the training split only. Its
SASRec-style reference (benchmarks/sasrec.py) trains on the training sequences only, predicts
the next item from the order of a history, and runs in the script's --quick run."""

import math
import re

import numpy as np
import pytest
import torch
from conftest import ROOT, failure, load_script, run_cli

from dlrm_hybrid.config import RetrievalConfig
from dlrm_hybrid.data.interactions.interaction_data import InteractionData
from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta
from dlrm_hybrid.retrieval import peers


def interactions(users: int, items: int, train, val, test) -> InteractionData:
    """A log of (user, item) pairs per split, ids only; each user's rows in time order."""
    pairs = {s: (np.array([u for u, _ in p], np.int64), np.array([i for _, i in p], np.int64))
             for s, p in (("train", train), ("val", val), ("test", test))}
    train_users = pairs["train"][0]
    position = np.array([np.sum(train_users[:row] == u) for row, u in enumerate(train_users)],
                        np.int64)
    return InteractionData(InteractionMeta(users, items), pairs, np.zeros((users, 0), np.int64),
                           np.zeros((items, 0), np.int64), train_position=position)


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


@pytest.fixture(scope="module")
def sasrec():
    """benchmarks/sasrec.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/sasrec.py", "sasrec")


def cycles(users: int, items: int, length: int, seed: int = 0) -> InteractionData:
    """Each user walks the item cycle 0 -> 1 -> ... -> items - 1 -> 0 from a random start:
    `length` training items, then the next as validation, the one after as test."""
    rng = np.random.default_rng(seed)
    train, val, test = [], [], []
    for u in range(users):
        start = int(rng.integers(items))
        walk = [(start + t) % items for t in range(length + 2)]
        train += [(u, i) for i in walk[:length]]
        val.append((u, walk[length]))
        test.append((u, walk[length + 1]))
    return interactions(users, items, train, val, test)


def test_sasrec_trains_on_each_users_training_sequence_only(sasrec, monkeypatch):
    # items 0-9 are training items; every validation and test item (10-13) is held out
    train = [(0, 3), (1, 5), (0, 1), (1, 2), (0, 4), (2, 7), (1, 9), (0, 8), (0, 6), (2, 0)]
    data = interactions(4, 14, train, [(0, 10), (1, 11), (2, 12)], [(0, 13), (1, 12), (2, 10)])
    seen_inputs, seen_targets = [], []
    forward, loss = sasrec.SASRec.forward, torch.nn.functional.cross_entropy

    def recording_forward(model, ids, counts):
        if model.training:
            used = torch.arange(ids.shape[1])[None, :] < counts[:, None]
            seen_inputs.extend(ids[used].tolist())
        return forward(model, ids, counts)

    def recording_loss(logits, targets):
        seen_targets.extend(targets.tolist())
        return loss(logits, targets)

    monkeypatch.setattr(sasrec.SASRec, "forward", recording_forward)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", recording_loss)
    sasrec.train(data, RetrievalConfig(eval_k=[10]), maxlen=4, dropout=0.0, epochs=1)
    # every position predicts the next training item of the user's last 4 + 1: user 0's
    # 1, 4, 8, 6 from 3, 1, 4, 8; user 1's 2, 9 from 5, 2; user 2's 0 from 7; user 3 has none
    assert sorted(seen_targets) == sorted([1, 4, 8, 6, 2, 9, 0])
    assert sorted(seen_inputs) == sorted([3, 1, 4, 8, 5, 2, 7])
    inputs, targets, counts = sasrec.training_sequences(data, 4)
    assert inputs[0].tolist() == [3, 1, 4, 8] and targets[0].tolist() == [1, 4, 8, 6]
    assert counts.tolist() == [4, 2, 1]


def test_sasrec_position_t_reads_the_items_up_to_t_only(sasrec):
    # training predicts item t + 1 from slot t: were slot t to read slot t + 1, it would copy
    model = sasrec.SASRec(items=20, maxlen=8, dropout=0.0, dim=16).eval()
    ids = torch.tensor([[3, 7, 1, 9, 4, 12, 5, 0]])
    later = ids.clone()
    later[0, 4:7] = torch.tensor([18, 2, 6])
    counts = torch.tensor([7])
    before, after = model(ids, counts), model(later, counts)
    assert torch.allclose(before[0, :4], after[0, :4], atol=1e-6)
    assert not torch.allclose(before[0, 4:7], after[0, 4:7], atol=1e-3)


def test_sasrec_scores_test_from_the_training_and_validation_items(sasrec):
    data = cycles(users=6, items=9, length=5)
    model = sasrec.SASRec(data.items, maxlen=8, dropout=0.0, dim=8).eval()
    for split, earlier in (("val", ("train",)), ("test", ("train", "val"))):
        indptr, items = data.engaged(earlier)
        vectors = sasrec.user_vectors(model, data, split)
        for u in range(data.users):
            timeline = data.histories_of(8).timeline(split, u)
            assert sorted(timeline) == sorted(items[indptr[u]:indptr[u + 1]])
            ids = torch.zeros(1, 8, dtype=torch.int64)
            ids[0, :len(timeline)] = torch.from_numpy(timeline)
            want = model.user_vectors(ids, torch.tensor([len(timeline)]))[0]
            assert np.allclose(vectors[u], want.detach().numpy(), atol=1e-6), (split, u)


def test_sasrec_learns_the_next_item_from_the_order_of_the_history(sasrec, monkeypatch):
    # every user's items are a walk around one cycle: the next item follows from the last
    # one alone, which a bag of the user's items (ALS, popularity) cannot tell
    data = cycles(users=64, items=40, length=6)
    cfg = RetrievalConfig(eval_k=[1])
    monkeypatch.setattr(sasrec, "BATCH", 16)  # 4 steps an epoch
    val, weights, _, _ = sasrec.train(data, cfg, maxlen=8, dropout=0.0, epochs=30,
                                      metric="val_recall@1")
    model = sasrec.SASRec(data.items, 8, 0.0)
    model.load_state_dict(weights)
    assert val["val_recall@1"] >= 0.95
    assert sasrec.evaluate(model, data, cfg, "test")["test_recall@1"] >= 0.95


def test_the_quick_run_reports_the_sasrec_reference_beside_the_history_towers(
        tmp_path, monkeypatch, capsys):
    """The script in this process, its CLI commands forked from the tests' CLI zygote (the
    same commands, without a fresh interpreter's imports each)."""
    bench = load_script("benchmarks/retrieval.py", "retrieval_bench_quick")
    commands = []

    def cli(args, ranks=0):
        commands.append(args[:2])
        run = run_cli(args, nproc=ranks, timeout=600)
        assert run.returncode == 0, failure(run)
        return run.stdout

    monkeypatch.setattr(bench, "cli", cli)
    with monkeypatch.context() as env:  # as in test_implicit_peers_...: undone on leaving
        env.setenv("KMP_DUPLICATE_LIB_OK", "True")
        import implicit  # noqa: F401  (its threadpoolctl sets that variable once, on import)
    log = tmp_path / "ml-tiny" / "u.data"
    log.parent.mkdir()
    rng = np.random.default_rng(0)
    log.write_text("".join(f"{u}\t{(start + t) % 30 + 1}\t5\t{1000 + t}\n" for u in range(1, 41)
                           for start in [int(rng.integers(30))] for t in range(9)))  # 280 train
    monkeypatch.setattr("sys.argv", ["retrieval.py", "--data", str(log), "--quick", "--towers",
                                     "history", "--ranks", "1"])
    bench.main()
    stdout = capsys.readouterr().out
    assert ["train", "--config"] in commands and ["preprocess", "interactions"] in commands
    assert re.search(r"^\| SASRec-style reference \| 2 blocks, .*, 2 of 2 epochs \| [\d.]+ \| "
                     r"[\d.]+ \|", stdout, re.M), stdout
    summary = stdout.strip().splitlines()[-1]
    keys = dict(field.split("=") for field in summary.split()[1:])
    assert {"history_tower_recall@10", "history_mean_recall@10", "history_attention_recall@10",
            "sasrec_recall@10", "popularity_recall@10", "peer_recall@10"} <= set(keys)
    assert 0.0 <= float(keys["sasrec_recall@10"]) <= 1.0
