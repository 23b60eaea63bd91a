"""Pixie random walks (graph/pixie.py) on one interaction log: the graph's build and size, walk
speed and latency, and how much of exact personalized PageRank's top 100 the walks recover.

    .venv/bin/python benchmarks/pixie.py [--data FILE | --dataset DIR] [--name NAME]
        [--positive 'rating>=4'] [--queries 300] [--device cpu] [--quick]

--data: any interaction log `preprocess interactions` reads (MovieLens' u.data, ...), made a
dataset in a temporary folder (positive = rating >= 4, leave-last-out); --dataset: a folder it
already wrote. Neither: the planted log of configs/two_tower_demo.yaml (`synth`), whose items
have categories, so the entropy pruning runs too. The graph is the training split's
engagements (`pixie build`'s default).

1. Build: `pixie build` with each pruning rule of PRUNING (none, degree caps, minimum degrees,
   entropy where the items have categories): the build's own seconds (graph.yaml) and the
   command's, nodes and edges left, bytes per edge (both CSR directions); and for each pruned
   graph Pixie's p50 latency and its top-100 overlap with exact PPR on the unpruned graph.
2. Speed (early stopping off, WALKERS walkers): steps/s of one query of 1,000,000 steps and of
   a batch of BATCH_QUERIES queries of 100,000 steps each in one call, with 1 thread
   (OMP_NUM_THREADS=1's torch.set_num_threads(1)) and with every core; steps/s per core.
3. Latency per query at 100,000 steps, p50/p99 over --queries query items (drawn without
   replacement, weighted by degree), each setting of SETTINGS: early stopping off, the
   default 1000,20 and a looser 100,20 that triggers on a small graph (steps saved), and
   1,000,000 steps without it; 1 thread and every core.
4. Exact personalized PageRank of each query on the same graph: scipy power iteration of
   Pixie's own process, y = alpha e_q + (1 - alpha) v, v = y P (P: item -> user -> item), to
   POWER_TOL; and networkx.pagerank on the bipartite graph, tol NX_TOL, with damping
   d = sqrt(1 - alpha): networkx may teleport after every hop, Pixie restarts with
   probability alpha once per two hops; with d^2 = 1 - alpha networkx's item scores solve
   pi_I = (1 - d) e_q + d^2 pi_I P, Pixie's y up to a constant, so both give one ranking
   (networkx, a well-kept library, checks the scipy one; fewer queries where it is slow).
   Time per query of each, and the overlap |Pixie top 100 & PPR top 100| / 100 (query item
   left out of both), mean over the queries, for each Pixie setting.

Prints the CPU, markdown tables and last the summary line:

    pixie: steps_per_s=N p50_ms=X p99_ms=X ppr_top100_overlap=X

(steps/s per core: one query, 1 thread; latency: 100,000 steps, default early stopping, 1
thread; overlap: that setting against networkx's PPR.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOP = 100
ALPHA = 0.5
WALKERS = (1024, 4096, 16384)  # the one-query speed runs; the rest use 4096 (the default)
BATCH_QUERIES = 256
NX_TOL = 1e-10  # networkx stops when the L1 change is below nodes x tol
POWER_TOL = 1e-12  # L1 change of y
MAX_ITERATIONS = 10_000  # the error shrinks by (1 - alpha) per iteration
NX_SECONDS = 60.0  # networkx's share of the run: fewer queries where it is slower
PRUNING: Dict[str, List[str]] = {  # name -> `pixie build` flags
    "none": [],
    "item degree cap 100 (seeded sample)": ["--max-item-degree", "100"],
    "user degree cap 100": ["--max-user-degree", "100"],
    "min degree 5 (items and users)": ["--min-item-degree", "5", "--min-user-degree", "5"],
}
ENTROPY_BITS = (4.0, 3.5)  # where the items have categories


@dataclass(frozen=True)
class Setting:
    name: str
    steps: int
    early_stop: Tuple[int, int]  # (n_p, n_v); (0, 1): off


SETTINGS = (Setting("100k steps, no early stop", 100_000, (0, 1)),
            Setting("100k steps, early stop 1000,20 (default)", 100_000, (1000, 20)),
            Setting("100k steps, early stop 100,20", 100_000, (100, 20)),
            Setting("1M steps, no early stop", 1_000_000, (0, 1)))
DEFAULT = SETTINGS[1]


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    return f"{names[0] if names else 'unknown CPU'}, {os.cpu_count()} cores"


def cli(args: List[str]) -> Tuple[str, float]:
    """`python -m dlrm_hybrid ARGS`: (stdout, wall seconds), or exit with its error line."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "dlrm_hybrid", *args], cwd=ROOT, text=True,
                         capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if run.returncode:
        lines = (run.stderr + run.stdout).strip().splitlines() or ["no output"]
        errors = [line for line in lines if line.startswith("error:")]
        sys.exit(f"{' '.join(args[:2])} failed: {(errors or lines)[-1]}")
    return run.stdout, time.perf_counter() - start


