"""The item-user graph Pixie walks: each pruning rule on small hand-made edge lists, the CSR's two
directions, `pixie build` on a dataset `preprocess interactions` made, and its bad inputs."""

from __future__ import annotations

import collections
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import done_fields, failure, run_cli
from dlrm_hybrid.data.interactions.interaction_data import open_interactions
from dlrm_hybrid.errors import DataError, UserError
from dlrm_hybrid.graph.bipartite import (Pruning, build_graph, dataset_digest, read_graph,
                                         user_entropy)


def edge_set(graph) -> tuple:
    """(user, item) pairs read from each direction of the CSR."""
    by_user = {(u, int(i)) for u in range(graph.users)
               for i in graph.user_items[graph.user_indptr[u]:graph.user_indptr[u + 1]]}
    by_item = {(int(u), i) for i in range(graph.items)
               for u in graph.item_users[graph.item_indptr[i]:graph.item_indptr[i + 1]]}
    return by_user, by_item


def build(users, items, edges, **pruning):
    u, i = (np.array(side, np.int64) for side in zip(*edges))
    category = pruning.pop("category", None)
    return build_graph(users, items, u, i, Pruning(**pruning), category)


def test_repeated_engagements_are_one_edge_and_both_directions_hold_the_same_edges():
    rng = np.random.default_rng(0)
    edges = list(zip(rng.integers(0, 30, 400).tolist(), rng.integers(0, 20, 400).tolist()))
    graph, report = build(30, 20, edges)
    by_user, by_item = edge_set(graph)
    assert by_user == by_item == set(edges)
    assert report["repeated"] == len(edges) - len(set(edges)) > 0
    assert graph.edges == report["edges"] == len(set(edges))
    for indptr, neighbours in ((graph.user_indptr, graph.user_items),
                               (graph.item_indptr, graph.item_users)):
        assert indptr.dtype == neighbours.dtype == np.int32
        assert all((np.diff(neighbours[a:b]) > 0).all() for a, b in zip(indptr[:-1], indptr[1:]))
    assert graph.nbytes() == 4 * (2 * graph.edges + 30 + 20 + 2)


def test_entropy_in_bits_removes_the_diverse_users_and_nothing_else():
    category = np.array([0, 1, 2, 3, 0, 0])  # items 0..3 span four categories, 4 and 5 one
    edges = [(0, 0), (0, 1), (0, 2), (0, 3),  # user 0: four categories evenly, 2 bits
             (1, 4), (1, 5), (1, 0),          # user 1: one category, 0 bits
             (2, 0), (2, 1), (2, 4), (2, 5)]  # user 2: 0,1,0,0: 0.81 bits
    entropy = user_entropy(np.array([u for u, _ in edges]),
                           category[[i for _, i in edges]].astype(np.int64), 3)
    assert entropy == pytest.approx([2.0, 0.0, -(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25))])
    graph, report = build(3, 6, edges, max_user_entropy=1.5, category=category)
    assert edge_set(graph)[0] == set(edges[4:]) and report["diverse_users"] == 1
    graph, report = build(3, 6, edges, max_user_entropy=2.5, category=category)
    assert edge_set(graph)[0] == set(edges) and report["diverse_users"] == 0


def test_a_degree_cap_keeps_exactly_cap_edges_a_seeded_sample():
    popular = [(u, 0) for u in range(12)]  # item 0: 12 users; the others under the cap
    edges = popular + [(0, 1), (1, 1), (2, 2)]
    samples = set()
    for seed in range(6):
        graph, report = build(12, 3, edges, max_item_degree=4, seed=seed)
        assert list(graph.item_degree()) == [4, 2, 1] and report["capped_edges"] == 8
        assert edge_set(graph)[0] >= set(edges[12:]) and edge_set(graph)[0] <= set(edges)
        samples.add(tuple(graph.item_users[:4]))
        again, _ = build(12, 3, edges, max_item_degree=4, seed=seed)
        assert np.array_equal(again.item_users, graph.item_users)
    assert len(samples) == 6  # C(12, 4) = 495 samples: six seeds drawing a repeat is unlikely
    users, _ = build(3, 12, [(i, u) for u, i in edges], max_user_degree=4, seed=0)
    assert list(users.user_degree()) == [4, 2, 1]


