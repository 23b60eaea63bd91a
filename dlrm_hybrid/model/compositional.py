"""Compositional embeddings (Shi et al., KDD 2020) and the hashing trick: which tables a feature
is looked up in when `model.compositional` replaces its full table by smaller ones.

- `hash`: one table of m rows (`t_<feature>_h`); id -> id mod m.
- `qr`: a quotient table Q of ceil(n / c) rows (`t_<feature>_q`) and a remainder table R of c
  rows (`t_<feature>_r`); an id's vector is combine(Q[id // c], R[id % c]), integer floor
  division on int64 ids, combine being `mult` (elementwise), `add`, or `concat` (each part half
  the width, so the result keeps `embedding_dim`).

A multi-hot bag's vector is the sum over its ids of that combination. `add` and `concat` are
linear, so pooling each part over the bag gives exactly that. `mult` is not: the sum of
Q_j * R_j is not (sum Q)(sum R), which facebookresearch/dlrm's QREmbeddingBag computes. A
multi-hot `mult` feature of at most h ids is therefore looked up as h one-id slots (slot j holds
each bag's j-th id, or none): its parts pool one vector per slot, which are multiplied and
summed (composed_lookup.py). That costs h pooled vectors per part and sample instead of one,
which the placer counts (TableSpec.bags).

The parts are ordinary tables: the placer balances them and torchrec shards them (table- or
column-wise, on any ranks) like every other. Datasets are unchanged: ids are transformed at lookup.

With `model.interaction: fm`, each feature also has a first-order weight per id: a table
`w_<feature>` looked up with the feature's ids (hashed where the feature is). fbgemm's tables are
at least 4 wide, so it is 4 wide and the weight is its first column; the other three are never
read, so they get no gradient and stay as initialised.

This module is plain Python (no torch), so that `plan` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

from dlrm_hybrid.config import RETRIEVAL_KINDS, ConfigError
from dlrm_hybrid.data.interactions.interaction_meta import ACTION, HISTORY, ITEM_ID
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.model.mixed_dimensions import mixed_widths


@dataclass(frozen=True)
class Part:
    """One embedding table the model really has."""

    table: str
    keys: Tuple[str, ...]  # its lookup keys: one, or one per id slot
    rows: int
    dim: int
    init_bound: float  # initialised U(-init_bound, init_bound)
    # mixed dimensions (mixed_dimensions.py): the width a learned projection brings this
    # table's pooled vectors to; 0: none, they are used as they are
    projected: int = 0


@dataclass(frozen=True)
class FeatureLookup:
    """How one categorical feature is looked up."""

    feature: str
    rows: int  # the feature's cardinality
    hotness: int  # ids per bag, at most
    dim: int  # width of its looked-up vector (model.embedding_dim)
    technique: str  # full | hash | qr
    modulus: int  # hash: buckets m; qr: collisions c; full: 0
    operation: str  # qr: mult | add | concat; otherwise ""
    parts: Tuple[Part, ...]  # the tables its vector comes from
    first_order: Optional[Part] = None  # fm: its first-order weights' table

    @property
    def tables(self) -> Tuple[Part, ...]:
        return self.parts + ((self.first_order,) if self.first_order else ())

    @property
    def slots(self) -> int:
        """Pooled vectors per part and sample: one per id slot for a multi-hot `mult`."""
        return len(self.parts[0].keys)

    @property
    def keys(self) -> List[str]:
        """Its lookup keys, those of the vector's parts first."""
        return [k for p in self.tables for k in p.keys]


def init_bound(rows: int, technique: str, operation: str) -> float:
    """U(-b, b) bound of each part such that a looked-up vector has the variance of the full
    table's initialisation, U(-a, a) with a = 1/sqrt(n) (the original DLRM's), i.e. a^2 / 3 per
    component, n being the feature's cardinality whatever the technique:

    - full, hash, concat (each component comes from one part): b = a.
    - add (the sum of two independent zero-mean parts): b = a / sqrt(2), each part a^2 / 6.
    - mult (the product of two independent zero-mean parts, variance the product of theirs):
      (b^2 / 3)^2 = a^2 / 3, so b = (3 a^2)^(1/4).

    Both parts are zero-mean (facebookresearch/dlrm set only the lower bound, making every weight
    positive, and `add` diverged: its issue 326)."""
    a = rows ** -0.5
    if technique == "qr" and operation == "add":
        return a / math.sqrt(2)
    if technique == "qr" and operation == "mult":
        return (3 * a * a) ** 0.25
    return a