def prepare_data(args, scratch: Path) -> Tuple[str, str]:
    """(a dataset folder, its name)."""
    if args.data:
        cli(["preprocess", "interactions", "--input", args.data, "--output",
             str(scratch / "data"), "--positive", args.positive])
        return str(scratch / "data"), args.name or Path(args.data).resolve().parent.name
    if args.dataset:
        return args.dataset, args.name or Path(args.dataset).name
    cli(["synth", "--config", str(ROOT / "configs/two_tower_demo.yaml"), "--output",
         str(scratch / "data")])
    return str(scratch / "data"), args.name or "planted"


def build(dataset: str, flags: List[str], out: Path):
    """`pixie build` with `flags`: (the graph read back, its graph.yaml, the command's s)."""
    from dlrm_hybrid.graph.bipartite import read_graph

    _, seconds = cli(["pixie", "build", "--data", dataset, "--out", str(out), *flags])
    return read_graph(str(out)), yaml.safe_load((out / "graph.yaml").read_text()), seconds


def pixie_params(setting: Setting, walkers: int = 4096, seed: int = 0):
    from dlrm_hybrid.graph.pixie import PixieParams

    return PixieParams(setting.steps, ALPHA, walkers, *setting.early_stop, seed=seed)


def query_items(graph, count: int, seed: int = 0) -> np.ndarray:
    """`count` distinct items with edges, drawn with probability proportional to degree."""
    degree = graph.item_degree().astype(np.float64)
    count = min(count, int((degree > 0).sum()))
    rng = np.random.default_rng(seed)
    return rng.choice(len(degree), size=count, replace=False, p=degree / degree.sum())


# ---- exact personalized PageRank ----------------------------------------------------------

class PixiePPR:
    """Exact PPR of Pixie's own process by power iteration (scipy): the walker's item at the
    start of a step is y = alpha e_q + (1 - alpha) y P, the items it visits v = y P, with
    P = D_i^-1 A D_u^-1 A^T kept as its two factors (no item x item matrix)."""

    def __init__(self, graph, alpha: float = ALPHA) -> None:
        import scipy.sparse as sp

        def walk(indptr, neighbours, rows, columns):  # row-stochastic rows x columns, transposed
            degree = np.maximum(np.diff(indptr), 1).astype(np.float64)
            data = np.repeat(1.0 / degree, np.diff(indptr))
            return sp.csr_matrix((data, neighbours.astype(np.int64), indptr.astype(np.int64)),
                                 shape=(rows, columns)).T.tocsr()

        self.to_users = walk(graph.item_indptr, graph.item_users, graph.items, graph.users)
        self.to_items = walk(graph.user_indptr, graph.user_items, graph.users, graph.items)
        self.alpha, self.items = alpha, graph.items

    def scores(self, query: int) -> np.ndarray:
        y = np.zeros(self.items)
        y[query] = 1.0
        for _ in range(MAX_ITERATIONS):
            v = self.to_items @ (self.to_users @ y)
            new = (1 - self.alpha) * v
            new[query] += self.alpha
            done = np.abs(new - y).sum() < POWER_TOL
            y = new
            if done:
                return v
        raise RuntimeError(f"PPR of item {query}: no convergence in {MAX_ITERATIONS} iterations")


