"""HSTU (model/hstu.py) against the paper's equations computed by hand, its causality and padding
invariance; the windows it trains on; the every-position sampled softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

from dlrm_hybrid.data.interactions.histories import timeline_positions, window_rows
from dlrm_hybrid.model.hstu import HSTU, HSTULayer, last_positions
from dlrm_hybrid.retrieval.sequence_loss import SequenceSoftmax


def _layer_by_hand(layer: HSTULayer, x: np.ndarray, times: np.ndarray) -> np.ndarray:
    """One layer for one sequence, element by element, from the paper's equations."""
    n, d = x.shape
    dv, dqk, big_n = layer.linear_dim, layer.attention_dim, layer.length
    w = layer.uvqk.detach().double().numpy()
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    norm = lambda z: (z - z.mean()) / np.sqrt(z.var() + 1e-6)  # noqa: E731
    pos = layer.rab.position.detach().double().numpy()
    tw = layer.rab.time.detach().double().numpy()
    out_w = layer.out.weight.detach().double().numpy()
    out_b = layer.out.bias.detach().double().numpy()
    proj = np.stack([silu(norm(x[i]) @ w) for i in range(n)])
    u, v, q, k = (proj[:, :dv], proj[:, dv:2 * dv], proj[:, 2 * dv:2 * dv + dqk],
                  proj[:, 2 * dv + dqk:])
    y = np.zeros_like(x)
    for i in range(n):
        a = np.zeros(dv)
        for j in range(i + 1):  # causal: keys up to the query
            bucket = min(int(math.log(max(abs(times[i] - times[j]), 1.0)) / 0.301), 128)
            a += silu(q[i] @ k[j] + pos[i - j] + tw[bucket]) / big_n * v[j]
        y[i] = x[i] + out_w @ (u[i] * norm(a)) + out_b
    return y


def test_a_layer_is_the_papers_equations():
    torch.manual_seed(3)
    layer = HSTULayer(dim=4, length=6, heads=1, attention_dim=3, linear_dim=2, dropout=0.0,
                      time_buckets=128).double()
    with torch.no_grad():  # biases large enough to matter
        layer.rab.position.normal_(0, 1)
        layer.rab.time.normal_(0, 1)
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    times = torch.tensor([[0.0, 1.0, 30.0, 4000.0, 4000.5]], dtype=torch.float64)
    causal = torch.tril(torch.ones(5, 5, dtype=torch.float64))[None]
    got = layer(x, causal, times)[0].detach().numpy()
    np.testing.assert_allclose(got, _layer_by_hand(layer, x[0].numpy(), times[0].numpy()),
                               rtol=1e-9, atol=1e-9)


def _model(seed: int = 0) -> HSTU:
    torch.manual_seed(seed)
    model = HSTU(dim=8, length=10, layers=2, heads=2, attention_dim=4, linear_dim=4,
                 dropout=0.0, time_buckets=128).double().eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.rab.position.normal_(0, 1)
            layer.rab.time.normal_(0, 1)
    return model


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 10), st.data())
def test_no_position_reads_its_future(n, data):
    t = data.draw(st.integers(0, n - 2))
    model = _model()
    items = torch.randn(1, n, 8, dtype=torch.float64)
    times = torch.cumsum(torch.rand(1, n, dtype=torch.float64) * 1e5, 1)
    counts = torch.tensor([n])
    before = model(items, counts, times)
    changed, later = items.clone(), times.clone()
    changed[0, t + 1:] = torch.randn(n - t - 1, 8, dtype=torch.float64)
    later[0, t + 1:] += 1e6
    after = model(changed, counts, later)
    torch.testing.assert_close(after[0, :t + 1], before[0, :t + 1], rtol=0, atol=1e-12)
    assert not torch.allclose(after[0, t + 1:], before[0, t + 1:])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 10), min_size=1, max_size=5))
def test_a_padded_batch_gives_each_sequence_what_it_gives_alone(lengths):
    """Jagged (each sequence alone, no padding) against padded to the batch's and to the
    configured length: the same outputs, zeros past each end."""
    model = _model(1)
    rng = torch.Generator().manual_seed(len(lengths))
    width = 10
    items = torch.randn(len(lengths), width, 8, dtype=torch.float64, generator=rng)
    times = torch.cumsum(torch.rand(len(lengths), width, dtype=torch.float64, generator=rng), 1)
    counts = torch.tensor(lengths)
    padded = model(items, counts, times * 1e4)
    for b, n in enumerate(lengths):
        alone = model(items[b:b + 1, :n], counts[b:b + 1], times[b:b + 1, :n] * 1e4)
        torch.testing.assert_close(padded[b, :n], alone[0], rtol=0, atol=1e-12)
        assert not padded[b, n:].any()
    if max(lengths):
        tight = model(items[:, :max(lengths)], counts, times[:, :max(lengths)] * 1e4)
        torch.testing.assert_close(tight, padded[:, :max(lengths)], rtol=0, atol=1e-12)