FIRST_ORDER_WIDTH = 4  # fbgemm's narrowest table; the weight is column 0


def feature_lookups(feature_names: Sequence[str], cardinalities: Sequence[int],
                    hotness: Sequence[int], dim: int, rules: Sequence,
                    first_order: bool = False) -> List[FeatureLookup]:
    """Each feature's lookup under `rules` (model.compositional): the first rule naming or
    selecting a feature decides; a rule selected by `rows_above` leaves a table it would not
    shrink full; one naming a feature it would not shrink is a ConfigError. `first_order` adds
    each feature's first-order weight table (fm)."""
    known = set(feature_names)
    for i, rule in enumerate(rules):
        unknown = [f for f in rule.features if f not in known]
        if unknown:
            raise ConfigError(f"model.compositional[{i}].features: {unknown[0]} is not a "
                              f"categorical feature; they are {_names(feature_names)}")
    lookups = []
    for feature, rows, hot in zip(feature_names, cardinalities, hotness):
        index, rule = _rule_for(feature, rows, rules)
        lookup = _lookup(feature, rows, hot, dim, rule)
        if rule is not None and rule.features and lookup.technique != rule.technique:
            raise ConfigError(
                f"model.compositional[{index}]: {rule.technique} would not make {feature}'s "
                f"table of {rows:,} rows smaller; lower "
                f"{'buckets' if rule.technique == 'hash' else 'collisions'} or leave it full")
        if first_order:
            (part,) = lookup.parts  # full or hashed: fm allows no qr
            lookup = replace(lookup, first_order=Part(
                f"w_{feature}", (f"{feature}_w",), part.rows, FIRST_ORDER_WIDTH, part.init_bound))
        lookups.append(lookup)
    return lookups


def _rule_for(feature: str, rows: int, rules: Sequence):
    for index, rule in enumerate(rules):
        if feature in rule.features or (not rule.features and rows > rule.rows_above):
            return index, rule
    return None, None