def networkx_graph(graph):
    """The bipartite graph for networkx: items 0..items-1, users items..items+users-1."""
    import networkx as nx

    g = nx.Graph()
    item = np.repeat(np.arange(graph.items), graph.item_degree())
    g.add_edges_from(zip(item.tolist(), (graph.item_users.astype(np.int64) + graph.items).tolist()))
    return g


def networkx_scores(g, query: int, items: int) -> np.ndarray:
    import networkx as nx

    rank = nx.pagerank(g, alpha=(1 - ALPHA) ** 0.5, personalization={query: 1}, tol=NX_TOL,
                       max_iter=1000)
    scores = np.zeros(items)
    for node, value in rank.items():
        if node < items:
            scores[node] = value
    return scores


def top(scores: np.ndarray, query: int, k: int = TOP) -> np.ndarray:
    """The k best items by score, the query left out, only items with a score above 0."""
    s = scores.copy()
    s[query] = 0
    visited = np.flatnonzero(s > 0)
    return visited[np.lexsort((visited, -s[visited]))][:k]


def overlap(found: np.ndarray, reference: np.ndarray) -> float:
    return len(np.intersect1d(found[:TOP], reference[:TOP])) / TOP


def exact_tops(graph, queries: np.ndarray, nx_budget: float):
    """({query: scipy top}, {query: networkx top} for as many queries as nx_budget seconds
    allow, (scipy ms per query, networkx ms per query))."""
    ppr = PixiePPR(graph)
    scipy_top, seconds = {}, []
    for q in queries:
        start = time.perf_counter()
        scores = ppr.scores(int(q))
        seconds.append(time.perf_counter() - start)
        scipy_top[int(q)] = top(scores, int(q))
    g = networkx_graph(graph)
    nx_top, nx_seconds = {}, []
    for q in queries:
        if sum(nx_seconds) > nx_budget:
            break
        start = time.perf_counter()
        scores = networkx_scores(g, int(q), graph.items)
        nx_seconds.append(time.perf_counter() - start)
        nx_top[int(q)] = top(scores, int(q))
    return scipy_top, nx_top, (1e3 * statistics.median(seconds),
                               1e3 * statistics.median(nx_seconds))


# ---- walks --------------------------------------------------------------------------------

def threads_label(threads: int) -> str:
    return "1 thread" if threads == 1 else f"{threads} threads (every core)"


def speed_rows(walker, queries: np.ndarray, threads: int, quick: bool) -> List[Tuple]:
    """(workload, walkers, threads, steps, seconds) of walks without early stopping; the
    fastest of 3 repeats (other load on the machine only adds time)."""
    import torch

    torch.set_num_threads(threads)
    one = Setting("", 100_000 if quick else 1_000_000, (0, 1))
    batch = queries[:16 if quick else BATCH_QUERIES]
    many = Setting("", 10_000 * len(batch) if quick else 100_000 * len(batch), (0, 1))
    rows = []
    for workload, qs, setting, walkers in (
            *[(f"1 query, {one.steps:,} steps", queries[:1], one, w)
              for w in ((4096,) if quick else WALKERS)],
            (f"{len(batch)} queries, {many.steps // len(batch):,} steps each", batch, many,
             4096)):
        params = pixie_params(setting, walkers)
        walker.walk(qs, params=params, k=TOP)  # warm-up
        best = min(_timed(lambda: walker.walk(qs, params=params, k=TOP)) for _ in range(3))
        rows.append((workload, walkers, threads, setting.steps, best))
    return rows


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latency(walker, queries: np.ndarray, setting: Setting, threads: int) -> Dict[str, object]:
    """Per-query ms p50/p99 and the mean steps walked of one setting; the tops at 1 thread."""
    import torch

    torch.set_num_threads(threads)
    params = pixie_params(setting)
    walker.walk(queries[:1], params=params, k=TOP)  # warm-up
    ms, walked, stopped, tops = [], [], [], {}
    for q in queries:
        start = time.perf_counter()
        result = walker.walk([int(q)], params=params, k=TOP)
        ms.append(1e3 * (time.perf_counter() - start))
        walked.append(int(result.walked.sum()))
        stopped.append(bool(result.stopped_early.any()))
        tops[int(q)] = result.items
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99)),
            "walked": float(np.mean(walked)), "saved": 1 - float(np.mean(walked)) / setting.steps,
            "stopped": float(np.mean(stopped)), "tops": tops}