def test_outputs_are_unit_vectors_and_the_user_vector_is_the_last_positions():
    model = _model()
    items = torch.randn(3, 6, 8, dtype=torch.float64)
    counts = torch.tensor([6, 2, 0])
    out = model(items, counts)
    norms = out.norm(dim=-1)
    torch.testing.assert_close(norms[0], torch.ones(6, dtype=torch.float64))
    user = last_positions(out, counts)
    torch.testing.assert_close(user[1], out[1, 1])
    assert not user[2].any()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=8), st.integers(1, 7), st.randoms())
def test_the_windows_predict_every_item_but_each_users_first_once(sizes, length, rnd):
    """Each window row predicts the items at positions (row - length, row]: together every
    position from 1 on, each once."""
    users = np.repeat(np.arange(len(sizes)), sizes)
    chronology = np.arange(len(users))
    rnd.shuffle(chronology)  # the rows in any file order, the timeline by chronology
    position = timeline_positions(users, chronology)
    rows = window_rows(users, position, length)
    for u, size in enumerate(sizes):
        mine = rows[users[rows] == u]
        predicted = sorted(p for r in mine for p in range(max(position[r] - length, 0) + 1,
                                                            position[r] + 1))
        assert predicted == list(range(1, size)), (u, size, sorted(position[mine]))


def _unit(*shape: int) -> torch.Tensor:
    return F.normalize(torch.randn(*shape, dtype=torch.float64), dim=-1)


def test_the_softmax_is_each_positions_positive_against_the_distinct_other_items():
    torch.manual_seed(0)
    outputs, positives, negatives = _unit(4, 6), _unit(4, 6), _unit(3, 6)
    positive_ids = torch.tensor([5, 7, 5, 9])
    negative_ids = torch.tensor([7, 11, 5])
    loss = SequenceSoftmax(temperature=0.1, in_batch=True)
    got = loss(outputs, positives, positive_ids, negatives, negative_ids)
    vectors = {}
    for v, i in [*zip(negatives, negative_ids.tolist()), *zip(positives, positive_ids.tolist())]:
        vectors.setdefault(i, v)  # the first row of each item
    want = 0.0
    for p in range(4):
        others = [v for i, v in sorted(vectors.items()) if i != positive_ids[p]]
        logits = torch.stack([outputs[p] @ positives[p], *[outputs[p] @ v for v in others]]) / 0.1
        want += -torch.log_softmax(logits, 0)[0]
    torch.testing.assert_close(got, want / 4)


def test_without_in_batch_negatives_only_the_uniform_draws_are_candidates():
    torch.manual_seed(1)
    outputs, positives, negatives = _unit(2, 4), _unit(2, 4), _unit(2, 4)
    ids, negative_ids = torch.tensor([1, 2]), torch.tensor([2, 3])
    got = SequenceSoftmax(0.5, in_batch=False)(outputs, positives, ids, negatives, negative_ids)
    first = torch.log_softmax(torch.stack([outputs[0] @ positives[0], outputs[0] @ negatives[0],
                                           outputs[0] @ negatives[1]]) / 0.5, 0)[0]
    second = torch.log_softmax(torch.stack([outputs[1] @ positives[1],
                                            outputs[1] @ negatives[1]]) / 0.5, 0)[0]
    torch.testing.assert_close(got, -(first + second) / 2)


@pytest.mark.parametrize("in_batch", [True, False])
def test_a_uniform_draw_of_the_positive_changes_nothing(in_batch):
    torch.manual_seed(2)
    outputs, positives, negatives = _unit(3, 4), _unit(3, 4), _unit(2, 4)
    ids = torch.tensor([1, 2, 3])
    loss = SequenceSoftmax(0.2, in_batch)
    plain = loss(outputs, positives, ids, negatives, torch.tensor([8, 9]))
    with_hit = loss(outputs, positives, ids, torch.cat([negatives, positives[1:2]]),
                    torch.tensor([8, 9, 2]))
    if in_batch:  # item 2 was already a candidate for the others
        torch.testing.assert_close(with_hit, plain)
    else:  # item 2 is now a negative of positions 0 and 2 only, masked for position 1
        assert with_hit > plain
