"""The item-user bipartite graph Pixie walks (Eksombatchai et al., WWW 2018: pins and boards;
here items and the users who engaged with them), built from an interaction dataset's engagements
and held in one machine's memory as compressed sparse rows in both directions:

    item_indptr [items + 1], item_users [edges]   the users of item i:
                                                  item_users[item_indptr[i]:item_indptr[i + 1]]
    user_indptr [users + 1], user_items [edges]   the items of user u

Ids are the dataset's dense ids (the same as the two-tower model's), 32-bit where they fit;
offsets 32-bit while the edges fit: 8 bytes per edge plus the offsets. Each node's neighbours
are in ascending order. A node that pruning removes keeps its id with no edges.

Pruning, in this order (each step's count is kept in `report`):
1. repeated (user, item) engagements become one edge;
2. `max_user_entropy` (bits): users whose items span too many categories (the entropy of their
   items' category distribution above it) are removed: the source's "diverse boards";
3. `max_item_degree`, `max_user_degree`: a node with more neighbours keeps a seeded uniform
   sample of that many, items' cap first (the dataset's train split keeps no time order, so
   not the most recent);
4. `min_item_degree`, `min_user_degree`: nodes with fewer neighbours are removed, repeated until
   every node left has at least that many (removing one can drop another below).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import yaml

from dlrm_hybrid.errors import DataError, UserError
from dlrm_hybrid.partial_folder import finish_partial, start_partial

FORMAT = "dlrm_hybrid pixie graph 1"
DESCRIPTION = "graph.yaml"
ARRAYS = ("item_indptr", "item_users", "user_indptr", "user_items")
CATEGORY = "item_category.npy"  # where the graph knows its items' categories
RAW_IDS = ("users.txt", "items.txt")


@dataclass
class Pruning:
    """What `build_graph` removes; 0 turns a rule off."""

    max_item_degree: int = 0
    max_user_degree: int = 0
    min_item_degree: int = 1
    min_user_degree: int = 1
    max_user_entropy: float = 0.0  # bits; needs item categories
    seed: int = 0  # the degree caps' samples

    def check(self, has_categories: bool) -> None:
        for name in ("max_item_degree", "max_user_degree", "min_item_degree", "min_user_degree",
                     "seed"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name.replace('_', '-')}: must be 0 or more, not "
                                f"{getattr(self, name)}")
        for side in ("item", "user"):
            cap, least = getattr(self, f"max_{side}_degree"), getattr(self, f"min_{side}_degree")
            if 0 < cap < least:
                raise UserError(f"--max-{side}-degree {cap} is below --min-{side}-degree "
                                f"{least}: every {side} would be removed; raise the cap or lower "
                                f"the minimum")
        if not self.max_user_entropy >= 0:
            raise UserError("--max-user-entropy: must be 0 (off) or a positive number of bits")
        if self.max_user_entropy and not has_categories:
            raise UserError("--max-user-entropy: needs item categories; name the dataset's item "
                            "feature with --category-feature")


@dataclass
class Graph:
    """Both directions of the same edges; `item_category` [items] where categories are known."""

    users: int
    items: int
    item_indptr: np.ndarray
    item_users: np.ndarray
    user_indptr: np.ndarray
    user_items: np.ndarray
    item_category: Optional[np.ndarray] = None
    description: Dict[str, object] = field(default_factory=dict)

    @property
    def edges(self) -> int:
        return int(len(self.item_users))

    def item_degree(self) -> np.ndarray:
        return np.diff(self.item_indptr)

    def user_degree(self) -> np.ndarray:
        return np.diff(self.user_indptr)

    def nbytes(self) -> int:
        """Bytes of the four CSR arrays (what a walk holds in memory)."""
        return int(sum(getattr(self, name).nbytes for name in ARRAYS))


def build_graph(users: int, items: int, edge_users: np.ndarray, edge_items: np.ndarray,
                pruning: Pruning = Pruning(), item_category: Optional[np.ndarray] = None
                ) -> Tuple[Graph, Dict[str, int]]:
    """The pruned graph of the engagements (edge_users[e], edge_items[e]), and what each
    pruning step removed. The edges stay sorted by (user, item) throughout: every step keeps
    a subset in order, so the CSR needs only one stable sort per direction."""
    pruning.check(item_category is not None)
    key, _ = distinct(np.asarray(edge_users, np.int64) * items + np.asarray(edge_items, np.int64))
    u, i = key // max(items, 1), key % max(items, 1)
    report = {"engagements": int(len(edge_users)), "repeated": int(len(edge_users) - len(key))}
    if pruning.max_user_entropy:
        categories = np.asarray(item_category, np.int64)[i]
        diverse = user_entropy(u, categories, users) > pruning.max_user_entropy
        report["diverse_users"] = int(diverse.sum())
        u, i = u[~diverse[u]], i[~diverse[u]]
    rng = np.random.default_rng(pruning.seed)
    before = len(u)
    if pruning.max_item_degree:
        kept = capped(i, pruning.max_item_degree, rng)
        u, i = u[kept], i[kept]
    if pruning.max_user_degree:  # after the items' cap: it can only lower item degrees
        kept = capped(u, pruning.max_user_degree, rng)
        u, i = u[kept], i[kept]
    report["capped_edges"] = int(before - len(u))
    u, i, dropped = min_degree(u, i, users, items, pruning.min_user_degree, pruning.min_item_degree)
    report.update(dropped)
    report["edges"] = int(len(u))
    item_indptr, item_users = csr(i, u, items, users)
    user_indptr, user_items = csr(u, i, users, items)
    graph = Graph(users, items, item_indptr, item_users, user_indptr, user_items,
                  None if item_category is None else np.asarray(item_category, np.int32))
    return graph, report


def user_entropy(edge_users: np.ndarray, edge_categories: np.ndarray, users: int) -> np.ndarray:
    """[users] entropy in bits of each user's items' categories (0 for a user without items),
    from the distinct (user, category) pairs: memory per edge, not per user x category."""
    categories = int(edge_categories.max()) + 1 if len(edge_categories) else 1
    pairs, counts = distinct(edge_users * categories + edge_categories)
    owner = pairs // categories
    p = counts / np.bincount(owner, weights=counts, minlength=users)[owner]
    return np.bincount(owner, weights=-p * np.log2(p), minlength=users)


def distinct(keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The sorted distinct values of `keys` and how often each occurs. A plain sort: numpy 2.4's
    np.unique hashes first, 10x slower on 5M int64 keys (7.2 s against 0.6 s, measured)."""
    keys = np.sort(keys)
    starts = np.ones(len(keys), bool)
    starts[1:] = keys[1:] != keys[:-1]
    first = np.flatnonzero(starts)
    return keys[first], np.diff(np.r_[first, len(keys)])


