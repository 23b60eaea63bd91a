"""`export --retrieval`: a two_tower or hstu checkpoint -> a folder `retrieve` serves from:

    user_tower.pt       the user tower, TorchScript: plain embedding tables and its MLP, so
                        torch.jit.load reads it without this package (or torchrec, fbgemm);
                        a history tower (model.user_tower.encoder history_*) takes the
                        user's last items instead of the user's ids (HistoryTower), and so
                        does the sequence model (hstu: its HSTU output at the last item)
    item_vectors.npy    [items, E] float32: the item tower over the whole corpus
    index.faiss         those vectors in a FAISS inner-product index (retrieval/index.py)
    user_side.npy       [users, F] the side features the user tower reads, by dense user id
    seen_indptr.npy, seen_items.npy   each user's training items (CSR), left out of answers
    history_times.npy   those items' times, where the sequence model reads them (hstu)
    history_indptr.npy, history_items.npy   each user's training items in time order (CSR),
                                            where the dataset records it (train_position.npy):
                                            a history tower's history of `--user`, and the
                                            latest items a ranker's similarity features read
    users.txt, items.txt              raw ids in dense-id order (where the dataset has them)
    retrieval.yaml      what the folder holds: sizes, features, the index and its settings

The folder appears whole or not at all. This module has no `from __future__ import
annotations`: TorchScript compiles the tower classes below from their annotations.
"""

import shutil
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import yaml
from torch import nn
from torch.nn.functional import normalize

from dlrm_hybrid import __version__
from dlrm_hybrid.compat import jit_save, jit_script
from dlrm_hybrid.data.source import open_dataset
from dlrm_hybrid.data.interactions.interaction_meta import ITEM_ID
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.model.compositional import FeatureLookup
from dlrm_hybrid.model.hstu import EPS, last_positions
from dlrm_hybrid.model.hstu_retrieval import HSTURetrieval, build_hstu
from dlrm_hybrid.model.two_tower import SIDES, TwoTower, build_two_tower
from dlrm_hybrid.partial_folder import finish_partial, start_partial
from dlrm_hybrid.retrieval.index import INDEX_FILE, IndexParams, build_index, write_index
from dlrm_hybrid.serve.export import TABLE_PREFIX, load_dense_weights, read_checkpoint
from dlrm_hybrid.serve.retrieve import (DESCRIPTION, FORMAT, HISTORY_INDPTR, HISTORY_ITEMS,
                                        HISTORY_TIMES,
                                        ITEM_VECTORS, ITEMS, SEEN_INDPTR, SEEN_ITEMS, USER_SIDE,
                                        USER_TOWER, USERS)
from dlrm_hybrid.train.checkpoint import read_meta

CORPUS_CHUNK = 65536  # items through the item tower at once


class Table(nn.Module):
    """A full table (modulus 0) or a hashed one (row = id mod modulus)."""

    def __init__(self, weight: torch.Tensor, modulus: int) -> None:
        super().__init__()
        self.table = nn.Embedding.from_pretrained(weight.float().clone(), freeze=True)
        self.modulus = modulus

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(torch.remainder(ids, self.modulus) if self.modulus > 0 else ids)


class QuotientRemainder(nn.Module):
    """A `qr` feature (model/compositional.py): Q[id // c] combined with R[id % c]."""

    def __init__(self, quotient: torch.Tensor, remainder: torch.Tensor, collisions: int,
                 operation: str) -> None:
        super().__init__()
        self.quotient = nn.Embedding.from_pretrained(quotient.float().clone(), freeze=True)
        self.remainder = nn.Embedding.from_pretrained(remainder.float().clone(), freeze=True)
        self.collisions = collisions
        self.operation = operation

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.quotient(torch.div(ids, self.collisions, rounding_mode="floor"))
        r = self.remainder(torch.remainder(ids, self.collisions))
        if self.operation == "mult":
            return q * r
        if self.operation == "add":
            return q + r
        return torch.cat([q, r], 1)


