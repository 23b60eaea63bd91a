"""Rows to score from a CSV or TSV file (`predict`): per line an optional label, the dense
values, then one field per categorical feature with its ids, already preprocessed (the row
indices of the model's tables); a multi-hot feature's ids are separated by spaces. A first line
that is not all numbers is a header. Read in chunks, so a file of any size scores in bounded
memory."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import numpy as np

from dlrm_hybrid.errors import DataError


@dataclass
class ScoringRows:
    """A chunk of rows to score."""

    dense: np.ndarray  # [B, num_dense] float32
    ids: List[np.ndarray]  # per categorical feature, [B, widest bag] int64, padded
    lengths: List[np.ndarray]  # per categorical feature, [B] ids used
    labels: Optional[np.ndarray]  # [B] float32, when the data has them
    locate: Callable[[int], str]  # where row i of the chunk comes from, for error messages


def text_row_chunks(path: Path, num_dense: int, num_features: int, rows_per_chunk: int
                    ) -> Iterator[ScoringRows]:
    delimiter = "\t" if path.suffix in (".tsv", ".txt") or _first_line_has_tab(path) else ","
    fields = num_dense + num_features
    with open(path, newline="") as stream:
        reader = csv.reader(stream, delimiter=delimiter)
        chunk: List[List[str]] = []
        lines: List[int] = []  # each row's line number, for error messages
        labelled = None
        for row in reader:
            line = reader.line_num
            if not row:
                continue  # a blank line
            if line == 1 and not _numbers(row):
                continue  # a header
            if labelled is None:
                if len(row) not in (fields, fields + 1):
                    raise DataError(f"{path}:{line}: {len(row)} fields; the model takes "
                                    f"{num_dense} dense values and {num_features} categorical "
                                    f"features ({fields} fields, or {fields + 1} with a label first)")
                labelled = len(row) == fields + 1
            if len(row) != fields + labelled:
                raise DataError(f"{path}:{line}: {len(row)} fields, the lines before have "
                                f"{fields + labelled}")
            chunk.append(row)
            lines.append(line)
            if len(chunk) == rows_per_chunk:
                yield _parse(path, chunk, lines, num_dense, labelled)
                chunk, lines = [], []
        if chunk:
            yield _parse(path, chunk, lines, num_dense, bool(labelled))


def _first_line_has_tab(path: Path) -> bool:
    with open(path, newline="") as stream:
        return "\t" in stream.readline()


def _numbers(row: List[str]) -> bool:
    try:
        for field in row:
            for token in field.split():
                float(token)
        return True
    except ValueError:
        return False


def _parse(path: Path, rows: List[List[str]], lines: List[int], num_dense: int,
           labelled: bool) -> ScoringRows:
    locate = lambda i: f"{path}:{lines[i]}"  # noqa: E731
    start = 1 if labelled else 0
    labels = dense = None
    column = ""
    try:
        if labelled:
            column = "label"
            labels = np.array([float(r[0]) for r in rows], dtype=np.float32)
        column = "dense"
        dense = np.array([[float(v) for v in r[start:start + num_dense]] for r in rows],
                         dtype=np.float32)
    except ValueError:
        bad = next(i for i, r in enumerate(rows) if not _numbers(r[:start + num_dense]))
        raise DataError(f"{locate(bad)}: a {column} field is not a number") from None
    if not np.isfinite(dense).all():
        bad = int(np.argwhere(~np.isfinite(dense))[0, 0])
        raise DataError(f"{locate(bad)}: a dense value is not finite (nan or inf); give the "
                        f"preprocessed values")
    if labels is not None and not np.isin(labels, (0.0, 1.0)).all():
        bad = int(np.argwhere(~np.isin(labels, (0.0, 1.0)))[0, 0])
        raise DataError(f"{locate(bad)}: the label is {labels[bad]:g}; labels are 0 or 1")
    ids, lengths = [], []
    for f in range(len(rows[0]) - start - num_dense):
        bags = []
        for i, r in enumerate(rows):
            try:
                bag = [int(token) for token in r[start + num_dense + f].split()]
            except ValueError:
                raise DataError(f"{locate(i)}: categorical feature {f} is not integer ids "
                                f"({r[start + num_dense + f]!r}); give preprocessed ids") from None
            if not bag:
                raise DataError(f"{locate(i)}: categorical feature {f} is empty; give it an id")
            bags.append(bag)
        count = np.array([len(b) for b in bags], dtype=np.int64)
        padded = np.zeros((len(rows), int(count.max())), dtype=np.int64)
        for i, bag in enumerate(bags):
            try:
                padded[i, :len(bag)] = bag
            except OverflowError:
                raise DataError(f"{locate(i)}: categorical feature {f} has an id beyond int64; "
                                f"give preprocessed ids") from None
        ids.append(padded)
        lengths.append(count)
    return ScoringRows(dense, ids, lengths, labels, locate)