def mean_overlap(tops: Dict[int, np.ndarray], reference: Dict[int, np.ndarray]) -> float:
    """The mean overlap over the queries both have (NaN where none)."""
    shared = [q for q in reference if q in tops]
    if not shared:
        return float("nan")
    return float(np.mean([overlap(tops[q], reference[q]) for q in shared]))


# ---- the report ---------------------------------------------------------------------------

def pruning_rows(dataset: str, scratch: Path, categories: bool, queries: np.ndarray,
                 reference: Dict[int, np.ndarray], device: str, quick: bool):
    """One row per pruning rule: (name, graph.yaml, command s, p50 ms, overlap with the
    unpruned graph's exact PPR); and the unpruned graph."""
    import torch

    from dlrm_hybrid.graph.pixie import PixieWalker

    rules = dict(PRUNING)
    if categories:
        rules.update({f"user entropy above {b:g} bits": ["--max-user-entropy", str(b)]
                      for b in ENTROPY_BITS})
    if quick:  # none and the last rule
        rules = {name: rules[name] for name in ("none", list(rules)[-1])}
    torch.set_num_threads(1)
    rows = []
    for n, (name, flags) in enumerate(rules.items()):
        graph, description, seconds = build(dataset, flags, scratch / f"graph_{n}")
        walker = PixieWalker(graph, device)
        kept = [int(q) for q in queries if graph.item_degree()[q] > 0]
        params = pixie_params(DEFAULT)
        walker.walk(kept[:1], params=params, k=TOP)
        ms, tops = [], {}
        for q in kept:
            start = time.perf_counter()
            tops[q] = walker.walk([q], params=params, k=TOP).items
            ms.append(1e3 * (time.perf_counter() - start))
        rows.append((name, graph, description, seconds, float(np.percentile(ms, 50)),
                     mean_overlap(tops, reference), len(kept)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data", help="an interaction log (e.g. ml-100k/u.data)")
    source.add_argument("--dataset", help="a folder `preprocess interactions` wrote")
    parser.add_argument("--name", help="the data's name (default: the log's folder; planted)")
    parser.add_argument("--positive", default="rating>=4", help="what counts as an engagement")
    parser.add_argument("--queries", type=int, default=300, help="query items (default 300)")
    parser.add_argument("--device", default="cpu", help="the walks' device (default cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs: 20 queries, short walks")
    args = parser.parse_args()
    count = 20 if args.quick else args.queries
    settings = SETTINGS[:3] if args.quick else SETTINGS
    cores = os.cpu_count() or 1

    from dlrm_hybrid.graph.pixie import PixieWalker

    print(f"pixie benchmark on {cpu_name()}; walks on {args.device}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        dataset, name = prepare_data(args, scratch)
        graph, description, _ = build(dataset, [], scratch / "graph_full")
        queries = query_items(graph, count)
        print(f"data {name}: {graph.users:,} users, {graph.items:,} items, {graph.edges:,} "
              f"edges (train split); {len(queries)} query items drawn by degree", flush=True)
        scipy_top, nx_top, (scipy_ms, nx_ms) = exact_tops(
            graph, queries, 1.0 if args.quick else NX_SECONDS)
        print(f"exact PPR: scipy {scipy_ms:.2f} ms/query ({len(scipy_top)} queries), networkx "
              f"{nx_ms:.1f} ms/query ({len(nx_top)} queries)", flush=True)
        prune = pruning_rows(dataset, scratch, graph.item_category is not None,
                             queries[:min(len(queries), 100)], scipy_top, args.device,
                             args.quick)
    walker = PixieWalker(graph, args.device)
    speed = [row for t in sorted({1, cores}) for row in speed_rows(walker, queries, t,
                                                                   args.quick)]
    lat = {(s.name, t): latency(walker, queries, s, t) for t in sorted({1, cores})
           for s in settings}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())

    print(f"\n{name}: {graph.users:,} users, {graph.items:,} items, {graph.edges:,} edges of "
          f"the train split; {cpu_name()}; load average at the end {load} (1, 5, 15 min: "
          f"other jobs on the cores slow the walks, above all those with every core)")
    print("\nBuild (`pixie build`; p50 and overlap: 100k steps, early stop 1000,20, 1 thread, "
          "against exact PPR (scipy) of the unpruned graph, the first "
          f"{min(len(queries), 100)} query items still in the graph):")
    print("| pruning | users | items | edges | bytes/edge | build s | command s | p50 ms | "
          "top-100 overlap |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for rule, g, d, seconds, p50, ov, kept in prune:
        removed = ", ".join(f"{k} {v}" for k, v in d["pruned"].items()
                            if k in ("diverse_users", "capped_edges", "low_degree_items",
                                     "low_degree_users") and v)
        print(f"| {rule}{f' ({removed})' if removed else ''} | "
              f"{int((g.user_degree() > 0).sum()):,} | {int((g.item_degree() > 0).sum()):,} | "
              f"{g.edges:,} | {d['bytes_per_edge']} | {d['build_seconds']:.3f} | "
              f"{seconds:.2f} | {p50:.1f} | {ov:.3f} ({kept} queries) |")

    print("\nSpeed (no early stopping; steps/s the fastest of 3 calls):")
    print("| workload | walkers | threads | steps/s | steps/s per core |")
    print("|---|---:|---|---:|---:|")
    for workload, walkers, threads, steps, seconds in speed:
        print(f"| {workload} | {walkers:,} | {threads_label(threads)} | {steps / seconds:,.0f} | "
              f"{steps / seconds / threads:,.0f} |")

    print(f"\nPer query ({len(queries)} items drawn by degree, 4,096 walkers; overlap: "
          f"|Pixie top {TOP} & PPR top {TOP}| / {TOP}, query left out, mean over queries; "
          f"networkx over the first {len(nx_top)}):")
    print("| setting | threads | p50 ms | p99 ms | steps walked | steps saved | stopped early | "
          "overlap scipy PPR | overlap networkx PPR |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in settings:
        for t in sorted({1, cores}):
            m = lat[(s.name, t)]
            print(f"| {s.name} | {threads_label(t)} | {m['p50']:.2f} | {m['p99']:.2f} | "
                  f"{m['walked']:,.0f} | {m['saved']:.1%} | {m['stopped']:.0%} | "
                  f"{mean_overlap(m['tops'], scipy_top):.3f} | "
                  f"{mean_overlap(m['tops'], nx_top):.3f} |")
    print(f"| exact PPR, scipy power iteration of Pixie's process (tol {POWER_TOL:g}) | 1 thread "
          f"| {scipy_ms:.2f} (median) | | | | | 1 | {mean_overlap(scipy_top, nx_top):.3f} |")
    print(f"| exact PPR, networkx.pagerank, damping {(1 - ALPHA) ** 0.5:.4f} (tol {NX_TOL:g}) "
          f"| 1 thread | {nx_ms:.1f} (median) | | | | | {mean_overlap(nx_top, scipy_top):.3f} "
          f"| 1 |")

    one = next(r for r in speed if r[1] == 4096 and r[2] == 1 and r[0].startswith("1 query"))
    d = lat[(DEFAULT.name, 1)]
    print(f"pixie: steps_per_s={one[3] / one[4]:.0f} p50_ms={d['p50']:.2f} "
          f"p99_ms={d['p99']:.2f} ppr_top100_overlap={mean_overlap(d['tops'], nx_top):.3f}")


if __name__ == "__main__":
    main()
