"""`feature_spec.yaml`: NVIDIA DLRM's description of a split-binary dataset, read and written.

Layout (NVIDIA-compatible): `feature_spec` (feature -> dtype, cardinality), `source_spec`
(split -> chunks of type/features/files, paths relative to the yaml), `channel_spec`
(categorical, numerical, label -> feature names). Two extensions, both optional, so NVIDIA's
datasets load unchanged: a categorical feature may carry `hotness: h` (h ids per sample, stored
row-major), and a split named `validation` besides `train` and `test`. `metadata.true_prob`
may map a split to a file of float32 true click probabilities (planted synthetic data); other
`metadata` keys (e.g. `day_23`, how day 23 was split) are kept as `notes`.

Labels: `channel_spec.label` lists one feature (NVIDIA's `label`, read as the one task `click`)
or several, each a task of that name with its own file per split (`label_<name>.bin`). A label
is `bool`, or `int8` with `missing: -1` when some samples lack it (1, 0, -1 = missing). With
several labels, the true probabilities are [N, T] per split, their columns the labels named by
`metadata.true_prob_labels`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import yaml

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.errors import DataError
from dlrm_hybrid.data.spec import DataSpec

SPLITS = ("train", "validation", "test")
LABEL, NUMERICAL_FILE, LABEL_FILE = "label", "numerical.bin", "label.bin"
SINGLE_TASK = "click"  # the task a one-label dataset's label is
MISSING = -1  # the int8 value of a missing label
LABEL_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def categorical_dtype(cardinality: int) -> np.dtype:
    """The smallest of int8/int16/int32 that holds ids below `cardinality` (NVIDIA's rule)."""
    for dtype in (np.int8, np.int16, np.int32):
        if cardinality < np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


@dataclass
class SplitFiles:
    labels: List[Path]  # one per label, in channel order (all one byte per sample)
    numerical: Path
    categorical: List[Path]  # in channel order

    @property
    def label(self) -> Path:
        """The first label's file: its size is the split's sample count."""
        return self.labels[0]


@dataclass
class Label:
    """One label column: its feature name, and the int8 value marking it missing (None: it is
    never missing, stored bool)."""
    feature: str
    missing: Optional[int] = None


def label_files(labels: Sequence[str]) -> List[str]:
    """NVIDIA's `label.bin` for one label; `label_<name>.bin` each for several."""
    return [LABEL_FILE] if len(labels) == 1 else [f"label_{name}.bin" for name in labels]


def check_label_names(labels: Sequence[str], where: str) -> None:
    """Several labels become task names, metric keys and file names: words, unique."""
    bad = [n for n in labels if not LABEL_NAME.fullmatch(n) or n.startswith(("cat_", "num_"))]
    if bad or not labels:
        raise ConfigError(f"{where}: {bad[0] if bad else ''!r} is not a label name; use letters, "
                          f"digits and _ (starting with a letter, not cat_/num_), e.g. watched")
    twice = [n for n in labels if list(labels).count(n) > 1]
    if twice:
        raise ConfigError(f"{where}: the label {twice[0]} is named twice; give each label once")


@dataclass
class FeatureSpec:
    root: Path
    spec: DataSpec
    categorical_dtypes: List[np.dtype]
    splits: Dict[str, SplitFiles]
    true_prob: Dict[str, Path]
    notes: Dict[str, Any] = field(default_factory=dict)  # metadata besides true_prob
    labels: List[Label] = field(default_factory=lambda: [Label(LABEL)])
    true_prob_labels: Tuple[str, ...] = ()  # the true_prob files' columns; empty: label_names

    @property
    def label_names(self) -> Tuple[str, ...]:
        """The tasks the labels are: `click` for a one-label dataset, else the labels' names."""
        return (SINGLE_TASK,) if len(self.labels) == 1 else tuple(l.feature for l in self.labels)

    @staticmethod
    def default(root: Path, spec: DataSpec, splits=SPLITS,
                labels: Sequence[str] = (LABEL,)) -> "FeatureSpec":
        """The layout the writers produce; `labels`: one name (written as NVIDIA's `label`) or
        several."""
        labels = [LABEL] if len(labels) == 1 else list(labels)
        names = [f"cat_{i}.bin" for i in range(len(spec.cardinalities))]
        files = {s: SplitFiles([root / s / f for f in label_files(labels)],
                               root / s / NUMERICAL_FILE, [root / s / n for n in names])
                 for s in splits}
        return FeatureSpec(root, spec, [categorical_dtype(c) for c in spec.cardinalities], files,
                           {}, labels=[Label(n) for n in labels])

    def to_yaml(self) -> dict:
        spec = self.spec
        cats = [f.name for f in next(iter(self.splits.values())).categorical]
        nums = [f"num_{i}" for i in range(spec.num_dense)]
        features = {}
        for name, rows, hot, dtype in zip(cats, spec.cardinalities, spec.hotness,
                                          self.categorical_dtypes):
            features[name] = {"dtype": dtype.name, "cardinality": int(rows)}
            if hot != 1:
                features[name]["hotness"] = int(hot)
        features.update({n: {"dtype": "float16"} for n in nums})
        for label in self.labels:
            features[label.feature] = ({"dtype": "bool"} if label.missing is None else
                                       {"dtype": "int8", "missing": label.missing})
        labels = [label.feature for label in self.labels]
        rel = lambda p: str(p.relative_to(self.root))  # noqa: E731
        sources = {}
        for split, f in self.splits.items():
            sources[split] = [{"type": "split_binary", "features": nums, "files": [rel(f.numerical)]}]
            sources[split] += [{"type": "split_binary", "features": [n], "files": [rel(p)]}
                               for n, p in zip(labels, f.labels)]
            sources[split] += [{"type": "split_binary", "features": [c], "files": [rel(p)]}
                               for c, p in zip(cats, f.categorical)]
        metadata = {"true_prob": {s: rel(p) for s, p in self.true_prob.items()}} if self.true_prob else {}
        if self.true_prob and self.true_prob_labels:
            metadata["true_prob_labels"] = list(self.true_prob_labels)
        metadata.update(self.notes)
        return {"feature_spec": features, "source_spec": sources,
                "channel_spec": {"categorical": cats, "numerical": nums, "label": labels},
                "metadata": metadata}

    def save(self) -> None:
        """Written beside and renamed over the old file: a reader sees the old or the new."""
        tmp = self.root / ".feature_spec.yaml.tmp"
        tmp.write_text(yaml.safe_dump(self.to_yaml(), sort_keys=False))
        tmp.replace(self.root / "feature_spec.yaml")


def load_feature_spec(root: str, key: str = "data.path") -> FeatureSpec:
    """Read DIR/feature_spec.yaml; any inconsistency is a ConfigError naming the file and field
    (`key`: the setting or flag that named DIR)."""
    path = Path(root) / "feature_spec.yaml"
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path} ({e.strerror}); point {key} at a "
                          f"dataset directory (preprocess writes one)")
    except yaml.YAMLError as e:
        raise DataError(f"{path}: not valid YAML ({str(e).splitlines()[0]})")
    try:
        return _parse(Path(root), path, raw)
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise DataError(f"{path}: malformed ({type(e).__name__}: {e}); compare with the layout "
                          f"in docs/real-data.md")


