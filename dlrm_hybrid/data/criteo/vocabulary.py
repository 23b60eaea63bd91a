"""The value -> id dictionaries of a Criteo dataset, kept with it so that a new day maps to the
same ids and raw rows can be scored.

Format: `<dataset>/vocabulary/cat_<i>.bin` per categorical feature, raw little-endian uint32,
the kept values (each 8-hex-digit value as an integer) in id order: entry k is the value of id
k + 1; id 0 (missing, rare, beyond the table size) has none, so a file holds cardinality - 1
entries. feature_spec.yaml's `metadata.vocabulary` names the folder, relative to the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.errors import DataError

KEY = FOLDER = "vocabulary"  # feature_spec.yaml's metadata key, and the folder it names
DTYPE = np.dtype("<u4")


def file_name(feature: int) -> str:
    return f"cat_{feature}.bin"


@dataclass
class Vocabulary:
    values: List[np.ndarray]  # per categorical feature, uint32 kept values in id order
    _tables: Optional[List[Tuple[np.ndarray, np.ndarray]]] = field(
        default=None, init=False, repr=False, compare=False)

    @property
    def cardinalities(self) -> List[int]:
        """Rows of each feature's table: its values and id 0."""
        return [1 + len(v) for v in self.values]

    @staticmethod
    def load(dataset: str) -> "Vocabulary":
        """The vocabulary of `dataset`, checked against its feature_spec.yaml."""
        root = Path(dataset)
        if not (root / "feature_spec.yaml").is_file():
            raise DataError(f"{dataset}: not a dataset (no feature_spec.yaml); give the folder "
                            f"`preprocess criteo` wrote")
        fspec = load_feature_spec(str(root))
        if KEY not in fspec.notes:
            raise DataError(f"{dataset}: has no vocabulary (feature_spec.yaml's metadata names "
                            f"none): it was written by `preprocess npy`, `synth` or an older "
                            f"`preprocess criteo`; preprocess the raw Criteo files again")
        folder = root / str(fspec.notes[KEY])
        values = []
        for i, cardinality in enumerate(fspec.spec.cardinalities):
            values.append(_read_values(folder / file_name(i), cardinality))
        vocabulary = Vocabulary(values)
        for i, (keys, _) in enumerate(vocabulary.lookup_tables()):
            twice = keys[1:][keys[1:] == keys[:-1]]
            if len(twice):
                raise DataError(f"{folder / file_name(i)}: value {twice[0]:08x} is listed twice; "
                                f"the vocabulary is corrupt: preprocess the raw files again")
        return vocabulary

    def save(self, folder: str) -> int:
        """Write the vocabulary into dataset folder `folder`; returns the bytes written. The
        caller records `metadata.vocabulary` (KEY: FOLDER) in the dataset's feature_spec.yaml."""
        out = Path(folder) / FOLDER
        out.mkdir(parents=True, exist_ok=True)
        for i, values in enumerate(self.values):
            values.astype(DTYPE).tofile(out / file_name(i))
        return sum(DTYPE.itemsize * len(v) for v in self.values)

    def lookup_tables(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Per feature, its values sorted (for searchsorted) and their ids (uint32); sorted once."""
        if self._tables is None:
            orders = [np.argsort(v, kind="stable") for v in self.values]
            self._tables = [(v[order], (order + 1).astype(np.uint32))
                            for v, order in zip(self.values, orders)]
        return self._tables

    def map(self, cats: np.ndarray) -> np.ndarray:
        """Ids of raw values `cats` (int64 [n, features]: 8-hex-digit values, -1 where missing)
        as uint32 [n, features]: 0 for missing values and values the vocabulary does not hold."""
        ids = np.zeros(cats.shape, np.uint32)
        for f, (keys, key_ids) in enumerate(self.lookup_tables()):
            if not len(keys):
                continue
            column = cats[:, f]
            needles = column.astype(DTYPE)  # -1 becomes ffffffff, a value: masked below
            at = np.minimum(np.searchsorted(keys, needles), len(keys) - 1)
            ids[:, f] = np.where((keys[at] == needles) & (column >= 0), key_ids[at], 0)
        return ids


def _read_values(path: Path, cardinality: int) -> np.ndarray:
    """One feature's file, whose size must match its cardinality in feature_spec.yaml."""
    if not path.is_file():
        raise DataError(f"{path}: missing; the dataset's vocabulary is incomplete: preprocess the "
                        f"raw Criteo files again")
    size = path.stat().st_size
    if size % DTYPE.itemsize or size // DTYPE.itemsize != cardinality - 1:
        raise DataError(f"{path}: {size:,} bytes, expected {DTYPE.itemsize} x {cardinality - 1:,} "
                        f"(feature_spec.yaml gives {path.stem} {cardinality:,} ids, id 0 having "
                        f"no value); the vocabulary does not belong to this dataset: preprocess "
                        f"the raw Criteo files again")
    return np.fromfile(path, DTYPE)
