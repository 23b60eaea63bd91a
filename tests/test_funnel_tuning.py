"""The funnel's choices on validation (serve/funnel_tuning.py): the one-standard-error rule for
merge weights and priors, the ranker picked on half the users and its prior judged on the
other, and each stage's prior judged on what it delivers in the funnel it serves (planted
cases where that and another quantity disagree)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dlrm_hybrid.serve import funnel_tuning as tuning
from dlrm_hybrid.serve.recommender import RecommendSettings

INF = float("inf")


def test_the_ranker_is_picked_on_half_the_users_and_its_prior_judged_on_the_other():
    """Per group the steps and value model of the best HR@10 at any prior on the even users,
    the group best there first; the prior by the one-standard-error rule (the largest within
    it) on the odd users, so a setting that led only where it was picked keeps the merged
    order."""
    def hits(picking, judging):  # 1,000 users: the first rate of each half hit
        found = np.zeros(1000)
        found[0::2][:round(picking * 500)] = 1
        found[1::2][:round(judging * 500)] = 1
        return found

    on_val = {("listwise", 150, 0, 0.0): hits(0.20, 0.30),  # best where not picked
              ("listwise", 150, 0, INF): hits(0.18, 0.18),
              ("listwise", 300, 0, 0.0): hits(0.30, 0.18),  # picked; no gain where judged
              ("listwise", 300, 0, INF): hits(0.18, 0.18),
              ("listwise", 300, 1, 0.0): hits(0.30, 0.25),  # as good, later in the values
              ("listwise", 300, 1, INF): hits(0.18, 0.18),
              ("pointwise", 150, 0, 0.0): hits(0.25, 0.25),  # 35 users over keeping: real
              ("pointwise", 150, 0, INF): hits(0.18, 0.18),
              ("pointwise", 600, 0, 0.0): hits(0.25, 0.10)}  # as good, more steps
    chosen = tuning.choose(on_val)
    assert chosen == {"listwise": (300, 0, INF), "pointwise": (150, 0, 0.0)}
    assert list(chosen) == ["listwise", "pointwise"]


def test_a_user_with_several_held_out_items_picks_or_judges_never_both():
    """A time split gives a user several validation pairs, all asked with one history: users
    0 and 2 (100 pairs each) gain from the ranker's own order, 1 and 3 lose. Halves by
    position put every user on both sides, so the gain seen where it was picked looked
    real where it was judged; by user, users 1 and 3 judge it and the merged order stays."""
    users = np.repeat([0, 1, 2, 3], 100)
    pick, judge = tuning.halves(users)
    assert set(users[pick]) == {0, 2} and set(users[judge]) == {1, 3}
    own = np.isin(users, [0, 2]).astype(float)
    found = {("r", 0, 0, 0.0): own, ("r", 0, 0, INF): np.full(len(users), 0.3)}
    assert tuning.choose(found, users)["r"][2] == INF
    assert tuning.choose(found)["r"][2] == 0.0  # each request a user of its own


def test_a_sequence_models_user_without_history_is_not_asked(tmp_path):
    """`recommend --user` refuses a user the sequence model (hstu) has no history for (one who
    came after a time split's cut): validation asks the others, as recommend can, and does not
    stop at that user; with a two-tower retrieval every user is asked."""
    from dlrm_hybrid.data.interactions.interaction_data import (InteractionData,
                                                                write_interactions)
    from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta

    pairs = {"train": (np.array([0, 0, 1]), np.array([1, 2, 3])),
             "val": (np.array([0, 1, 2]), np.array([4, 4, 4])),
             "test": (np.array([0, 1, 2]), np.array([5, 5, 5]))}
    write_interactions(InteractionData(InteractionMeta(3, 6), pairs, np.zeros((3, 0), np.int64),
                                       np.zeros((6, 0), np.int64)), str(tmp_path / "data"))
    timelines = {0: np.array([1, 2]), 1: np.array([3]), 2: np.zeros(0, np.int64)}

    def funnel(encoder):
        retriever = SimpleNamespace(
            description={"user_history": {"encoder": encoder, "length": 5}},
            user_side=np.zeros((3, 0)), item_vectors=np.zeros((6, 2)), history_length=5,
            timeline=timelines.get, seen=timelines.get)
        return SimpleNamespace(retriever=retriever, stored_latest_first=lambda u: timelines[u],
                               walker=SimpleNamespace(graph=SimpleNamespace(description={})))

    assert tuning.validation_requests(funnel("hstu"), str(tmp_path / "data")).users.tolist() \
        == [0, 1]
    assert tuning.validation_requests(funnel("mean"), str(tmp_path / "data")).users.tolist() \
        == [0, 1, 2]


def test_a_stage_defers_to_its_incoming_order_unless_validation_shows_more_than_noise():
    """`defer`: the largest prior within one standard error of the best (inf: the stage keeps
    the order it was handed); a gain of a few users of 900 is noise, one of 40 is not."""
    rng = np.random.default_rng(0)
    keep = (rng.random(900) < 0.24).astype(float)
    own = keep.copy()
    own[np.flatnonzero(keep == 0)[:5]] = 1  # five hits gained, three lost: noise
    own[np.flatnonzero(keep == 1)[:3]] = 0
    assert tuning.defer({0.0: own, 2.0: own, INF: keep}) == INF
    better = keep.copy()
    better[np.flatnonzero(keep == 0)[:40]] = 1  # 40 more of 900: more than noise
    found = {0.0: better * 0, 1.0: better, 4.0: own, INF: keep}
    assert tuning.defer(found) == 1.0
    found[2.0] = better.copy()
    found[2.0][np.flatnonzero(better == 1)[:1]] = 0  # 1 user fewer than prior 1: within noise
    assert tuning.defer(found) == 2.0


def test_merge_weights_are_chosen_by_the_one_standard_error_rule():
    """The fewest weighted sources within one standard error (of the paired per-user
    difference) of the best weighting; a weighting clearly better than a single source wins."""
    rng = np.random.default_rng(0)
    alone = (rng.random(900) < 0.24).astype(float)
    noisy = alone.copy()
    noisy[np.flatnonzero(alone == 0)[:5]] = 1  # five hits gained, three lost: noise
    noisy[np.flatnonzero(alone == 1)[:3]] = 0
    found = {(1.0, 0.0, 0.0): alone, (1.0, 0.25, 0.0): noisy, (1.0, 1.0, 1.0): alone * 0.5}
    assert tuning.choose_fusion(found) == (1.0, 0.0, 0.0)
    better = alone.copy()
    better[np.flatnonzero(alone == 0)[:40]] = 1  # 40 more of 900: more than noise
    found[(1.0, 0.25, 0.0)] = better
    assert tuning.choose_fusion(found) == (1.0, 0.25, 0.0)
    found[(0.5, 0.25, 0.0)] = better  # as good, as many sources: the grid's order
    assert tuning.choose_fusion(found) == (1.0, 0.25, 0.0)


USERS, CANDIDATES = 120, 300


def placed(rng, wanted: int, at: int) -> np.ndarray:
    """CANDIDATES items (ids 1..999 but `wanted`), `wanted` at position `at`."""
    others = rng.permutation(np.setdiff1d(np.arange(1, 1000), [wanted]))[:CANDIDATES - 1]
    return np.insert(others, at, wanted)


def stub_funnel(monkeypatch, merged_at, first_at, ranker_at, keep: int, first_stage: bool):
    """A funnel of one source whose list puts each user's held-out item at `merged_at(u)`, a
    first stage that puts it at `first_at(u)` of the merged items (None: no first stage) and a
    ranker that puts it at `ranker_at(u, n)` of the n items it is handed (the rest in their
    order): what `evaluate` reads of a Recommender."""
    rng = np.random.default_rng(0)
    wanted = np.arange(USERS) + 1000
    merged = {u: placed(rng, int(wanted[u]), merged_at(u)) for u in range(USERS)}

    def first_order(u, items):
        rest = [i for i in rng.permutation(items).tolist() if i != wanted[u]]
        return np.insert(np.array(rest, np.int64), first_at(u), wanted[u])

    def rank(u, items, lists, history, at=None):
        rest = [i for i in items.tolist() if i != wanted[u]]
        order = np.insert(np.array(rest, np.int64), min(ranker_at(u, len(items)), len(rest)),
                          wanted[u]) if wanted[u] in items else items
        return order, np.zeros((len(items), 1)), np.zeros(len(items))

    orders = {u: first_order(u, merged[u]) for u in range(USERS)}  # fixed per user
    settings = RecommendSettings(k=10, sources=("two_tower",), per_source=CANDIDATES,
                                 rank_top=CANDIDATES, first_stage_keep=keep, diversity="off")
    rec = SimpleNamespace(
        settings=settings, tasks=["liked"], _rank=rank,
        sources=SimpleNamespace(source=lambda s, u, h, e, t: (merged[u], np.zeros(CANDIDATES))),
        first_stage=SimpleNamespace(order=lambda u, items: orders[u]) if first_stage else None)
    monkeypatch.setattr(tuning, "with_ranker", lambda rec, path, data=None: (rec, {}))
    monkeypatch.setattr(tuning, "value_model_weights", lambda value, tasks, description: None)
    asked = tuning.Requests(np.arange(USERS), wanted, [np.zeros(0, np.int64)] * USERS,
                            [np.zeros(0, np.int64)] * USERS, [None] * USERS)
    return rec, asked, merged, orders


def test_the_first_stage_prior_is_judged_by_what_it_hands_on(monkeypatch):
    """The merged list has each held-out item at 20, inside the 50 the first stage keeps; the
    first stage's own order has it first for 2 users in 5 and at 200 for the rest. Its own
    order's top 10 is best at prior 0 (0.4, the merged order's 0); what it hands the ranker
    holds every item only near the merged order: the prior judged is the merged order's."""
    rec, asked, merged, orders = stub_funnel(
        monkeypatch, lambda u: 20, lambda u: 0 if (u // 2) % 5 < 2 else 200,
        lambda u, n: 0, keep=50, first_stage=True)
    found = tuning.evaluate(rec, asked, {("r", 0): "ranker.pt"}, [None], fusion={})
    assert found.first_found[INF].mean() == 1.0 and found.first_found[0.0].mean() == 0.4
    assert found.first_stage_prior == INF
    own_top_10 = tuning.fused_found([orders[u] for u in range(USERS)],
                                    [merged[u] for u in range(USERS)], asked.wanted, 10)
    assert tuning.judged(own_top_10) < INF  # the other quantity would have chosen otherwise


def test_the_heavy_rankers_prior_is_judged_on_the_list_the_first_stage_handed_it(monkeypatch):
    """The merged list has each held-out item at 250, the first stage first, and the ranker
    puts it first for half the users and last for the others. Behind the first stage, whose
    kept 20 hold it near their top, keeping the first stage's order (prior inf) finds nearly
    every item; against the merged order (the two-stage funnel's choice) the ranker's own
    order is best, which in the three-stage funnel finds half."""
    def ranker_at(u, n):
        return 0 if (u // 2) % 2 else n

    three, asked, _, _ = stub_funnel(monkeypatch, lambda u: 250, lambda u: 0, ranker_at,
                                     keep=20, first_stage=True)
    found = tuning.evaluate(three, asked, {("r", 0): "ranker.pt"}, [None], fusion={})
    assert found.first_stage_prior < INF and found.first_found[found.first_stage_prior].all()
    three_prior = tuning.choose(found.found)["r"][2]
    two, asked, _, _ = stub_funnel(monkeypatch, lambda u: 250, lambda u: 0, ranker_at,
                                   keep=20, first_stage=False)
    two_prior = tuning.choose(tuning.evaluate(two, asked, {("r", 0): "ranker.pt"}, [None],
                                              fusion={}).found)["r"][2]
    assert three_prior == INF and two_prior < INF
    assert found.found["r", 0, 0, INF].mean() > 0.9
    assert found.found["r", 0, 0, two_prior].mean() == pytest.approx(0.5)


def test_merge_weights_are_chosen_on_the_grid_unless_given(monkeypatch):
    """Without weights, every weighting of FUSION_GRID whose largest is 1 is tried (one source:
    just 1) and the chosen one reported; given weights are kept as given."""
    rec, asked, _, _ = stub_funnel(monkeypatch, lambda u: 3, lambda u: 0, lambda u, n: 0,
                                   keep=20, first_stage=False)
    found = tuning.evaluate(rec, asked, {("r", 0): "ranker.pt"}, [None])
    assert list(found.fusion_found) == [(1.0,)] and found.fusion == {"two_tower": 1.0}
    assert found.merged.mean() == 1.0
    given = tuning.evaluate(rec, asked, {("r", 0): "ranker.pt"}, [None],
                            fusion={"two_tower": 0.5})
    assert given.fusion == {"two_tower": 0.5} and not given.fusion_found
