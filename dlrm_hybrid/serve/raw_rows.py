"""Raw Criteo TSV rows to score (`predict --raw-criteo DATASET`): `label \\t I1..I13 \\t C1..C26`
lines, or the same without the label (39 fields; the first line decides), plain or .gz. They are
parsed by `preprocess criteo`'s own parser and mapped to ids by DATASET's vocabulary, so a row
scores as it would once preprocessed into that dataset (a byte-order mark dropped, as there).
Every line but a blank one is a row: a malformed line is an error naming it, never skipped. Read
in chunks of lines, in bounded memory."""

from __future__ import annotations

import gzip
from itertools import islice
from pathlib import Path
from typing import BinaryIO, Iterator, List, Optional

import numpy as np

from dlrm_hybrid.data.criteo.parse import (BLANK_LINE, KINDS, NUM_CATEGORICAL, NUM_FIELDS,
                                           NUM_NUMERICAL, REASONS, WRONG_FIELD_COUNT,
                                           parse_lines)
from dlrm_hybrid.data.criteo.tasks import BOM
from dlrm_hybrid.data.criteo.vocabulary import Vocabulary
from dlrm_hybrid.data.text_rows import ScoringRows
from dlrm_hybrid.errors import DataError

UNLABELLED_REASON = f"not {NUM_FIELDS - 1} tab-separated fields (I1..I13, C1..C26) as line 1"


def raw_criteo_chunks(path: Path, dataset: str, num_dense: int, features: List[dict],
                      rows_per_chunk: int) -> Iterator[ScoringRows]:
    """Rows of the raw Criteo file `path` with `dataset`'s ids, for a model of `num_dense` dense
    values and tables `features` (the export description's), which must be the dataset's."""
    if num_dense != NUM_NUMERICAL or len(features) != NUM_CATEGORICAL:
        raise DataError(f"--raw-criteo: the model takes {num_dense} dense values and "
                        f"{len(features)} categorical features, raw Criteo rows have "
                        f"{NUM_NUMERICAL} and {NUM_CATEGORICAL}; score them with a model trained "
                        f"on a Criteo dataset")
    vocabulary = Vocabulary.load(dataset)
    for i, (rows, feature) in enumerate(zip(vocabulary.cardinalities, features)):
        if rows != feature["cardinality"]:
            raise DataError(f"--raw-criteo: {dataset}'s vocabulary gives cat_{i} {rows:,} ids, "
                            f"the model's table for {feature['name']} has "
                            f"{feature['cardinality']:,}; give the dataset the model was "
                            f"trained on")
    return _chunks(path, vocabulary, rows_per_chunk)


def _chunks(path: Path, vocabulary: Vocabulary, rows_per_chunk: int) -> Iterator[ScoringRows]:
    labelled = None  # decided by the first line that is not blank
    first_line = 1
    with _open(path) as stream:
        while True:
            lines = _read(path, stream, rows_per_chunk)
            if not lines:
                return
            if first_line == 1:  # a byte-order mark, as `preprocess criteo` reads it: dropped
                lines[0] = lines[0].removeprefix(BOM)
            if labelled is None:
                labelled = _labelled(path, lines, first_line)
            if labelled is not None:
                rows = _parse(path, lines, first_line, labelled, vocabulary)
                if len(rows.dense):
                    yield rows
            first_line += len(lines)


def _open(path: Path) -> BinaryIO:
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except OSError as e:
        raise DataError(f"--data: cannot read {path} ({e.strerror})") from None


def _read(path: Path, stream: BinaryIO, count: int) -> List[bytes]:
    try:
        return list(islice(stream, count))
    except (OSError, EOFError) as e:  # not gzip, or a truncated .gz
        raise DataError(f"{path}: not readable ({e}); give a Criteo TSV file, plain or .gz"
                        ) from None


def _labelled(path: Path, lines: List[bytes], first_line: int) -> Optional[bool]:
    """Whether rows start with a label, from the first line that is not blank (None: all are)."""
    for offset, line in enumerate(lines):
        if line.strip(b"\r\n"):
            fields = line.count(b"\t") + 1
            if fields not in (NUM_FIELDS, NUM_FIELDS - 1):
                raise DataError(f"{path}:{first_line + offset}: {fields} tab-separated fields; "
                                f"raw Criteo rows have {NUM_FIELDS} (label, I1..I13, C1..C26) "
                                f"or {NUM_FIELDS - 1} (no label)")
            return fields == NUM_FIELDS
    return None


def _parse(path: Path, lines: List[bytes], first_line: int, labelled: bool,
           vocabulary: Vocabulary) -> ScoringRows:
    """One chunk of lines as rows; a malformed line is an error naming it."""
    if not lines[-1].endswith(b"\n"):  # the file's last line
        lines[-1] += b"\n"
    if not labelled:  # a label for the parser; blank lines stay blank
        lines = [line if line in (b"\n", b"\r\n") else b"0\t" + line for line in lines]
    chunk = parse_lines(b"".join(lines))
    bad = np.flatnonzero((chunk.skipped >= 0) & (chunk.skipped != BLANK_LINE))
    if len(bad):
        kind = chunk.skipped[bad[0]]
        reason = REASONS[KINDS[kind]] if labelled or kind != WRONG_FIELD_COUNT \
            else UNLABELLED_REASON
        raise DataError(f"{path}:{first_line + bad[0]}: {reason}; give raw Criteo rows, "
                        f"one per line")
    numbers = first_line + np.flatnonzero(chunk.skipped < 0)  # each row's line number
    ids = vocabulary.map(chunk.cats).astype(np.int64)
    features = range(ids.shape[1])
    return ScoringRows(chunk.dense.astype(np.float32), [ids[:, f:f + 1] for f in features],
                       [np.ones(len(ids), np.int64)] * len(features),
                       chunk.labels.astype(np.float32) if labelled else None,
                       lambda i: f"{path}:{numbers[i]}")