def _parse(root: Path, path: Path, raw: dict) -> FeatureSpec:
    channels, features = raw["channel_spec"], raw["feature_spec"]
    cats, nums = channels["categorical"], channels["numerical"]
    labels = [_label(features, name) for name in channels["label"]]
    if not labels:
        raise ValueError("channel_spec.label lists no label")
    cardinalities = [int(features[c]["cardinality"]) for c in cats]
    hotness = [int(features[c].get("hotness", 1)) for c in cats]
    dtypes = [np.dtype(features[c]["dtype"]) for c in cats]
    splits = {}
    for split, chunks in raw["source_spec"].items():
        files: Dict[str, Path] = {}
        numerical: Optional[Path] = None
        for chunk in chunks:
            if chunk.get("type") != "split_binary" or len(chunk["files"]) != 1:
                raise ValueError(f"source_spec.{split}: only single-file split_binary chunks are supported")
            file = root / chunk["files"][0]
            if chunk["features"] == nums:
                numerical = file
            elif len(chunk["features"]) == 1:
                files[chunk["features"][0]] = file
            else:
                raise ValueError(f"source_spec.{split}: chunk {chunk['features']} mixes features")
        names = [label.feature for label in labels]
        missing = [f for f in [*names, *cats] if f not in files] + ([] if numerical or not nums else ["numerical"])
        if missing:
            raise ValueError(f"source_spec.{split} has no file for {missing[0]}")
        splits[split] = SplitFiles([files[n] for n in names], numerical, [files[c] for c in cats])
    if "train" not in splits:
        raise ValueError("source_spec has no train split")
    metadata = dict(raw.get("metadata") or {})
    true_prob = {s: root / p for s, p in metadata.pop("true_prob", {}).items()}
    true_prob_labels = tuple(metadata.pop("true_prob_labels", ()))
    # a ranking dataset with a history (`--history L`): the model finds its slots by name
    names = tuple(metadata.get("categorical_features") or ()) if metadata.get("history") else ()
    store = metadata.get("history_store")
    if store:  # the slots are read from the timelines (data/timeline_history.py), not files
        slots = int(metadata["history"]["slots"])
        derived = [int(store["item_rows"])] * slots + [int(store["action_rows"])] * slots
        cardinalities += derived
        hotness += [1] * len(derived)
        dtypes += [categorical_dtype(rows) for rows in derived]
    return FeatureSpec(root, DataSpec(len(nums), cardinalities, hotness, names=names), dtypes,
                       splits, true_prob, metadata, labels, true_prob_labels)


def _label(features: dict, name: str) -> Label:
    """A label feature: bool (NVIDIA's; its dtype may be left out), or int8 with a `missing`
    value."""
    feature = features.get(name) or {}
    dtype = feature.get("dtype", "bool")
    if dtype not in ("bool", "int8"):
        raise ValueError(f"feature_spec.{name}.dtype: {dtype!r}; a label is bool, or int8 with "
                         f"missing: {MISSING}")
    return Label(name, int(feature["missing"]) if dtype == "int8" and "missing" in feature else None)