def test_the_cap_sample_is_uniform():
    """2,000 items with the same 20 users, capped at 5 (seed 0): each user is kept by
    2,000 * 5 / 20 = 500 items, binomial sd 19.4; the tolerance is 5 sd (97)."""
    items, users, cap = 2000, 20, 5
    edges = [(u, i) for i in range(items) for u in range(users)]
    graph, _ = build(users, items, edges, max_item_degree=cap, seed=0)
    kept = graph.user_degree()
    assert kept.sum() == items * cap
    assert np.abs(kept - items * cap / users).max() < 97, kept


def test_both_caps_together_keep_a_subset_under_both():
    rng = np.random.default_rng(1)
    edges = set(zip(rng.integers(0, 50, 2000).tolist(), rng.integers(0, 40, 2000).tolist()))
    graph, _ = build(50, 40, sorted(edges), max_item_degree=10, max_user_degree=5)
    assert edge_set(graph)[0] <= edges and edge_set(graph)[1] <= edges
    assert graph.item_degree().max() <= 10 and graph.user_degree().max() == 5


def test_min_degree_unravels_a_chain_to_its_fixed_point():
    """A chain u0-i0-u1-i1-...-u6 (every item of degree 2, the end users 1) unravels from its
    ends when users need 2 items and items 2 users; a complete 3x3 block beside it stays."""
    chain = [(k, k) for k in range(6)] + [(k + 1, k) for k in range(6)]
    block = [(u, i) for u in range(7, 10) for i in range(6, 9)]
    graph, report = build(10, 9, chain + block, min_user_degree=2, min_item_degree=2)
    assert edge_set(graph)[0] == set(block)
    assert report["low_degree_users"] == 7 and report["low_degree_items"] == 6
    graph, report = build(10, 9, chain + block)  # the defaults (1) remove nothing
    assert graph.edges == len(chain + block) and report["low_degree_users"] == 0


# `pixie build` as a user meets it: a log with an item genre, made into a dataset in the test
@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pixie_graph")
    rng = np.random.default_rng(0)
    lines = [f"u{u},i{i},{t},g{i % 4}" for t, (u, i) in enumerate(
        zip(rng.integers(0, 15, 160).tolist(), rng.integers(0, 12, 160).tolist()))]
    (folder / "log.csv").write_text("\n".join(lines) + "\n")
    result = run_cli(["preprocess", "interactions", "--input", str(folder / "log.csv"),
                      "--columns", "user,item,timestamp,item:genre", "--output",
                      str(folder / "data")])
    assert result.returncode == 0, failure(result)
    return folder / "data"


def pixie_build(data: Path, out: Path, *options: str):
    return run_cli(["pixie", "build", "--data", str(data), "--out", str(out), *options])


def test_pixie_build_writes_the_train_graph_and_its_description(dataset, tmp_path):
    result = pixie_build(dataset, tmp_path / "g")
    assert result.returncode == 0, failure(result)
    graph, data = read_graph(str(tmp_path / "g")), open_interactions(str(dataset))
    train = set(zip(*(side.tolist() for side in data.pairs["train"])))
    assert edge_set(graph) == (train, train)  # val and test stay out
    d = yaml.safe_load((tmp_path / "g" / "graph.yaml").read_text())
    assert d["edges"] == done_fields(result.stdout)["edges"] == len(train)
    assert d["bytes_per_edge"] == round(graph.nbytes() / len(train), 3)
    assert d["source"]["splits"] == ["train"] and d["category_feature"] == ""
    # export --retrieval saves engaged(("train",)) as seen_indptr/seen_items: the same digest
    assert d["source"]["dataset_digest"] == dataset_digest(data.users, data.items,
                                                           *data.engaged(("train",)))
    for name in ("users.txt", "items.txt"):
        assert (tmp_path / "g" / name).read_text() == (dataset / name).read_text()
    assert not (tmp_path / "g" / "item_category.npy").exists()

    both = pixie_build(dataset, tmp_path / "g2", "--splits", "train,val")
    assert both.returncode == 0, failure(both)
    val = set(zip(*(side.tolist() for side in data.pairs["val"])))
    assert edge_set(read_graph(str(tmp_path / "g2")))[0] == train | val


