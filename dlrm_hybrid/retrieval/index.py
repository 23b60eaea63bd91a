"""The item index `export --retrieval` writes and `retrieve` searches (FAISS, inner product):

- flat: exact search over every item vector;
- ivf: the vectors clustered into `nlist` lists (k-means); a query scans its `nprobe` nearest
  lists (more: closer to exact, slower);
- hnsw: a navigable small-world graph of `hnsw_m` links per node, built with
  `ef_construction` candidates per insertion, searched with `ef_search` (more: closer to exact).

Plus what the benchmark measures of an index: its recall against exact search and its latency
per query. numpy and faiss only: the serving side imports this without torch or the trainer.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Dict, Optional

import faiss
import numpy as np

from dlrm_hybrid.errors import UserError

KINDS = ("flat", "ivf", "hnsw")
SETTINGS = {"flat": (), "ivf": ("nlist", "nprobe"),
            "hnsw": ("hnsw_m", "ef_construction", "ef_search")}  # what applies to each kind
INDEX_FILE = "index.faiss"


@dataclass
class IndexParams:
    """An index's kind and settings; the settings of the other kinds are ignored."""

    kind: str = "flat"
    nlist: int = 0  # ivf: lists; 0: round(sqrt(items)) (FAISS's guide: 4-16 sqrt(N) at scale)
    nprobe: int = 8  # ivf: lists a query scans (at most nlist)
    hnsw_m: int = 32  # hnsw: links per node
    ef_construction: int = 200  # hnsw: candidates kept while inserting
    ef_search: int = 64  # hnsw: candidates kept while searching (at least k is useful)

    def resolved(self, items: int) -> "IndexParams":
        """These settings checked against a corpus of `items`, nlist filled in."""
        if self.kind not in KINDS:
            raise UserError(f"--index: {self.kind!r} is not one of {', '.join(KINDS)}")
        if items < 1:
            raise UserError("index: the corpus has no items")
        for flag, value in (("--nprobe", self.nprobe), ("--hnsw-m", self.hnsw_m),
                            ("--ef-construction", self.ef_construction),
                            ("--ef-search", self.ef_search), ("--nlist", self.nlist + 1)):
            if value < 1:
                raise UserError(f"{flag}: must be at least 1")
        nlist = self.nlist or max(1, round(math.sqrt(items)))
        if nlist > items:
            raise UserError(f"--nlist: {nlist} lists for {items} items; give at most {items}")
        return IndexParams(self.kind, nlist, min(self.nprobe, nlist), self.hnsw_m,
                           self.ef_construction, self.ef_search)

    def stated(self) -> Dict[str, object]:
        """The settings that apply to this kind (what retrieval.yaml records)."""
        return {"kind": self.kind, **{k: v for k, v in asdict(self).items()
                                      if k in SETTINGS[self.kind]}}


def index_params(kind: str, settings: Dict[str, int]) -> IndexParams:
    """IndexParams of `kind` with `settings` (IndexParams' field names), refusing a setting
    of another kind (it would be silently ignored)."""
    if kind not in KINDS:
        raise UserError(f"--index: {kind!r} is not one of {', '.join(KINDS)}")
    for name in settings:
        if name not in SETTINGS[kind]:
            owner = next(k for k in KINDS if name in SETTINGS[k])
            raise UserError(f"--{name.replace('_', '-')}: is a setting of --index {owner}, "
                            f"not of {kind}")
    return IndexParams(kind, **settings)


def build_index(vectors: np.ndarray, params: IndexParams) -> faiss.Index:
    """An inner-product index of `vectors` [items, E] (row i is item i)."""
    vectors = _float32(vectors)
    params = params.resolved(len(vectors))
    dim = vectors.shape[1]
    if params.kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif params.kind == "ivf":
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, params.nlist,
                                   faiss.METRIC_INNER_PRODUCT)
        index.cp.min_points_per_centroid = 1  # a small corpus trains quietly (no warning)
        index.train(vectors)
    else:
        index = faiss.IndexHNSWFlat(dim, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params.ef_construction
    index.add(vectors)
    apply_search_params(index, params)
    return index


def apply_search_params(index: faiss.Index, params: IndexParams) -> None:
    """Set the search-time settings (FAISS stores them in the file too; this makes sure)."""
    if params.kind == "ivf":
        faiss.extract_index_ivf(index).nprobe = params.nprobe
    elif params.kind == "hnsw":
        index.hnsw.efSearch = params.ef_search


def write_index(index: faiss.Index, path: str) -> None:
    faiss.write_index(index, path)


def read_index(path: str, stated: Dict[str, object]) -> faiss.Index:
    """The index file `path`, with the search settings of `stated` (IndexParams.stated)."""
    try:
        index = faiss.read_index(path)
    except RuntimeError as e:
        reason = (str(e).strip().splitlines() or ["unreadable"])[-1][:120]
        raise UserError(f"{path}: not a readable FAISS index ({reason}); export the model "
                        f"again") from None
    apply_search_params(index, IndexParams(**stated))
    return index


def search(index: faiss.Index, queries: np.ndarray, k: int):
    """(scores, items) [Q, k] of `queries` [Q, E], best first; item -1 where fewer exist."""
    return index.search(_float32(queries), min(k, index.ntotal))


def exact_top_k(vectors: np.ndarray, queries: np.ndarray, k: int):
    """(scores, items) [Q, k] by brute force in numpy: the reference an index is measured by."""
    scores = _float32(queries) @ _float32(vectors).T
    k = min(k, scores.shape[1])
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(scores, top, 1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, 1)
    return np.take_along_axis(scores, top, 1), top


def ann_recall(index: faiss.Index, vectors: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Mean over `queries` of |index's top k ∩ exact top k| / k: what the approximation loses."""
    _, found = search(index, queries, k)
    _, exact = exact_top_k(vectors, queries, k)
    hits = sum(len(np.intersect1d(f[f >= 0], e)) for f, e in zip(found, exact))
    return hits / (len(queries) * exact.shape[1])


def query_latency(index: faiss.Index, queries: np.ndarray, k: int,
                  warmup: Optional[int] = None) -> Dict[str, float]:
    """Milliseconds per query, one query per call as a server sees them: p50 and p99 over
    `queries` (after `warmup` untimed ones; default min(10, Q))."""
    queries = _float32(queries)
    for q in queries[:min(10, len(queries)) if warmup is None else warmup]:
        search(index, q[None], k)
    times = []
    for q in queries:
        start = time.perf_counter()
        search(index, q[None], k)
        times.append((time.perf_counter() - start) * 1e3)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


def _float32(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32)
