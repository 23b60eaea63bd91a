"""Rows to score from a CSV or TSV file (`predict`): per line an optional label, the dense
values, then one field per categorical feature with its ids, already preprocessed (the row
indices of the model's tables); a multi-hot feature's ids are separated by spaces. An empty dense
field is a missing value, 0.0, as `preprocess criteo` stores an empty integer field. Every line
but a header is a row: `header` says whether the first line is one ("auto": only when it is
clearly not a row; it will not guess about pandas' 0,1,2,...). A header's names (the model's:
label, num_<i>, cat_<i>, as feature_spec.yaml names them) place its columns, in any order;
pandas' header of unnamed columns leaves them in place. A multi-task model's labels are columns
named by its tasks (any of them, in a header; all of them first, in the model's order, without
one); an empty label field there is a missing label (NaN), as in a multi-task dataset. Read in
chunks, so a file of any size scores in bounded memory."""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

import numpy as np

from dlrm_hybrid.data.feature_spec import LABEL
from dlrm_hybrid.errors import DataError

HEADERS = ("auto", "yes", "no")


@dataclass
class ScoringRows:
    """A chunk of rows to score."""

    dense: np.ndarray  # [B, num_dense] float32
    ids: List[np.ndarray]  # per categorical feature, [B, widest bag] int64, padded
    lengths: List[np.ndarray]  # per categorical feature, [B] ids used
    labels: Optional[np.ndarray]  # [B] float32 (multi-task: [B, T], NaN: missing), if labelled
    locate: Callable[[int], str]  # where row i of the chunk comes from, for error messages


@dataclass
class Layout:
    """Where a file's rows keep the model's columns."""

    header: bool  # the first line is a header
    width: int  # fields per row
    labels: List[int]  # the task of each label field (they come first); empty: unlabelled
    order: Optional[List[int]]  # field of each model column (labels first), or None: in order


def text_row_chunks(path: Path, num_dense: int, features: List[str], rows_per_chunk: int,
                    header: str = "auto", tasks: Optional[List[str]] = None
                    ) -> Iterator[ScoringRows]:
    """Chunks of the file's rows; `tasks`: a multi-task model's task names (None: one label,
    named `label`)."""
    delimiter = "\t" if path.suffix in (".tsv", ".txt") or _first_line_has_tab(path) else ","
    with open(path, newline="", encoding="utf-8-sig") as stream:  # utf-8-sig: drops a BOM
        reader = csv.reader(stream, delimiter=delimiter)
        chunk: List[List[str]] = []
        lines: List[int] = []  # each row's line number, for error messages
        layout: Optional[Layout] = None
        for line, row in _numbered(path, reader):
            if not row:
                continue  # a blank line
            if layout is None:
                layout = _layout(path, line, row, num_dense, features, header, tasks)
                if layout.header:
                    continue
            if len(row) != layout.width:
                raise DataError(f"{path}:{line}: {len(row)} fields, the lines before have "
                                f"{layout.width}")
            chunk.append(row if layout.order is None else [row[j] for j in layout.order])
            lines.append(line)
            if len(chunk) == rows_per_chunk:
                yield _parse(path, chunk, lines, num_dense, layout.labels, tasks)
                chunk, lines = [], []
        if chunk and layout is not None:
            yield _parse(path, chunk, lines, num_dense, layout.labels, tasks)


def _numbered(path: Path, reader) -> Iterator[Tuple[int, List[str]]]:
    """(line number, fields) of each line; an undecodable file is a one-line error."""
    try:
        for row in reader:
            yield reader.line_num, row
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; save it as UTF-8") from None
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: {e}") from None


def _layout(path: Path, line: int, first: List[str], num_dense: int, features: List[str],
            header: str, tasks: Optional[List[str]]) -> Layout:
    """The rows' layout, from the first line: a header, or the first row."""
    columns = [f"num_{i}" for i in range(num_dense)] + list(features)
    labels = tasks if tasks is not None else [LABEL]
    if _is_header(path, line, first, header):
        if _is_index_header(first):
            return _positional(path, line, first, num_dense, len(features), labels, header=True)
        return _named(path, line, [name.strip() for name in first], num_dense, columns, labels)
    return _positional(path, line, first, num_dense, len(features), labels, header=False)


def _is_header(path: Path, line: int, first: List[str], header: str) -> bool:
    """Whether the first line is a header; "auto" will not guess about pandas' 0,1,2,..."""
    if header != "auto":
        return header == "yes"
    if _is_index_header(first):
        raise DataError(f"{path}:{line}: the first line reads 0,1,...,{len(first) - 1}: pandas' "
                        f"header of unnamed columns, or a row? Say --header yes or --header no")
    return not _numbers(first)


