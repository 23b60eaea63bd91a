"""benchmarks/pixie.py: the exact personalized PageRank its overlap figures rest on. The scipy
power iteration must be Pixie's process solved exactly, and networkx.pagerank with damping
sqrt(1 - alpha) must rank the items as that process does (the query left out)."""


import numpy as np
import pytest

from conftest import load_script
from dlrm_hybrid.graph.bipartite import build_graph


@pytest.fixture(scope="module")
def bench():
    """benchmarks/pixie.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/pixie.py", "pixie_bench")


@pytest.fixture(scope="module")
def graph():
    """A random bipartite graph of 12 users and 9 items (every node with an edge) whose
    degrees differ, so a wrong normalisation changes the scores."""
    rng = np.random.default_rng(5)
    users, items = 12, 9
    edges = [(u, u % items) for u in range(users)]
    edges += [(int(u), int(i)) for u, i in zip(rng.integers(0, users, 40),
                                                rng.integers(0, items, 40))]
    u, i = np.array(edges).T
    return build_graph(users, items, u, i)[0]


def transition(graph) -> np.ndarray:
    """[items, items] P: item -> a uniform user of it -> a uniform item of that user."""
    a = np.zeros((graph.items, graph.users))
    for item in range(graph.items):
        a[item, graph.item_users[graph.item_indptr[item]:graph.item_indptr[item + 1]]] = 1
    return (a / a.sum(1, keepdims=True)) @ (a.T / a.T.sum(1, keepdims=True))


@pytest.mark.parametrize("query,alpha", [(0, 0.5), (4, 0.3)])
def test_the_scipy_reference_is_pixies_process_solved_exactly(bench, graph, query, alpha):
    """v = y P with y = alpha e_q + (1 - alpha) v: y = alpha e_q (I - (1 - alpha) P)^-1."""
    p = transition(graph)
    e = np.eye(graph.items)[query]
    y = alpha * np.linalg.solve((np.eye(graph.items) - (1 - alpha) * p).T, e)
    got = bench.PixiePPR(graph, alpha).scores(query)
    np.testing.assert_allclose(got, y @ p, rtol=1e-9, atol=1e-12)
    assert got.sum() == pytest.approx(1.0)


@pytest.mark.parametrize("query,alpha", [(0, 0.5), (4, 0.3)])
def test_networkx_pagerank_ranks_items_as_pixies_process(bench, graph, query, alpha,
                                                         monkeypatch):
    """Item scores of networkx (damping sqrt(1 - alpha), teleport to the query) are the
    scipy reference's up to a constant, off the query; so both references share one top."""
    monkeypatch.setattr(bench, "ALPHA", alpha)
    exact = bench.PixiePPR(graph, alpha).scores(query)
    nx = bench.networkx_scores(bench.networkx_graph(graph), query, graph.items)
    off = np.arange(graph.items) != query
    np.testing.assert_allclose(nx[off] / nx[off].sum(), exact[off] / exact[off].sum(),
                               rtol=1e-6)
    assert list(bench.top(nx, query)) == list(bench.top(exact, query))
    assert query not in bench.top(exact, query)