def capped(nodes: np.ndarray, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Indices (ascending) of the edges kept when every node of `nodes` (one per edge) keeps
    at most `cap` of its edges, a uniform sample: the first `cap` of each node's edges in a
    random order."""
    shuffled = rng.permutation(len(nodes))
    order = shuffled[np.argsort(nodes[shuffled], kind="stable")]
    grouped = nodes[order]
    sizes = np.bincount(grouped)
    rank = np.arange(len(order)) - (np.cumsum(sizes) - sizes)[grouped]  # place in its group
    return np.sort(order[rank < cap])


def min_degree(u: np.ndarray, i: np.ndarray, users: int, items: int, min_user: int,
               min_item: int) -> Tuple[np.ndarray, np.ndarray, Dict[str, int]]:
    """The edges left once every node has at least its side's minimum degree: removing a node
    lowers its neighbours' degrees, so repeated until nothing changes. The counts are the nodes
    this step left without edges."""
    had_users, had_items = np.bincount(u, minlength=users) > 0, np.bincount(i, minlength=items) > 0
    while True:
        keep = ((np.bincount(u, minlength=users) >= min_user)[u]
                & (np.bincount(i, minlength=items) >= min_item)[i])
        if keep.all():
            break
        u, i = u[keep], i[keep]
    left_users, left_items = np.bincount(u, minlength=users), np.bincount(i, minlength=items)
    return u, i, {"low_degree_items": int((had_items & (left_items == 0)).sum()),
                  "low_degree_users": int((had_users & (left_users == 0)).sum())}


def csr(rows: np.ndarray, columns: np.ndarray, count: int, other: int
        ) -> Tuple[np.ndarray, np.ndarray]:
    """(indptr [count + 1], the columns grouped by row) in the narrowest dtypes (ids < `other`).
    A stable sort: columns that come in ascending within each row stay so."""
    order = np.argsort(rows, kind="stable")
    indptr = np.zeros(count + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=count), out=indptr[1:])
    offsets = np.int32 if len(rows) < 2 ** 31 else np.int64
    ids = np.int32 if other <= 2 ** 31 else np.int64
    return indptr.astype(offsets), columns[order].astype(ids)


def dataset_digest(users: int, items: int, indptr: np.ndarray, engaged: np.ndarray) -> str:
    """A fingerprint of an interaction dataset: its sizes and each user's distinct train items
    (InteractionData.engaged(("train",)), which `export --retrieval` saves as its seen items), so
    a graph and a retrieval folder can tell whether they were made from the same data."""
    digest = hashlib.sha256(f"{users} {items}".encode())
    digest.update(np.ascontiguousarray(indptr, np.int64).tobytes())
    digest.update(np.ascontiguousarray(engaged, np.int64).tobytes())
    return digest.hexdigest()[:32]


def graph_from_dataset(path: str, pruning: Pruning, splits: Tuple[str, ...] = ("train",),
                       category_feature: str = "") -> Tuple[Graph, Dict[str, int]]:
    """The graph of an interaction dataset folder's `splits` (default train: evaluation's
    val/test items stay out of it); `category_feature` names the item side feature that holds
    categories ("" : the dataset's `category` if it has one)."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions
    from dlrm_hybrid.data.interactions.interaction_meta import META_FILE, is_interaction_folder

    start = time.perf_counter()
    if not Path(path).exists():
        raise UserError(f"--data: {path} does not exist; give a folder `preprocess interactions` "
                        f"wrote")
    if not is_interaction_folder(path):
        raise UserError(f"--data: {path} is not an interaction dataset (no {META_FILE}); give a "
                        f"folder `preprocess interactions` wrote")
    data = open_interactions(path)
    if not splits:
        raise UserError(f"--splits: names no split; give some of {', '.join(data.pairs)}")
    missing = [s for s in splits if s not in data.pairs]
    if missing:
        raise UserError(f"--splits: {path} has no {', '.join(missing)} split (it has "
                        f"{', '.join(data.pairs)})")
    sides = list(data.meta.item_side)
    name = category_feature or ("category" if "category" in sides else "")
    if name and name not in sides:
        raise UserError(f"--category-feature: {path} has no item feature {name!r} (its item "
                        f"features: {', '.join(sides) or 'none'})")
    pruning.check(bool(name))
    category = np.asarray(data.item_side)[:, sides.index(name)] if name else None
    edge_users = np.concatenate([np.asarray(data.pairs[s][0]) for s in splits])
    edge_items = np.concatenate([np.asarray(data.pairs[s][1]) for s in splits])
    graph, report = build_graph(data.users, data.items, edge_users, edge_items, pruning, category)
    indptr, engaged = data.engaged(("train",))
    graph.description = {
        "format": FORMAT, "users": data.users, "items": data.items, "edges": graph.edges,
        "bytes_per_edge": round(graph.nbytes() / max(graph.edges, 1), 3),
        "source": {"data": str(Path(path).resolve()), "splits": list(splits),
                   "dataset_digest": dataset_digest(data.users, data.items, indptr, engaged)},
        "category_feature": name, "pruning": asdict(pruning), "pruned": report,
        "build_seconds": round(time.perf_counter() - start, 3)}
    return graph, report


def check_out(out: str, data: str = "") -> None:
    """`out` can become the graph folder: it does not exist, its folder does, and it is not
    inside the dataset folder `data` (a dataset holds only what `preprocess` wrote)."""
    target = Path(out)
    if os.path.lexists(target):
        raise UserError(f"--out: {out} already exists; give a new folder")
    if not target.parent.is_dir():
        raise UserError(f"--out: folder {target.parent} does not exist; create it first")
    if data and Path(data).is_dir() and Path(os.path.realpath(out)).is_relative_to(
            os.path.realpath(data)):
        raise UserError(f"--out: {out} is inside --data {data}; write the graph elsewhere")


def write_graph(graph: Graph, out: str, raw_ids_from: Optional[str] = None) -> None:
    """The folder `out` (which must not exist): graph.yaml, the CSR arrays, the categories and
    the dataset's raw ids; written in `out`.partial (a killed build's removed first), renamed
    when whole."""
    check_out(out)
    target = Path(out)
    partial = start_partial(target, "pixie build")
    try:
        for name in ARRAYS:
            np.save(partial / f"{name}.npy", getattr(graph, name))
        if graph.item_category is not None:
            np.save(partial / CATEGORY, graph.item_category)
        for name in RAW_IDS:
            if raw_ids_from and (Path(raw_ids_from) / name).is_file():
                shutil.copyfile(Path(raw_ids_from) / name, partial / name)
        (partial / DESCRIPTION).write_text(yaml.safe_dump(graph.description, sort_keys=False))
        check_out(out)  # made meanwhile: a rename would replace it were it an empty folder
        finish_partial(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def read_graph(folder: str) -> Graph:
    """A folder `pixie build` wrote, checked; a one-line error naming what is wrong."""
    root = Path(folder)
    if not (root / DESCRIPTION).is_file():
        raise UserError(f"{folder}: not a graph folder (no {DESCRIPTION}); give a folder "
                        f"`pixie build` wrote")
    try:
        description = yaml.safe_load((root / DESCRIPTION).read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:  # binary bytes: not UTF-8 either
        raise DataError(f"{root / DESCRIPTION}: not valid YAML ({str(e).splitlines()[0]}); "
                        f"build the graph again") from None
    if not isinstance(description, dict) or description.get("format") != FORMAT:
        raise DataError(f"{root / DESCRIPTION}: not written by `pixie build` (format {FORMAT!r} "
                        f"expected); build the graph again")
    sizes = [description.get(k) for k in ("users", "items")]
    if not all(isinstance(n, int) and n >= 0 for n in sizes):
        raise DataError(f"{root / DESCRIPTION}: users and items must be counts, not {sizes}; "
                        f"build the graph again")
    arrays = {name: _load_ids(root / f"{name}.npy") for name in ARRAYS}
    category = _load_ids(root / CATEGORY) if (root / CATEGORY).exists() else None
    graph = Graph(*sizes, **arrays, item_category=category, description=description)
    _check(graph, root)
    return graph


def _load_ids(path: Path) -> np.ndarray:
    """A 1-D integer array saved by np.save, or a one-line DataError."""
    try:
        array = np.load(path, allow_pickle=False)
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e}); build the graph again") from None
    except (ValueError, EOFError) as e:  # truncated, or not an .npy file
        raise DataError(f"{path}: damaged ({str(e).splitlines()[0] if str(e) else 'truncated'}); "
                        f"build the graph again") from None
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise DataError(f"{path}: {array.dtype} of shape {array.shape}, not 1-D integer ids; "
                        f"build the graph again")
    return array


def _check(graph: Graph, root: Path) -> None:
    """Shapes and ids that a walk would index with, and both directions holding the same
    degrees: a damaged file stops here, not in a walk."""
    for indptr, neighbours, count, other, what in (
            (graph.item_indptr, graph.item_users, graph.items, graph.users, "item"),
            (graph.user_indptr, graph.user_items, graph.users, graph.items, "user")):
        if (len(indptr) != count + 1 or indptr[0] != 0 or indptr[-1] != len(neighbours)
                or (np.diff(indptr) < 0).any()):
            raise DataError(f"{root}/{what}_indptr.npy: not the offsets of {count} {what}s' "
                            f"neighbours; build the graph again")
        if len(neighbours) and (neighbours.min() < 0 or neighbours.max() >= other):
            raise DataError(f"{root}/{what}_{'users' if what == 'item' else 'items'}.npy: ids "
                            f"outside [0, {other}); build the graph again")
    if not (np.array_equal(np.bincount(graph.user_items, minlength=graph.items),
                           graph.item_degree())
            and np.array_equal(np.bincount(graph.item_users, minlength=graph.users),
                               graph.user_degree())):
        raise DataError(f"{root}: the item->user and user->item arrays hold different edges; "
                        f"build the graph again")
    if graph.item_category is not None and graph.item_category.shape != (graph.items,):
        raise DataError(f"{root / CATEGORY}: {graph.item_category.shape}, expected "
                        f"({graph.items},); build the graph again")