def _lookup(feature: str, rows: int, hotness: int, dim: int, rule) -> FeatureLookup:
    technique = "full" if rule is None else rule.technique
    if technique == "hash" and rule.buckets < rows:
        part = Part(f"t_{feature}_h", (f"{feature}_h",), rule.buckets, dim,
                    init_bound(rows, "hash", ""))
        return FeatureLookup(feature, rows, hotness, dim, "hash", rule.buckets, "", (part,))
    if technique == "qr" and _qr_weights(rows, rule.collisions, rule.operation, dim) < rows * dim:
        c, op = rule.collisions, rule.operation
        width = dim // 2 if op == "concat" else dim
        slots = hotness if op == "mult" and hotness > 1 else 1
        bound = init_bound(rows, "qr", op)
        parts = (Part(f"t_{feature}_q", _keys(f"{feature}_q", slots), -(-rows // c), width, bound),
                 Part(f"t_{feature}_r", _keys(f"{feature}_r", slots), c, width, bound))
        return FeatureLookup(feature, rows, hotness, dim, "qr", c, op, parts)
    part = Part(f"t_{feature}", (feature,), rows, dim, init_bound(rows, "full", ""))
    return FeatureLookup(feature, rows, hotness, dim, "full", 0, "", (part,))


def _keys(name: str, slots: int) -> Tuple[str, ...]:
    """A part's lookup keys: `name`, or `name0`.. `name<h-1>` for h id slots."""
    return tuple(f"{name}{j}" for j in range(slots)) if slots > 1 else (name,)


def _qr_weights(rows: int, c: int, operation: str, dim: int) -> int:
    """Weights of the two parts (as rows x width), to compare with the full table's."""
    width = dim // 2 if operation == "concat" else dim
    return (-(-rows // c) + c) * width


def _names(names: Sequence[str]) -> str:
    return ", ".join(names) if len(names) <= 8 else f"{names[0]} .. {names[-1]}"


def lookups_of(model_cfg, spec) -> List[FeatureLookup]:
    """The lookups of a config's model over a dataset's features (`spec`: a DataSpec). A
    two-tower model's are its user tower's features then its item tower's, each at its
    tower's embedding width. A history user tower (`model.user_tower.encoder`) has no table of
    its own: its history slots are more keys of the item table (`item_id`'s part), so they are
    looked up, sharded and trained as that table."""
    if model_cfg.kind not in RETRIEVAL_KINDS:
        if model_cfg.sequence != "none":
            return sequence_lookups(model_cfg, spec)
        if any(n.startswith(ACTION) for n in spec.feature_names):
            raise DataError(f"model.sequence: the dataset carries each row's history "
                            f"({HISTORY}0.., {ACTION}0..), which only the sequence feature "
                            f"reads; set model.sequence=hstu, or make the dataset without "
                            f"--history")
        return mixed_widths(feature_lookups(spec.feature_names, spec.cardinalities, spec.hotness,
                                            model_cfg.embedding_dim, model_cfg.compositional,
                                            first_order=model_cfg.interaction == "fm"),
                            model_cfg.mixed_dimensions)
    history = [n for n in spec.feature_names if n.startswith(HISTORY)]
    lookups = []
    for side in ("user", "item"):
        dim = getattr(model_cfg, f"{side}_tower").embedding_dim or model_cfg.embedding_dim
        mine = [i for i, name in enumerate(spec.feature_names)
                if name.startswith(f"{side}_") and name not in history]
        lookups += feature_lookups([spec.feature_names[i] for i in mine],
                                   [spec.cardinalities[i] for i in mine],
                                   [spec.hotness[i] for i in mine], dim, model_cfg.compositional)
    return [_with_history(lookup, history) if lookup.feature == ITEM_ID else lookup
            for lookup in lookups] if history else lookups


def sequence_lookups(model_cfg, spec) -> List[FeatureLookup]:
    """A ranker with a sequence feature (model.sequence): one lookup per feature but the
    history's, whose item slots are more keys of the item table and whose action slots are
    the keys of one action table (the last lookup)."""
    names = spec.feature_names
    history = [n for n in names if n.startswith(HISTORY)]
    actions = [n for n in names if n.startswith(ACTION)]
    if not history or len(actions) != len(history) or ITEM_ID not in names:
        raise DataError(f"model.sequence: the dataset has no history with actions (features "
                        f"{HISTORY}0.., {ACTION}0.. and {ITEM_ID}); make it with `preprocess "
                        f"interactions --labels ... --history L`, or set model.sequence=none")
    own = [i for i, n in enumerate(names) if n not in history and n not in actions]
    lookups = feature_lookups([names[i] for i in own], [spec.cardinalities[i] for i in own],
                              [spec.hotness[i] for i in own], model_cfg.embedding_dim, [])
    rows = spec.cardinalities[names.index(actions[0])]
    dim = model_cfg.embedding_dim
    part = Part(f"t_{ACTION}", tuple(actions), rows, dim, init_bound(rows, "full", ""))
    return [_with_history(lookup, history) if lookup.feature == ITEM_ID else lookup
            for lookup in lookups] + [FeatureLookup(ACTION, rows, 1, dim, "full", 0, "",
                                                    (part,))]


def _with_history(item: FeatureLookup, history: List[str]) -> FeatureLookup:
    """The item id's lookup, its table also looked up by the history slots."""
    if item.technique != "full":
        raise ConfigError(f"model.compositional: a history user tower reads the item table "
                          f"whole; leave {ITEM_ID} out of the rules (it is {item.technique} here)")
    (part,) = item.parts
    return replace(item, parts=(replace(part, keys=(*part.keys, *history)),))


def describe(lookup: FeatureLookup) -> Optional[str]:
    """'cat_0 (40,000,000 rows): qr mult c=4 -> t_cat_0_q 10,000,000x128 + t_cat_0_r 4x128',
    a mixed-dimension part as 't_cat_0 40,000,000x8->128', or None for a full table at its
    width."""
    if lookup.technique == "full" and not lookup.parts[0].projected:
        return None
    how = (f"hash m={lookup.modulus:,}" if lookup.technique == "hash"
           else f"qr {lookup.operation} c={lookup.modulus:,}" if lookup.technique == "qr"
           else "mixed dimension")
    slots = f", {lookup.slots} id slots" if lookup.slots > 1 else ""
    parts = " + ".join(f"{p.table} {p.rows:,}x{p.dim}{f'->{p.projected}' if p.projected else ''}"
                       for p in lookup.parts)
    return f"{lookup.feature} ({lookup.rows:,} rows): {how} -> {parts}{slots}"
