"""What an interaction-log dataset folder is (interaction_data.py reads its arrays):
interactions.yaml's fields, and the features each tower reads. Plain Python and numpy-free
for `plan`, which must not import torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

import yaml

from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.errors import DataError

FORMAT = "dlrm_hybrid interactions 1"
META_FILE = "interactions.yaml"
SPLITS = ("train", "val", "test")
USER_ID, ITEM_ID = "user_id", "item_id"
HISTORY = "user_history"  # a history user tower's features: user_history0 .. user_history<L-1>
# a ranking dataset's history actions (made with --history): user_action0 .. user_action<L-1>,
# 0 for an empty slot, else 1 + the bits of the engagement's labels
ACTION = "user_action"


def history_keys(length: int) -> List[str]:
    """The features of a history of `length` slots: slot j holds the j-th item of the user's
    last `length` items, oldest first (an empty bag past the history's end)."""
    return [f"{HISTORY}{j}" for j in range(length)]


def history_length(model_cfg) -> int:
    """How many items the user tower reads: 0 for one of ids (model.user_tower.encoder); the
    sequence model (model.kind hstu), `model.hstu.max_length`."""
    if model_cfg.kind == "hstu":
        return model_cfg.hstu.max_length
    user = model_cfg.user_tower
    return 0 if user.encoder == "ids" else user.history_length


@dataclass
class InteractionMeta:
    """interactions.yaml: what a reader needs before opening any array."""

    users: int
    items: int
    user_side: Dict[str, int] = field(default_factory=dict)  # side feature -> cardinality
    item_side: Dict[str, int] = field(default_factory=dict)
    samples: Dict[str, int] = field(default_factory=dict)  # split -> engagements
    split_rule: str = ""  # e.g. "leave-last-out by timestamp", "time cut at 889000000"
    positive: str = ""  # e.g. "rating >= 4"
    source: List[str] = field(default_factory=list)  # the log files it was made from
    extra: Dict[str, object] = field(default_factory=dict)  # counts of skips, thresholds, ...
    history: int = 0  # > 0: the user tower reads this many history slots, not the user's ids
    timestamps: bool = False  # <split>_time.npy hold each engagement's time (the log had them)
    history_times: bool = False  # the model reads its history slots' times (hstu's time bias)

    def spec(self) -> DataSpec:
        """The model's view: user tower features first, then the item tower's. A history
        tower's features are its slots (item ids), looked up in the item table."""
        user = ([(name, self.items) for name in history_keys(self.history)] if self.history
                else [(USER_ID, self.users), *[(f"user_{n}", c) for n, c in self.user_side.items()]])
        names = (*[name for name, _ in user], ITEM_ID, *[f"item_{n}" for n in self.item_side])
        cards = [*[c for _, c in user], self.items, *self.item_side.values()]
        dense = self.history if self.history_times else 0  # each slot's time, as dense values
        return DataSpec(dense, cards, [1] * len(cards), names=names)

    def to_yaml(self) -> dict:
        return {"format": FORMAT, "users": self.users, "items": self.items,
                "user_side": dict(self.user_side), "item_side": dict(self.item_side),
                "samples": dict(self.samples), "split_rule": self.split_rule,
                "positive": self.positive, "source": list(self.source), "extra": dict(self.extra),
                "timestamps": self.timestamps}

    @staticmethod
    def from_yaml(raw: dict, where: str) -> "InteractionMeta":
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DataError(f"{where}: not an interactions dataset ({FORMAT!r} expected in its "
                            f"format field); make it with `dlrm_hybrid preprocess interactions`")
        try:
            return InteractionMeta(int(raw["users"]), int(raw["items"]),
                                   dict(raw.get("user_side") or {}), dict(raw.get("item_side") or {}),
                                   dict(raw.get("samples") or {}), str(raw.get("split_rule", "")),
                                   str(raw.get("positive", "")), list(raw.get("source") or []),
                                   dict(raw.get("extra") or {}),
                                   timestamps=bool(raw.get("timestamps", False)))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{where}: field {e} missing or malformed; preprocess the log again")


def tower_features(meta: InteractionMeta, model_cfg) -> InteractionMeta:
    """`meta` with only the features `model.user_tower.features` / `item_tower.features` name
    (empty: all of that side's); the id feature stays in as the tower's own id. A history user
    tower (model.user_tower.encoder) reads its history slots instead of the user's features."""
    kept = {}
    for side, sides in (("user", meta.user_side), ("item", meta.item_side)):
        wanted = getattr(model_cfg, f"{side}_tower").features
        offered = [f"{side}_id", *[f"{side}_{n}" for n in sides]]
        unknown = [w for w in wanted if w not in offered]
        if unknown:
            raise DataError(f"model.{side}_tower.features: {', '.join(unknown)} not in the "
                            f"dataset, whose {side} features are {', '.join(offered)}")
        kept[side] = {n: c for n, c in sides.items() if not wanted or f"{side}_{n}" in wanted}
    history = history_length(model_cfg)
    if model_cfg.kind == "hstu":  # the sequence model reads item ids only
        kept["item"] = {}
    return InteractionMeta(meta.users, meta.items, {} if history else kept["user"], kept["item"],
                           dict(meta.samples), meta.split_rule, meta.positive, list(meta.source),
                           dict(meta.extra), history, meta.timestamps,
                           history_times=(model_cfg.kind == "hstu" and meta.timestamps
                                          and model_cfg.hstu.time_buckets > 0))


def is_interaction_folder(path: str) -> bool:
    return bool(path) and (Path(path) / META_FILE).is_file()


def read_meta(path: str) -> InteractionMeta:
    where = str(Path(path) / META_FILE)
    try:
        raw = yaml.safe_load(Path(where).read_text())
    except OSError as e:
        raise DataError(f"{where}: cannot read ({e.strerror}); check data.path")
    except yaml.YAMLError as e:
        raise DataError(f"{where}: not valid YAML ({str(e).splitlines()[0]}); preprocess again")
    return InteractionMeta.from_yaml(raw, where)


USER_SEGMENTS, ITEM_CATEGORIES = 16, 32  # the planted log's side features (planted_interactions.py)


def planted_meta(data_cfg) -> InteractionMeta:
    """The planted log's shape, from the config alone."""
    return InteractionMeta(data_cfg.users, data_cfg.items, {"segment": USER_SEGMENTS},
                           {"category": ITEM_CATEGORIES}, split_rule="leave-last-out (draw order)",
                           positive="planted engagement", source=["planted"])