def test_pixie_build_applies_the_pruning_flags(dataset, tmp_path):
    flags = {"max_item_degree": 5, "max_user_degree": 6, "min_item_degree": 2,
             "min_user_degree": 3, "max_user_entropy": 1.9, "seed": 4}
    options = [f for k, v in flags.items() for f in (f"--{k.replace('_', '-')}", str(v))]
    result = pixie_build(dataset, tmp_path / "g", "--category-feature", "genre", *options)
    assert result.returncode == 0, failure(result)
    graph, data = read_graph(str(tmp_path / "g")), open_interactions(str(dataset))
    genre = np.asarray(data.item_side)[:, list(data.meta.item_side).index("genre")]
    expected, report = build_graph(data.users, data.items, *data.pairs["train"], Pruning(**flags),
                                   genre)
    assert edge_set(graph) == edge_set(expected) and np.array_equal(graph.item_category, genre)
    d = yaml.safe_load((tmp_path / "g" / "graph.yaml").read_text())
    assert d["pruning"] == flags and d["pruned"] == report and d["category_feature"] == "genre"
    assert 0 < report["diverse_users"] and 0 < report["capped_edges"] and 0 < graph.edges
    assert d["source"]["dataset_digest"] == dataset_digest(data.users, data.items,
                                                           *data.engaged(("train",)))
    # the users removed as diverse are those whose train items' genres exceed 1.9 bits
    genres = collections.defaultdict(list)
    for u, i in set(zip(*(side.tolist() for side in data.pairs["train"]))):
        genres[u].append(int(genre[i]))
    bits = {u: -sum(c / len(g) * math.log2(c / len(g)) for c in collections.Counter(g).values())
            for u, g in genres.items()}
    assert report["diverse_users"] == sum(b > 1.9 for b in bits.values())
    assert not {u for u, b in bits.items() if b > 1.9} & {u for u, _ in edge_set(graph)[0]}


def test_pixie_build_bad_inputs_are_one_line_errors_and_write_nothing(dataset, tmp_path):
    split_binary = tmp_path / "binary"
    (split_binary / "train").mkdir(parents=True)
    (split_binary / "feature_spec.yaml").write_text("feature_spec: {}\n")
    (tmp_path / "taken").mkdir()
    dataset_files = sorted(p.name for p in dataset.iterdir())
    cases = [  # (arguments, what the error names)
        (["--data", str(tmp_path / "missing")], "does not exist"),
        (["--data", str(split_binary)], "not an interaction dataset"),
        (["--out", str(tmp_path / "taken")], "already exists"),
        (["--out", str(dataset / "graph")], "inside --data"),
        (["--out", str(tmp_path / "no" / "g")], "does not exist"),
        (["--splits", "train,holdout"], "no holdout split"),
        (["--splits", ","], "--splits: names no split"),
        (["--category-feature", "colour"], "no item feature 'colour'"),
        (["--max-user-entropy", "1"], "--max-user-entropy: needs item categories"),
        (["--max-item-degree", "-1"], "--max-item-degree: must be 0 or more"),
        (["--min-user-degree", "-2"], "--min-user-degree: must be 0 or more"),
        (["--max-user-degree", "2", "--min-user-degree", "3"], "every user would be removed"),
        (["--min-item-degree", "100000"], "pixie build: no edge is left (")]
    for args, expected in cases:
        options = {"--data": str(dataset), "--out": str(tmp_path / "g")}
        options.update(zip(args[::2], args[1::2]))
        result = run_cli(["pixie", "build", *[x for kv in options.items() for x in kv]])
        assert result.returncode == 2 and expected in result.stderr, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["binary", "taken"], args
    assert sorted(p.name for p in dataset.iterdir()) == dataset_files


