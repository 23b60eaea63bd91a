"""The two-tower loss (retrieval/loss.py) against a dense reference written here with loops,
option by option and all together, over a few steps (its state: the logQ estimate and the
cross-batch memory); on 2 real gloo ranks as on 1; the uniform negatives the dataset adds."""

import json
import math
import os
from dataclasses import replace
from itertools import islice

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dlrm_hybrid.config import ConfigError, RetrievalConfig
from dlrm_hybrid.data.interactions.interaction_data import InteractionData
from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta
from dlrm_hybrid.data.loader import rank_columns
from dlrm_hybrid.retrieval.loss import InBatchSoftmax

ITEMS, DIM, TEMPERATURE, DECAY = 7, 3, 0.5, 0.3
NONE = RetrievalConfig(logq=False, logq_decay=DECAY, remove_accidental_hits=False)
OPTIONS = {
    "in_batch": NONE,
    "logq": replace(NONE, logq=True),
    "accidental_hits": replace(NONE, remove_accidental_hits=True),
    "uniform_negatives": replace(NONE, uniform_negatives=2),
    "cross_batch_memory": replace(NONE, cross_batch_memory=5),
    "all": replace(NONE, logq=True, remove_accidental_hits=True, uniform_negatives=2,
                   cross_batch_memory=5),
}


def stream(cfg: RetrievalConfig, steps: int = 3, engagements: int = 6, seed: int = 0):
    """Global batches (item ids, labels): engagements of few items (so accidental hits and
    repeated items abound), then `cfg.uniform_negatives` rows of label 0."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = np.concatenate([rng.choice(ITEMS, engagements, p=[.4, .2, .1, .1, .1, .1, 0]),
                              rng.integers(0, ITEMS, cfg.uniform_negatives)])
        labels = np.r_[np.ones(engagements), np.zeros(cfg.uniform_negatives)]
        yield torch.tensor(ids), torch.tensor(labels, dtype=torch.float32)


class Reference:
    """The loss as the papers write it, one engagement and one candidate at a time."""

    def __init__(self, cfg: RetrievalConfig) -> None:
        self.cfg, self.t = cfg, 0
        self.last_seen, self.gap = {}, {}  # Yi et al.'s A and B, per item
        self.memory = []  # (item vector, item id), oldest first

    def observe(self, engaged_ids) -> None:
        """Yi et al.'s update, one engagement after another."""
        self.t += 1
        a = self.cfg.logq_decay
        for j in engaged_ids:
            waited = self.t - self.last_seen.get(j, 0)
            self.gap[j] = (1 - a) * self.gap.get(j, waited) + a * waited
            self.last_seen[j] = self.t

    def q(self, j: int) -> float:
        """Expected draws of item j per step: engagements (1 / B) plus uniform draws."""
        return (1 / self.gap[j] if j in self.gap else 0.0) + self.cfg.uniform_negatives / ITEMS

    def loss(self, user, item, ids, labels):
        ids, labels = ids.tolist(), labels.tolist()
        if self.cfg.logq:
            self.observe([j for j, label in zip(ids, labels) if label == 1])
        candidates = [(item[c], ids[c], c) for c in range(len(ids))]
        candidates += [(vector, j, None) for vector, j in self.memory]
        losses = []
        for i in range(len(ids)):
            if labels[i] != 1:
                continue  # a uniform negative: a candidate, never a query
            logits, own = [], None
            for vector, j, row in candidates:
                if self.cfg.remove_accidental_hits and j == ids[i] and row != i:
                    continue
                logit = (user[i] * vector).sum() / TEMPERATURE
                if self.cfg.logq:
                    logit = logit - math.log(self.q(j))
                if row == i:
                    own = logit
                logits.append(logit)
            losses.append(torch.logsumexp(torch.stack(logits), 0) - own)
        if self.cfg.cross_batch_memory:
            self.memory += [(item[c].detach(), ids[c]) for c in range(len(ids))]
            self.memory = self.memory[-self.cfg.cross_batch_memory:]
        return torch.stack(losses).mean()