class Tower(nn.Module):
    """forward(ids [B, F] int64: the tower's features' dense ids, its own id first) -> [B, E]:
    each feature's vector, concatenated, through the MLP, L2-normalised if it was trained so."""

    cardinalities: torch.Tensor

    def __init__(self, names: List[str], cardinalities: List[int], features: List[nn.Module],
                 mlp: nn.Module, normalized: bool) -> None:
        super().__init__()
        self.names = names
        self.register_buffer("cardinalities", torch.tensor(cardinalities, dtype=torch.int64))
        self.features = nn.ModuleList(features)
        self.mlp = mlp
        self.normalized = normalized

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != len(self.names):
            raise ValueError(f"ids: expected [B, {len(self.names)}] ({', '.join(self.names)}), "
                             f"got {list(ids.shape)}")
        bad = (ids < 0) | (ids >= self.cardinalities)
        if bool(bad.any()):
            where = torch.nonzero(bad)[0]
            f = int(where[1])
            raise ValueError(f"ids: {int(ids[where[0], f])} is out of range for feature "
                             f"{self.names[f]}, whose ids are 0..{int(self.cardinalities[f]) - 1}")
        pieces: List[torch.Tensor] = []
        for f, feature in enumerate(self.features):
            pieces.append(feature(ids[:, f]))
        out = self.mlp(torch.cat(pieces, 1))
        return normalize(out, dim=1) if self.normalized else out


def history_counts(history: torch.Tensor, length: int, items: int) -> torch.Tensor:
    """[B] each row's item count of a served history ([B, length] dense item ids, oldest first,
    -1 past its end), or a one-line ValueError naming what is wrong with it."""
    if history.dim() != 2 or history.shape[1] != length:
        raise ValueError(f"history: expected [B, {length}] item ids (-1 past a "
                         f"history's end), got {list(history.shape)}")
    if bool(((history < -1) | (history >= items)).any()):
        raise ValueError(f"history: item ids are 0..{items - 1}, or -1 past the end")
    used = history >= 0
    counts = used.sum(1)
    slots = torch.arange(length, device=history.device)
    if bool((used != (slots[None, :] < counts[:, None])).any()):
        raise ValueError("history: each row's items come first, then -1 to its end")
    return counts


class HistoryTower(nn.Module):
    """forward(history [B, L] int64: each user's last L items' dense ids, oldest first, then -1
    past the history's end) -> [B, E]: the item table's vectors of the history through the
    trained history encoder (model/history_encoder.py) and the user MLP."""

    def __init__(self, table: torch.Tensor, encoder: nn.Module, mlp: nn.Module,
                 normalized: bool) -> None:
        super().__init__()
        self.table = nn.Embedding.from_pretrained(table.float().clone(), freeze=True)
        self.encoder = encoder
        self.mlp = mlp
        self.normalized = normalized
        self.length = int(encoder.length)

    def forward(self, history: torch.Tensor) -> torch.Tensor:
        counts = history_counts(history, self.length, self.table.weight.shape[0])
        vectors = self.table(history.clamp(min=0))
        out = self.mlp(self.encoder(vectors, counts))
        return normalize(out, dim=1) if self.normalized else out