KILLED_AFTER_ONE_ARRAY = """import os, sys
import numpy as np
from dlrm_hybrid.cli import main
save = np.save
def save_then_die(*args, **kwargs):
    save(*args, **kwargs)
    os._exit(137)  # as SIGKILL: no cleanup runs
np.save = save_then_die
main(sys.argv[1:])
"""


def test_a_build_killed_half_way_leaves_nothing_once_run_again(dataset, tmp_path):
    """A build killed while writing leaves its unfinished folder; the next build of the same
    output removes it (the marker says `pixie build` made it) and writes the graph whole."""
    (tmp_path / "killed.py").write_text(KILLED_AFTER_ONE_ARRAY)
    killed = run_cli(["pixie", "build", "--data", str(dataset), "--out", str(tmp_path / "g")],
                     script=tmp_path / "killed.py", fresh=True)
    assert killed.returncode == 137 and not (tmp_path / "g").exists(), failure(killed)
    result = pixie_build(dataset, tmp_path / "g")
    assert result.returncode == 0, failure(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "killed.py"]
    assert read_graph(str(tmp_path / "g")).edges == done_fields(result.stdout)["edges"]


@pytest.fixture(scope="module")
def built(dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pixie_graph_built") / "g"
    result = pixie_build(dataset, out, "--category-feature", "genre")
    assert result.returncode == 0, failure(result)
    return out


def _truncate(folder: Path) -> None:
    path = folder / "item_indptr.npy"
    path.write_bytes(path.read_bytes()[:-8])


def _short_indptr(folder: Path) -> None:
    np.save(folder / "user_indptr.npy", np.load(folder / "user_indptr.npy")[:-1])


def _other_edges(folder: Path) -> None:
    items = np.load(folder / "user_items.npy")
    items[0] = (items[0] + 1) % (len(np.load(folder / "item_indptr.npy")) - 1)
    np.save(folder / "user_items.npy", items)


def _damage_yaml(field: str, value):
    def damage(folder: Path) -> None:
        d = yaml.safe_load((folder / "graph.yaml").read_text())
        d[field] = value
        (folder / "graph.yaml").write_text(yaml.safe_dump(d))
    return damage


@pytest.mark.parametrize("damage, expected", [
    (lambda f: (f / "item_users.npy").unlink(), "item_users.npy: cannot read"),
    (lambda f: (f / "graph.yaml").unlink(), "not a graph folder"),
    (_damage_yaml("format", "dlrm_hybrid retrieval 1"), "not written by `pixie build`"),
    (lambda f: (f / "graph.yaml").write_bytes(b"\xff\xfe\x00"), "graph.yaml: not valid YAML"),
    (_damage_yaml("items", "many"), "users and items must be counts"),
    (_truncate, "item_indptr.npy: damaged"),
    (_short_indptr, "user_indptr.npy: not the offsets"),
    (_other_edges, "hold different edges"),
    (lambda f: np.save(f / "item_category.npy", np.zeros(3, np.int32)), "item_category.npy"),
    (lambda f: np.save(f / "item_users.npy", np.load(f / "item_users.npy") * 1.0),
     "not 1-D integer"),
], ids=["missing array", "no graph.yaml", "foreign format", "binary yaml", "bad count",
        "truncated indptr",
        "short indptr", "other edges", "category shape", "float ids"])
def test_a_damaged_graph_folder_is_a_one_line_error(built, tmp_path, damage, expected):
    folder = Path(shutil.copytree(built, tmp_path / "g"))
    damage(folder)
    with pytest.raises((DataError, UserError)) as error:
        read_graph(str(folder))
    assert expected in str(error.value) and "\n" not in str(error.value)