def losses_and_grads(loss_fn, cfg, seed=1):
    """Each step's loss and its gradients w.r.t. the user and item vectors."""
    torch.manual_seed(seed)
    out = []
    for ids, labels in stream(cfg):
        user = torch.randn(len(ids), DIM, requires_grad=True)
        item = torch.randn(len(ids), DIM, requires_grad=True)
        loss = loss_fn(user, item, ids, labels)
        loss.backward()
        out.append((loss.detach(), user.grad, item.grad))
    return out


@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_gives_the_dense_references_loss_and_gradients(option):
    cfg = OPTIONS[option]
    module = InBatchSoftmax(cfg, ITEMS, TEMPERATURE, DIM)
    got = losses_and_grads(module, cfg)
    want = losses_and_grads(Reference(cfg).loss, cfg)
    for step, (g, w) in enumerate(zip(got, want)):
        for name, a, b in zip(("loss", "user grad", "item grad"), g, w):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")


def test_the_options_change_the_loss():
    """The reference comparisons above mean something: each option alone moves the loss."""
    plain = losses_and_grads(InBatchSoftmax(NONE, ITEMS, TEMPERATURE, DIM), NONE)
    for option in ("logq", "accidental_hits", "cross_batch_memory"):
        cfg = OPTIONS[option]
        got = losses_and_grads(InBatchSoftmax(cfg, ITEMS, TEMPERATURE, DIM), cfg)
        assert not torch.allclose(got[-1][0], plain[-1][0]), option


def test_the_logq_estimate_converges_to_each_items_draws_per_step():
    """A stream of 32 engagements per step from known item frequencies: 1 / B approaches the
    expected draws per step, for items drawn several times a step and for rare ones."""
    items, batch, steps = 12, 32, 4000
    freq = 1 / np.arange(1, items + 1) ** 1.2
    freq /= freq.sum()
    cfg = RetrievalConfig(logq=True, logq_decay=0.005, remove_accidental_hits=False)
    module = InBatchSoftmax(cfg, items, TEMPERATURE, DIM)
    draws = np.random.default_rng(0).choice(items, (steps, batch), p=freq)
    vectors, labels = torch.zeros(batch, DIM), torch.ones(batch)
    estimates = []
    for t in range(steps):
        module(vectors, vectors, torch.from_numpy(draws[t]), labels)
        if t >= steps // 2:
            estimates.append(1 / module.gap.numpy())
    np.testing.assert_allclose(np.mean(estimates, 0), freq * batch, rtol=0.1)
    assert freq[0] * batch > 5 and freq[-1] * batch < 1  # both kinds of item are in the test