def _positional(path: Path, line: int, first: List[str], num_dense: int, num_features: int,
                labels: List[str], header: bool) -> Layout:
    fields, count = num_dense + num_features, len(labels)
    if len(first) not in (fields, fields + count):
        with_labels = (f"{fields + 1} with a label first" if labels == [LABEL] else
                       f"{fields + count} with the labels {', '.join(labels)} first")
        raise DataError(f"{path}:{line}: {len(first)} fields; the model takes {num_dense} dense "
                        f"values and {num_features} categorical features ({fields} fields, or "
                        f"{with_labels})")
    return Layout(header, len(first), list(range(count)) if len(first) > fields else [], None)


def _named(path: Path, line: int, names: List[str], num_dense: int, columns: List[str],
           labels: List[str]) -> Layout:
    """Columns placed by a header's names, which must be the model's."""
    spans = (f"{', '.join(labels)} (optional)", _span(columns[:num_dense]),
             _span(columns[num_dense:]))
    described = ", ".join(span for span in spans if span) + ", in any order"
    for name in names:
        if name not in (*labels, *columns):
            raise DataError(f"{path}:{line}: the header names a column {name!r}; the model's "
                            f"columns are {described}: name them so, or say --header no if "
                            f"line {line} is a row")
        if names.count(name) > 1:
            raise DataError(f"{path}:{line}: the header names column {name!r} twice")
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"{path}:{line}: the header has no column {missing[0]}; the model's "
                        f"columns are {described}")
    present = [t for t, label in enumerate(labels) if label in names]
    order = [names.index(c) for c in [labels[t] for t in present] + columns]
    return Layout(True, len(names), present, None if order == sorted(order) else order)


def _span(names: List[str]) -> str:
    return f"{names[0]}..{names[-1]}" if len(names) > 2 else ", ".join(names)


def _is_index_header(row: List[str]) -> bool:
    """pandas' header of a frame without column names: 0,1,2,..."""
    return [field.strip() for field in row] == [str(i) for i in range(len(row))]


def _first_line_has_tab(path: Path) -> bool:
    with open(path, newline="", encoding="utf-8-sig", errors="replace") as stream:
        return "\t" in stream.readline()


def _numbers(row: List[str]) -> bool:
    try:
        for field in row:
            for token in field.split():
                float(token)
        return True
    except ValueError:
        return False


def _labels(path: Path, rows: List[List[str]], lines: List[int], label_tasks: List[int],
            tasks: Optional[List[str]]) -> np.ndarray:
    """The label fields: [B] for one label; with `tasks`, [B, T] in the tasks' order, NaN for a
    task without a column or with an empty field."""
    if tasks is None:
        labels = _floats(path, rows, lines, 0, 1, "the label", None)[:, 0]
        bad = ~np.isin(labels, (0.0, 1.0))
        if bad.any():
            i = int(np.argwhere(bad)[0, 0])
            raise DataError(f"{path}:{lines[i]}: the label is {labels[i]:g}; labels are 0 or 1")
        return labels
    given = np.full((len(rows), len(label_tasks)), np.nan, dtype=np.float32)
    for j, t in enumerate(label_tasks):
        given[:, j] = _floats(path, rows, lines, j, 1, f"label {tasks[t]}", np.nan)[:, 0]
    bad = ~(np.isin(given, (0.0, 1.0)) | np.isnan(given))
    if bad.any():
        i, j = (int(k) for k in np.argwhere(bad)[0])
        field = rows[i][j].strip()
        raise DataError(f"{path}:{lines[i]}: label {tasks[label_tasks[j]]} is {field!r}; labels "
                        f"are 0 or 1, or empty where missing")
    labels = np.full((len(rows), len(tasks)), np.nan, dtype=np.float32)
    labels[:, label_tasks] = given
    return labels


def _floats(path: Path, rows: List[List[str]], lines: List[int], first: int, count: int,
            what: str, missing: Optional[float]) -> np.ndarray:
    """Fields first..first+count-1 of each row as float32; an empty one is `missing`
    (None: an error)."""
    out = np.empty((len(rows), count), dtype=np.float32)
    for i, row in enumerate(rows):
        for j in range(count):
            field = row[first + j].strip()
            try:
                out[i, j] = float(field) if field or missing is None else missing
            except ValueError:
                name = what if count == 1 else f"{what} {j}"
                raise DataError(f"{path}:{lines[i]}: {name} is {field!r}, not a number") from None
    return out


def _parse(path: Path, rows: List[List[str]], lines: List[int], num_dense: int,
           label_tasks: List[int], tasks: Optional[List[str]]) -> ScoringRows:
    locate = lambda i: f"{path}:{lines[i]}"  # noqa: E731
    start = len(label_tasks)
    labels = _labels(path, rows, lines, label_tasks, tasks) if label_tasks else None
    dense = _floats(path, rows, lines, start, num_dense, "dense value", 0.0)
    if not np.isfinite(dense).all():
        bad = int(np.argwhere(~np.isfinite(dense))[0, 0])
        raise DataError(f"{locate(bad)}: a dense value is not finite (nan or inf); give the "
                        f"preprocessed values")
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
