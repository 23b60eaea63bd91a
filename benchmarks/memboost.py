"""Memboost in a closed loop (issue 62): a planted world whose relevance and position effect are
known, users clicking what they are shown, rounds of serve -> log -> update.

    .venv/bin/python benchmarks/memboost.py [--seeds 0,1,2] [--rounds 8] [--requests 50000]
        [--random-share 0.08] [--pair-std 0.8] [--gamma G] [--features] [--quick]

The world (drawn from its seed): Q queries (users) with Zipf(0.8) traffic, I items, latent
vectors u_q, v_i (d = 8, <u, v> of variance 1), an item effect b_i ~ N(0, 0.5^2) and, on each
query's M = 100 candidates (the top M of a retrieval-like score <u, v> + b_i + N(0, 1)), a
pair effect e_qi ~ N(0, 0.8^2) (--pair-std) that no feature shows (what only memorisation can
learn). Relevance r_qi = sigmoid(-5 + <u, v> + b_i + e_qi); the position effect theta_p = p^-eta,
eta ~ U(0.5, 1.0); a shown item is clicked with probability theta_p r_qi (the position-based
click model). K = 10 items shown per request.

Each round every policy serves the same requests (the same queries, the same random-order share,
the same uniform draws deciding clicks), logs its impressions (dlrm_hybrid.serve.impressions),
and learns from its own log:
  funnel        the ranker: logistic regression over [x_q (x) y_i, x_q, y_i, item one-hot,
                position one-hot] (x, y: u, v seen through noise of std 0.5), trained on all of
                the policy's logged impressions (aggregated per query, item, position; L-BFGS,
                L2), served at position 1: it learns from the clicks each round too
  memboost      the same ranker retrained on its own log, + gamma * MB (serve/memboost.py)
  uncorrected   the same with MB's expected clicks = impressions x the log's overall click rate
  features      (--features) the ranker alone, reading Memboost's statistics as three more
                features (log1p C, log1p E, MB; serve/memboost_features.py's): a round's rows
                read the statistics of the rounds before it (memboost_features' rule: the
                impressions before the row's time), served with those after the last round
The random-order share shows each policy's own top K shuffled. Round 0 serves the retrieval
order to all (one shared log). gamma of each Memboost policy is chosen on a validation world
(seed 1000) among GAMMAS by the one-standard-error rule (the smallest within one SE of the best
mean clicks per request over the last half of the rounds), unless --gamma is given.

Printed: per seed and round, clicks per request of each policy and the largest relative error
of the estimated position curve (memboost's statistics after that round, relative to position
1) at positions 1-10; the curve after the last round against the true one; last:

    memboost: rounds=R clicks_funnel=X clicks_memboost=X clicks_uncorrected=X position_curve_error=X

(the last round's clicks per request and the largest relative error of the curve at positions
1-10, each the mean over the seeds; per seed lines `memboost_seed:` before it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
from scipy import sparse
from scipy.optimize import minimize

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_hybrid.serve.impressions import Impressions  # noqa: E402
from dlrm_hybrid.serve.memboost import MemboostSettings, MemboostStats  # noqa: E402

K, M, D = 10, 100, 8
GAMMAS = (0.5, 1.0, 2.0, 4.0, 8.0)
POLICIES = ("funnel", "memboost", "uncorrected")
EXTRA = 3  # log1p C, log1p E, MB


@dataclass
class World:
    theta: np.ndarray  # [K] the true position effect
    relevance: np.ndarray  # [Q, M] of each query's candidates
    candidates: np.ndarray  # [Q, M] item ids, retrieval order
    traffic: np.ndarray  # [Q] request probability
    x: np.ndarray  # [Q, D] the ranker's view of the queries
    y: np.ndarray  # [I, D] and of the items
    items: int


def draw_world(seed: int, queries: int, items: int, pair_std: float = 0.8) -> World:
    rng = np.random.default_rng(seed)
    u = rng.normal(0, D ** -0.25, (queries, D))
    v = rng.normal(0, D ** -0.25, (items, D))
    b = rng.normal(0, 0.5, items)
    affinity = u @ v.T + b
    retrieval = affinity + rng.normal(0, 1.0, affinity.shape)
    candidates = np.argsort(-retrieval, 1)[:, :M]
    pair = rng.normal(0, pair_std, (queries, M))
    logit = -5.0 + np.take_along_axis(affinity, candidates, 1) + pair
    eta = rng.uniform(0.5, 1.0)
    traffic = (1.0 + np.arange(queries)) ** -0.8
    return World(np.arange(1, K + 1) ** -eta, 1 / (1 + np.exp(-logit)), candidates,
                 rng.permutation(traffic / traffic.sum()),
                 u + rng.normal(0, 0.5 * D ** -0.25, u.shape),
                 v + rng.normal(0, 0.5 * D ** -0.25, v.shape), items)


class Ranker:
    """Logistic regression on the logged clicks of one policy (see the module's docstring)."""

    def __init__(self, world: World, l2: float = 1e-4) -> None:
        self.world, self.l2 = world, l2
        q = np.repeat(np.arange(len(world.x)), M)
        i = world.candidates.reshape(-1)
        xq, yi = world.x[q], world.y[i]
        self.dense = np.hstack([(xq[:, :, None] * yi[:, None, :]).reshape(len(q), -1), xq, yi,
                                np.ones((len(q), 1))])  # per (query, candidate)
        self.weights: Optional[np.ndarray] = None

    def fit(self, shown: np.ndarray, clicks: np.ndarray,
            extra: Optional[List[np.ndarray]] = None) -> None:
        """`shown`, `clicks`: [Q * M, K] impressions and clicks per candidate and position, or
        [R, Q * M, K] per round with `extra` [R, Q * M, EXTRA], each round's features."""
        rnd, pair, pos = np.nonzero(shown if extra is not None else shown[None])
        n = (shown if extra is not None else shown[None])[rnd, pair, pos]
        c = (clicks if extra is not None else clicks[None])[rnd, pair, pos]
        items = self.world.candidates.reshape(-1)[pair]
        dense = self.dense[pair] if extra is None else np.hstack([self.dense[pair],
                                                                  extra[rnd, pair]])
        X = sparse.hstack([sparse.csr_matrix(dense),
                           sparse.csr_matrix((np.ones(len(pair)), (np.arange(len(pair)), items)),
                                             (len(pair), self.world.items)),
                           sparse.csr_matrix((np.ones(len(pair)), (np.arange(len(pair)), pos)),
                                             (len(pair), K))]).tocsr()
        total = n.sum()

        def loss(w: np.ndarray) -> Tuple[float, np.ndarray]:
            z = X @ w
            p = 1 / (1 + np.exp(-z))
            value = -(c * np.log(p + 1e-12) + (n - c) * np.log(1 - p + 1e-12)).sum() / total
            grad = X.T @ (n * p - c) / total
            return value + self.l2 / 2 * w @ w, grad + self.l2 * w

        start = self.weights if self.weights is not None else np.zeros(X.shape[1])
        self.weights = minimize(loss, start, jac=True, method="L-BFGS-B",
                                options={"maxiter": 200}).x

    def scores(self, extra: Optional[np.ndarray] = None) -> np.ndarray:
        """[Q, M] logits at position 1 (0 before any training: the retrieval order is kept)."""
        if self.weights is None:
            return np.zeros(self.world.candidates.shape)
        dense = self.dense if extra is None else np.hstack([self.dense, extra])
        d = dense.shape[1]
        w_dense, w_item = self.weights[:d], self.weights[d:d + self.world.items]
        z = dense @ w_dense + w_item[self.world.candidates.reshape(-1)] + self.weights[-K]
        return z.reshape(self.world.candidates.shape)


class Policy:
    """A ranker, its log's aggregates, and (unless gamma is 0) its Memboost statistics."""

    def __init__(self, world: World, gamma: float, corrected: bool, prior: float,
                 features: bool = False) -> None:
        self.world, self.gamma, self.corrected, self.features = world, gamma, corrected, features
        self.rounds: List[Tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (features) per round
        self.ranker = Ranker(world)
        self.stats = MemboostStats(MemboostSettings(prior, M))
        self.shown = np.zeros((world.candidates.size, K))
        self.clicks = np.zeros((world.candidates.size, K))
        self.keys = np.array([f"i{i}" for i in world.candidates.reshape(-1)]).reshape(
            world.candidates.shape)

    def order(self, first: bool) -> np.ndarray:
        """[Q, K] candidate positions shown to each query, best first."""
        if first:
            return np.tile(np.arange(K), (len(self.world.candidates), 1))
        score = self.ranker.scores(self.extra() if self.features else None)
        if self.gamma:
            score = score + self.gamma * self.boost()
        return np.argsort(-score, 1, kind="stable")[:, :K]

    def boost(self) -> np.ndarray:
        return np.stack([self.stats.scores("user", f"q{q}", self.keys[q], self.corrected)
                         for q in range(len(self.keys))])

    def extra(self) -> np.ndarray:
        """[Q * M, EXTRA] each candidate's log1p C, log1p E and MB in the statistics so far
        (zeros before any random-order traffic)."""
        out = np.zeros((self.world.candidates.size, EXTRA))
        if not self.stats.random_shown[0]:
            return out
        index = {k: n for n, k in enumerate(self.stats.keys.tolist())}
        keys = [f"user\x1fq{q}\x1f{item}" for q in range(len(self.keys))
                for item in self.keys[q].tolist()]
        rows = np.array([index.get(k, -1) for k in keys])
        held = rows >= 0
        out[held] = np.column_stack([np.log1p(self.stats.clicks), np.log1p(
            self.stats.expected()), self.stats.boost()])[rows[held]]
        return out

    def learn(self, log: Impressions, slot: np.ndarray) -> None:
        if self.features:  # this round's rows, with the statistics of the rounds before it
            shown, clicks = np.zeros_like(self.shown), np.zeros_like(self.clicks)
            np.add.at(shown, (slot, log.position - 1), 1)
            np.add.at(clicks, (slot, log.position - 1), log.clicked)
            self.rounds.append((shown, clicks, self.extra()))
            self.stats.update(log)
            self.ranker.fit(*(np.stack(a) for a in zip(*self.rounds)))
            return
        np.add.at(self.shown, (slot, log.position - 1), 1)
        np.add.at(self.clicks, (slot, log.position - 1), log.clicked)
        self.ranker.fit(self.shown, self.clicks)
        self.stats.update(log)


def serve(world: World, order: np.ndarray, queries: np.ndarray, shuffled: np.ndarray,
          rng_shuffle: np.random.Generator, uniform: np.ndarray, round_: int
          ) -> Tuple[Impressions, np.ndarray]:
    """One round's log (and each row's candidate slot q * M + m) of a policy whose top K per
    query is `order`."""
    n = len(queries)
    lists = order[queries].copy()
    perm = rng_shuffle.permuted(np.tile(np.arange(K), (int(shuffled.sum()), 1)), axis=1)
    lists[shuffled] = np.take_along_axis(lists[shuffled], perm, 1)
    rel = world.relevance[queries[:, None], lists]
    clicked = (uniform < world.theta[None] * rel).astype(np.float64)
    rows = n * K
    log = Impressions(
        np.repeat(np.char.add(f"r{round_}-", np.arange(n).astype(str)), K),
        np.full(rows, float(round_)), np.zeros(rows, np.int8),
        np.repeat(np.char.add("q", queries.astype(str)), K),
        np.char.add("i", world.candidates[queries[:, None], lists].reshape(-1).astype(str)),
        np.tile(np.arange(1, K + 1, dtype=np.int32), n), np.repeat(shuffled, K),
        clicked.reshape(-1))
    return log, (queries[:, None] * M + lists).reshape(-1)


def simulate(seed: int, args, gammas: Dict[str, float], features: bool = False
             ) -> Dict[str, object]:
    world = draw_world(seed, args.queries, args.items, args.pair_std)
    policies = {"funnel": Policy(world, 0.0, True, args.prior),
                "memboost": Policy(world, gammas["memboost"], True, args.prior),
                "uncorrected": Policy(world, gammas["uncorrected"], False, args.prior)}
    if features:
        policies["features"] = Policy(world, 0.0, True, args.prior, features=True)
    rng = np.random.default_rng(seed + 10_000)
    true = world.theta / world.theta[0]
    per_round: List[Dict[str, float]] = []
    for r in range(args.rounds):
        queries = rng.choice(len(world.traffic), args.requests, p=world.traffic)
        shuffled = rng.random(args.requests) < args.random_share
        uniform = rng.random((args.requests, K))
        shuffle_seed = int(rng.integers(1 << 31))
        clicks, shared = {}, None
        for name, policy in policies.items():
            if r == 0 and shared is not None:
                log, slot = shared
            else:
                log, slot = serve(world, policy.order(r == 0), queries, shuffled,
                                  np.random.default_rng(shuffle_seed), uniform, r)
                shared = (log, slot)
            clicks[name] = log.clicked.sum() / args.requests
            clicks[name + "_se"] = log.clicked.reshape(-1, K).sum(1).std() / np.sqrt(
                args.requests)
            policy.learn(log, slot)
        clicks["curve_error"] = float(np.max(np.abs(
            policies["memboost"].stats.relative_curve(K) / true - 1)))
        per_round.append(clicks)
    estimated = policies["memboost"].stats.relative_curve(K)
    return {"rounds": per_round, "estimated": estimated, "true": true,
            "curve_error": float(np.max(np.abs(estimated / true - 1)))}


def choose_gammas(args) -> Dict[str, float]:
    """Each Memboost policy's gamma on the validation world (one-standard-error rule)."""
    chosen = {}
    for name in ("memboost", "uncorrected"):
        found = {}
        for gamma in GAMMAS:
            g = {"memboost": 0.0, "uncorrected": 0.0, name: gamma}
            late = simulate(1000, args, g)["rounds"][args.rounds // 2:]
            found[gamma] = (np.mean([c[name] for c in late]),
                            np.sqrt(np.mean([c[name + "_se"] ** 2 for c in late]) / len(late)))
        best = max(found, key=lambda g: found[g][0])
        chosen[name] = min(g for g in found if found[best][0] - found[g][0] <= found[best][1])
        print(f"validation (seed 1000) {name}: " + " ".join(
            f"gamma={g:g}:{m:.4f}+-{s:.4f}" for g, (m, s) in found.items())
            + f" -> gamma={chosen[name]:g}", flush=True)
    return chosen


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=50_000, help="requests per round")
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--random-share", type=float, default=0.08)
    parser.add_argument("--pair-std", type=float, default=0.8, help="the pair effect's standard "
                        "deviation in the relevance logit (what only memorisation learns)")
    parser.add_argument("--prior", type=float, default=1.0, help="Memboost's alpha")
    parser.add_argument("--gamma", type=float, help="both policies' gamma (default: chosen on "
                        "the validation world)")
    parser.add_argument("--features", action="store_true", help="a fourth policy: the ranker "
                        "with Memboost's statistics as features")
    parser.add_argument("--quick", action="store_true", help="a small run that checks it works")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests, args.queries, args.items = 3, 4000, 100, 400
    started = time.time()
    print(f"memboost benchmark on {cpu_name()}: rounds={args.rounds} requests={args.requests} "
          f"queries={args.queries} items={args.items} random_share={args.random_share} "
          f"pair_std={args.pair_std} "
          f"prior={args.prior}", flush=True)
    gammas = ({"memboost": args.gamma, "uncorrected": args.gamma} if args.gamma is not None
              else choose_gammas(args))
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        t = time.time()
        result = simulate(seed, args, gammas, args.features)
        results.append(result)
        print(f"\nseed {seed} ({time.time() - t:.0f} s): clicks per request (standard error)")
        shown = [p for p in (*POLICIES, "features") if p in result["rounds"][0]]
        print("| round | " + " | ".join(shown) + " | memboost / funnel | curve error |")
        print("|---:|" + "---:|" * (len(shown) + 2))
        for r, c in enumerate(result["rounds"]):
            print(f"| {r} | " + " | ".join(f"{c[p]:.4f} ({c[p + '_se']:.4f})" for p in shown)
                  + f" | {c['memboost'] / c['funnel']:.3f} | {c['curve_error']:.3f} |")
        print("position curve (relative to position 1), true / estimated: " + " ".join(
            f"{t:.3f}/{e:.3f}" for t, e in zip(result["true"], result["estimated"])))
        last = result["rounds"][-1]
        print(f"memboost_seed: seed={seed} clicks_funnel={last['funnel']:.4f} "
              f"clicks_memboost={last['memboost']:.4f} "
              f"clicks_uncorrected={last['uncorrected']:.4f} "
              f"gain={last['memboost'] / last['funnel'] - 1:+.3f} "
              + (f"clicks_features={last['features']:.4f} " if "features" in last else "")
              + f"position_curve_error={result['curve_error']:.4f}", flush=True)
    mean = {p: np.mean([r["rounds"][-1][p] for r in results]) for p in POLICIES}
    print(f"\n{time.time() - started:.0f} s on {cpu_name()}; gammas {gammas}")
    print(f"memboost: rounds={args.rounds} clicks_funnel={mean['funnel']:.4f} "
          f"clicks_memboost={mean['memboost']:.4f} clicks_uncorrected={mean['uncorrected']:.4f} "
          f"position_curve_error={np.mean([r['curve_error'] for r in results]):.4f}")


if __name__ == "__main__":
    main()