def _two_ranks(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    steps, module = two_rank_steps(OPTIONS["all"], rank)
    record = [(loss.item(), user.tolist(), item.tolist()) for loss, user, item in steps]
    state = {k: v.tolist() for k, v in module.state_dict().items()}
    with open(f"{out_dir}/rank_{rank}.json", "w") as f:
        json.dump({"steps": record, "state": state}, f)
    dist.destroy_process_group()
    os._exit(0)  # as the CLI leaves: gloo's threads torn down at exit may abort a finished rank


def two_rank_steps(cfg, rank, world_size=2):
    """Rank `rank`'s share of each global batch of `stream` (its engagements, then its uniform
    negatives), through one module: its loss and gradients per step, and the module."""
    module = InBatchSoftmax(cfg, ITEMS, TEMPERATURE, DIM)
    torch.manual_seed(1)
    out = []
    for ids, labels in stream(cfg, steps=4, engagements=8):
        user, item = torch.randn(len(ids), DIM), torch.randn(len(ids), DIM)
        engaged, negative = np.flatnonzero(labels == 1), np.flatnonzero(labels == 0)
        mine = np.r_[np.array_split(engaged, world_size)[rank],
                     np.array_split(negative, world_size)[rank]]
        user_mine = user[mine].requires_grad_()
        item_mine = item[mine].requires_grad_()
        loss = module(user_mine, item_mine, ids[mine], labels[mine])
        loss.backward()
        out.append((loss.detach(), user_mine.grad, item_mine.grad))
    return out, module


def test_two_gloo_ranks_give_one_ranks_loss_gradients_and_state(tmp_path):
    """All options on (the memory drops rows mid-step): the ranks' mean loss is one rank's on
    the global batch, and their gradients, which DDP averages, are twice one rank's."""
    # Forked, not spawned: ~0.2 s instead of ~5 s of importing torch twice. Safe here: each
    # rank runs torch on one thread (no OpenMP pool inherited) and gloo starts its own threads.
    mp.start_processes(_two_ranks, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                       start_method="fork")
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    one, module = two_rank_steps(OPTIONS["all"], rank=0, world_size=1)
    one_state = module.state_dict()
    for step, (loss, user, item) in enumerate(one):
        two = [torch.tensor(ranks[r]["steps"][step][0]) for r in range(2)]
        torch.testing.assert_close((two[0] + two[1]) / 2, loss, msg=f"step {step}: loss")
        for which, grad in ((1, user), (2, item)):
            halves = [torch.tensor(ranks[r]["steps"][step][which]) for r in range(2)]
            # this rank's rows: its engagements, then its negatives; one rank: all of them
            rows = len(halves[0]) - 1  # one negative per rank
            merged = torch.cat([halves[0][:rows], halves[1][:rows], halves[0][rows:],
                                halves[1][rows:]])
            torch.testing.assert_close(merged / 2, grad, msg=f"step {step}: grad {which}")
    for name, value in one_state.items():
        for r in range(2):
            torch.testing.assert_close(torch.tensor(ranks[r]["state"][name], dtype=value.dtype),
                                       value, msg=f"rank {r}: loss.{name}")


def tiny_interactions() -> InteractionData:
    """6 users (one side feature), 10 items (one side feature); 16 training engagements."""
    meta = InteractionMeta(users=6, items=10, user_side={"age": 4}, item_side={"genre": 3})
    rng = np.random.default_rng(0)
    pairs = {"train": (rng.integers(0, 6, 16), rng.integers(0, 10, 16)),
             "val": (np.arange(4), np.arange(4))}
    return InteractionData(meta, pairs, rng.integers(0, 4, (6, 1)), np.arange(10)[:, None] % 3)


def test_training_slices_carry_their_share_of_the_same_uniform_negatives():
    data = tiny_interactions()
    data.set_uniform_negatives(4, global_batch=8, seed=5)
    one = list(islice(rank_columns(data, "train", 8, 0, 1), 2))  # an epoch: 2 global batches
    two = [list(islice(rank_columns(data, "train", 8, r, 2), 2)) for r in range(2)]
    assert all(len(c.labels) == 12 for c in one)  # 8 engagements + 4
    assert all(len(c.labels) == 6 for r in range(2) for c in two[r])  # 4 engagements + 2
    item = data.spec.feature_names.index("item_id")
    for step, whole in enumerate(one):
        halves = [two[r][step] for r in range(2)]
        negatives = np.concatenate([h.ids[item][4:, 0] for h in halves])
        np.testing.assert_array_equal(negatives, whole.ids[item][8:, 0])
        for c, engaged in [(whole, 8)] + [(h, 4) for h in halves]:
            assert (c.labels[:engaged] == 1).all() and (c.labels[engaged:] == 0).all()
            assert c.valid.all()
            for f, name in enumerate(data.spec.feature_names):
                used = c.lengths[f][engaged:]
                assert (used == (0 if name.startswith("user_") else 1)).all(), name
            genre = data.spec.feature_names.index("item_genre")
            np.testing.assert_array_equal(c.ids[genre][:, 0], c.ids[item][:, 0] % 3)
    assert not np.array_equal(one[0].ids[item][8:], one[1].ids[item][8:])  # a draw per batch
    assert len(next(iter(rank_columns(data, "val", 8, 0, 1))).labels) == 8  # eval: none


def test_uniform_negatives_that_do_not_split_over_the_ranks_are_refused():
    data = tiny_interactions()
    data.set_uniform_negatives(3, global_batch=8, seed=5)
    assert len(next(iter(rank_columns(data, "train", 8, 0, 1))).labels) == 11
    with pytest.raises(ConfigError, match=r"retrieval.uniform_negatives: 3 .* multiple of the "
                                          r"number of ranks"):
        next(iter(rank_columns(data, "train", 8, 1, 2)))