class SequenceTower(nn.Module):
    """The sequence model's user tower: forward(history [B, L] int64 as HistoryTower's, times
    [B, L] float64 seconds of those items (any origin) or None) -> [B, D]: HSTU (model/hstu.py)
    over the item table's vectors of the history, its output at the last item. Without times,
    a model trained with them reads every gap as 0 s. An empty history has no output: refused."""

    def __init__(self, table: torch.Tensor, hstu: nn.Module, reads_times: bool) -> None:
        super().__init__()
        self.table = nn.Embedding.from_pretrained(table.float().clone(), freeze=True)
        self.hstu = hstu
        self.length = int(hstu.length)
        self.reads_times = reads_times

    def forward(self, history: torch.Tensor, times: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        counts = history_counts(history, self.length, self.table.weight.shape[0])
        if bool((counts == 0).any()):
            raise ValueError("history: a row has no items; the sequence model (hstu) needs at "
                             "least one item the user engaged with")
        if times is not None and times.shape != history.shape:
            raise ValueError(f"times: expected {list(history.shape)} like history, got "
                             f"{list(times.shape)}")
        gaps: Optional[torch.Tensor] = None
        if self.reads_times:
            gaps = (times.double() if times is not None
                    else torch.zeros(history.shape, dtype=torch.float64))
        return last_positions(self.hstu(self.table(history.clamp(min=0)), counts, gaps), counts)


def sequence_towers(model: HSTURetrieval, weights: Dict[str, torch.Tensor], reads_times: bool
                    ) -> Tuple[SequenceTower, np.ndarray]:
    """The sequence model's user tower and the corpus vectors: the item table's rows,
    L2-normalised as training scores them."""
    (part,) = [lookup for lookup in model.lookups if lookup.feature == ITEM_ID][0].parts
    table = weights[f"{TABLE_PREFIX}{part.table}.weight"].float()
    user = SequenceTower(table, model.hstu.eval(), reads_times)
    vectors = normalize(table, dim=1, eps=EPS).numpy().astype(np.float32)
    return user.eval().requires_grad_(False), vectors


def history_tower(model: TwoTower, weights: Dict[str, torch.Tensor]) -> HistoryTower:
    """A history user tower of `model` (its encoder and MLP loaded) over the item table."""
    (part,) = [lookup for lookup in model.lookups if lookup.feature == ITEM_ID][0].parts
    return HistoryTower(weights[f"{TABLE_PREFIX}{part.table}.weight"], model.history.eval(),
                        model.user_mlp.eval(), model.normalize["user"]
                        ).eval().requires_grad_(False)


def tower(model: TwoTower, side: str, weights: Dict[str, torch.Tensor]) -> Tower:
    """`side`'s tower of `model` (its MLP loaded: load_dense_weights) with the checkpoint's
    tables, as plain modules."""
    lookups = [lookup for lookup in model.lookups if lookup.feature.startswith(f"{side}_")]
    mlp = model.user_mlp if side == "user" else model.item_mlp
    return Tower([lookup.feature for lookup in lookups], [lookup.rows for lookup in lookups],
                 [_feature(lookup, weights) for lookup in lookups], mlp.eval(),
                 model.normalize[side]).eval().requires_grad_(False)


def _feature(lookup: FeatureLookup, weights: Dict[str, torch.Tensor]) -> nn.Module:
    tables = [weights[f"{TABLE_PREFIX}{part.table}.weight"] for part in lookup.parts]
    if lookup.technique == "qr":
        return QuotientRemainder(tables[0], tables[1], lookup.modulus, lookup.operation)
    return Table(tables[0], lookup.modulus if lookup.technique == "hash" else 0)


@torch.no_grad()
def corpus_vectors(item_tower: Tower, item_side: np.ndarray) -> np.ndarray:
    """[items, E] float32: the item tower over every item (its side features by item id)."""
    items = len(item_side)
    out = []
    for first in range(0, items, CORPUS_CHUNK):
        ids = np.arange(first, min(items, first + CORPUS_CHUNK))
        out.append(item_tower(torch.from_numpy(
            np.column_stack([ids, item_side[ids]]).astype(np.int64))).numpy())
    return np.concatenate(out).astype(np.float32)


def export_retrieval(checkpoint: str, out: str, params: IndexParams = IndexParams(),
                     overrides: Sequence[str] = ()) -> dict:
    """Write the folder `out` (which must not exist) for `checkpoint`; returns its
    description. `overrides` change the checkpoint's config (e.g. data.path)."""
    path, target = Path(checkpoint), Path(out)
    if target.exists():
        raise UserError(f"--out: {out} already exists; export --retrieval writes a new folder")
    if not target.parent.is_dir():
        raise UserError(f"--out: folder {target.parent} does not exist; create it first")
    cfg, spec, weights = read_checkpoint(path, overrides, retrieval=True)
    dataset = open_dataset(cfg.data, cfg.model)
    params = params.resolved(dataset.items)
    sequence = cfg.model.kind == "hstu"
    model = build_hstu(cfg, spec) if sequence else build_two_tower(cfg, spec)
    del model.loss  # and its state (e.g. logQ's item frequencies): training's, not served
    load_dense_weights(model, {k: v for k, v in weights.items() if not k.startswith("loss.")})
    histories = dataset.histories
    # the users' timelines, for any tower: what `recommend --user` reads as the latest items
    timelines = (histories if histories is not None or dataset.train_position is None
                 else dataset.histories_of(1))
    if sequence:
        user_tower, vectors = sequence_towers(model, weights, dataset.meta.history_times)
        normalized = {side: True for side in SIDES}
    else:
        user_tower = (tower(model, "user", weights) if histories is None
                      else history_tower(model, weights))
        vectors = corpus_vectors(tower(model, "item", weights), np.asarray(dataset.item_side))
        normalized = {side: bool(model.normalize[side]) for side in SIDES}
    seen_indptr, seen_items = dataset.engaged(("train",))
    raw = [name for name in (USERS, ITEMS) if dataset.root and (Path(dataset.root) / name).is_file()]
    description = {
        "format": FORMAT,
        "load": f"user = torch.jit.load('user_tower.pt')({'ids [B, F]' if histories is None else 'history [B, L]'} "
                "int64) -> [B, E]; items = numpy.load('item_vectors.npy'); "
                "index = faiss.read_index('index.faiss')",
        "score": "inner product of user and item vectors (the training logit times "
                 f"model.temperature = {cfg.model.temperature})",
        "users": int(dataset.users), "items": int(dataset.items), "dim": int(vectors.shape[1]),
        "normalized": normalized,
        "user_features": ([] if histories is not None else
                          [{"name": name, "cardinality": int(rows)}
                           for name, rows in zip(user_tower.names, user_tower.cardinalities)]),
        "user_history": (None if histories is None else
                         {"encoder": "hstu" if sequence else cfg.model.user_tower.encoder,
                          "length": histories.length, "times": dataset.meta.history_times,
                          "input": "[B, length] dense item ids, oldest first, -1 past the end"}),
        "index": params.stated(),
        "seen": "each user's training engagements (of a first stage's dataset: its users' "
                "engagements, not the labels)",
        "raw_ids": bool(raw),
        "source": {"checkpoint": str(path.resolve()), "step": read_meta(path)["step"],
                   # the folder read, whole: a relative path would be read from elsewhere
                   "data": str(Path(cfg.data.path).resolve()) if cfg.data.path else "planted",
                   "split_rule": dataset.meta.split_rule,
                   "positive": dataset.meta.positive},
        "versions": {"dlrm_hybrid": __version__, "torch": str(torch.__version__)},
    }
    partial = start_partial(target, "export --retrieval")
    try:
        jit_save(jit_script(user_tower), str(partial / USER_TOWER))
        np.save(partial / ITEM_VECTORS, vectors)
        np.save(partial / USER_SIDE, np.asarray(dataset.user_side, np.int64))
        np.save(partial / SEEN_INDPTR, seen_indptr.astype(np.int64))
        np.save(partial / SEEN_ITEMS, seen_items.astype(np.int64))
        if timelines is not None:
            np.save(partial / HISTORY_INDPTR, timelines.indptr)
            np.save(partial / HISTORY_ITEMS, timelines.items)
        if dataset.meta.history_times:
            np.save(partial / HISTORY_TIMES, timelines.timeline_times("val"))
        write_index(build_index(vectors, params), str(partial / INDEX_FILE))
        for name in raw:
            shutil.copyfile(Path(dataset.root) / name, partial / name)
        (partial / DESCRIPTION).write_text(yaml.safe_dump(description, sort_keys=False))
        finish_partial(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return description
