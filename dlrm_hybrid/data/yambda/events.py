"""Yambda's flat parquet files read into one column set of events, checked before any row.

Layout (HuggingFace `yandex/yambda`, `flat/<size>/`; from its dataset card, not reachable
offline, so written down here as assumed):
- `listens.parquet`: uid, item_id, timestamp, is_organic, played_ratio_pct,
  track_length_seconds;
- `likes`, `unlikes`, `dislikes`, `undislikes` `.parquet`: uid, item_id, timestamp, is_organic;
- `multi_event.parquet`: all of them, with `event_type` (listen, like, unlike, dislike,
  undislike) and the listens' two columns null on other events.
Timestamps are integers (seconds from an anonymized epoch, in multiples of 5). Integer columns
of any width are read; a column of another type, a missing column, an empty or non-parquet file is
refused in one line naming the file and column. Bad rows (a null id or time, a listen without
its played ratio, an unknown event type, a negative value or one too large for the dtypes
above) are counted by kind and skipped.

A folder with `multi_event.parquet` is read from it alone; else `listens.parquet` and those of
the other four present. File order (the tie-break of equal timestamps) is row order, the
per-event files one after another in EVENT_FILES' order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Tuple

import numpy as np

from dlrm_hybrid.errors import DataError

EVENT_TYPES = ("listen", "like", "dislike", "unlike", "undislike")  # kind codes 0..4
LISTEN = 0
EVENT_FILES = ("listens", "likes", "dislikes", "unlikes", "undislikes")  # kind k's own file
MULTI = "multi_event"
BASE = ("uid", "item_id", "timestamp", "is_organic")
LISTEN_ONLY = ("played_ratio_pct", "track_length_seconds")
# the dtypes the generator writes (Yambda's, as assumed); the reader takes any integer width
DTYPES = {"uid": "uint32", "item_id": "uint32", "timestamp": "uint32", "is_organic": "uint8",
          "played_ratio_pct": "uint16", "track_length_seconds": "uint32"}
BAD_KINDS = ("null_uid", "null_item_id", "null_timestamp", "null_played_ratio",
             "unknown_event_type", "out_of_range")  # out_of_range: a value its dtype cannot hold
BATCH = 1 << 20  # rows converted at a time
# an event held in memory: 20 bytes
STORED = {"uid": np.uint32, "item": np.uint32, "time": np.uint32, "kind": np.uint8,
          "organic": np.uint8, "played": np.uint16, "length": np.uint32}


@dataclass
class Events:
    """Every kept event in file order: ids, time, kind (EVENT_TYPES' index), is_organic, and for
    listens the played ratio and track length (0 elsewhere); the rows read and skipped."""

    uid: np.ndarray
    item: np.ndarray
    time: np.ndarray
    kind: np.ndarray
    organic: np.ndarray
    played: np.ndarray
    length: np.ndarray
    files: List[str] = field(default_factory=list)
    read: Dict[str, int] = field(default_factory=dict)  # file -> rows
    bad: Dict[str, int] = field(default_factory=lambda: {k: 0 for k in BAD_KINDS})

    def __len__(self) -> int:
        return len(self.uid)


def input_files(folder: str) -> List[Tuple[Path, int]]:
    """(file, kind: -1 for multi_event) of the Yambda folder, in file order."""
    root = Path(folder)
    if not root.is_dir():
        raise DataError(f"--input: {folder} is not a folder; give the folder of Yambda's flat "
                        f"parquet files (multi_event.parquet, or listens.parquet and the others)")
    multi = root / f"{MULTI}.parquet"
    if multi.exists():
        return [(multi, -1)]
    files = [(root / f"{name}.parquet", kind) for kind, name in enumerate(EVENT_FILES)]
    if not files[0][0].exists():
        raise DataError(f"--input: {folder} has neither {MULTI}.parquet nor listens.parquet; "
                        f"give the folder of Yambda's flat files (e.g. flat/50m)")
    return [(path, kind) for path, kind in files if path.exists()]


def _open(path: Path, kind: int):
    """The parquet file, its columns checked against Yambda's (before any row is read)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path.stat().st_size == 0:
        raise DataError(f"--input: {path} is empty (0 bytes); download it again")
    try:
        handle = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"--input: {path} is not a parquet file ({str(e).splitlines()[0]}); give "
                        f"Yambda's flat parquet files") from None
    schema = handle.schema_arrow
    wanted = [*BASE, *(LISTEN_ONLY if kind in (-1, LISTEN) else ()),
              *(("event_type",) if kind == -1 else ())]
    for name in wanted:
        if name not in schema.names:
            raise DataError(f"--input: {path} has no column {name} (its columns: "
                            f"{', '.join(schema.names)}); Yambda's {path.stem} has "
                            f"{', '.join(wanted)}")
        kind_of = schema.field(name).type
        if name == "event_type":
            value = kind_of.value_type if pa.types.is_dictionary(kind_of) else kind_of
            ok = pa.types.is_string(value) or pa.types.is_large_string(value)
            want = "a string"
        else:
            ok, want = pa.types.is_integer(kind_of), f"an integer (Yambda's is {DTYPES[name]})"
        if not ok:
            raise DataError(f"--input: {path} column {name} is {kind_of}, not {want}; give "
                            f"Yambda's flat files unchanged")
    return handle, wanted


def _column(batch, name: str, dtype) -> Tuple[np.ndarray, np.ndarray]:
    """(values with nulls as 0, null mask) of a batch's column."""
    import pyarrow.compute as pc

    column = batch.column(name)
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    return pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(dtype), nulls


def _outside(*columns_then_dtype) -> np.ndarray:
    """Where any of the int64 columns holds a value the dtype (the last argument) cannot."""
    *columns, dtype = columns_then_dtype
    top = np.iinfo(dtype).max
    return np.logical_or.reduce([(c < 0) | (c > top) for c in columns])


def _kinds(batch) -> np.ndarray:
    """multi_event's event_type as EVENT_TYPES' index, -1 for a null or unknown one."""
    import pyarrow as pa
    import pyarrow.compute as pc

    types = batch.column("event_type").cast(pa.string())
    index = pc.index_in(types, value_set=pa.array(EVENT_TYPES))
    return pc.fill_null(index, -1).to_numpy(zero_copy_only=False).astype(np.int8)


def total_rows(folder: str) -> int:
    """The rows of the folder's files, each checked (the metadata only; no row read)."""
    return sum(_open(path, kind)[0].metadata.num_rows for path, kind in input_files(folder))


def no_events() -> Events:
    return Events(*[np.zeros(0, dtype) for dtype in STORED.values()])


def event_batches(folder: str, events: Events, fits: Callable[[int], None] = lambda rows: None
                  ) -> Iterator[Dict[str, np.ndarray]]:
    """The folder's good events, a batch at a time in file order (STORED's columns). Each file
    is checked first, then `fits` is given the rows of all (it raises if they cannot be
    handled); the files, their rows and the bad rows by kind are recorded in `events`."""
    files = input_files(folder)
    opened = [(path, kind, *_open(path, kind)) for path, kind in files]
    fits(sum(handle.metadata.num_rows for _, _, handle, _ in opened))
    events.files = [str(p) for p, _ in files]
    for path, kind, handle, columns in opened:
        events.read[str(path)] = handle.metadata.num_rows
        for batch in handle.iter_batches(batch_size=BATCH, columns=columns):
            parts: Dict[str, List[np.ndarray]] = {k: [] for k in STORED}
            _add_batch(batch, kind, parts, events.bad)
            yield {k: v[0] for k, v in parts.items()}


def read_events(folder: str, fits: Callable[[int], None] = lambda rows: None) -> Events:
    """Every event of the folder's files in memory (event_batches)."""
    events = no_events()
    parts: Dict[str, List[np.ndarray]] = {k: [] for k in STORED}
    for batch in event_batches(folder, events, fits):
        for name, values in batch.items():
            parts[name].append(values)
    for name in STORED:
        if parts[name]:
            setattr(events, name, np.concatenate(parts[name]))
    return events


def _add_batch(batch, kind: int, parts: Dict[str, List[np.ndarray]], bad: Dict[str, int]
               ) -> None:
    """One batch's good rows appended to `parts`; its bad rows counted in `bad`."""
    n = batch.num_rows
    uid, null_uid = _column(batch, "uid", np.int64)
    item, null_item = _column(batch, "item_id", np.int64)
    time, null_time = _column(batch, "timestamp", np.int64)
    organic, _ = _column(batch, "is_organic", np.int64)
    kinds = _kinds(batch) if kind == -1 else np.full(n, kind, np.int8)
    listen = kinds == LISTEN
    if kind in (-1, LISTEN):
        played, null_played = _column(batch, "played_ratio_pct", np.int64)
        length, _ = _column(batch, "track_length_seconds", np.int64)
    else:
        played, null_played, length = (np.zeros(n, np.int64), np.zeros(n, bool),
                                       np.zeros(n, np.int64))
    problems = [("null_uid", null_uid), ("null_item_id", null_item),
                ("null_timestamp", null_time), ("unknown_event_type", kinds < 0),
                ("null_played_ratio", null_played & listen),
                ("out_of_range", _outside(uid, item, time, length, np.uint32)
                 | _outside(played, np.uint16) | _outside(organic, np.uint8))]
    keep = np.ones(n, bool)
    for name, mask in problems:  # a row is counted once, by its first problem
        bad[name] += int((mask & keep).sum())
        keep &= ~mask
    for name, values in (("uid", uid), ("item", item), ("time", time), ("kind", kinds),
                         ("organic", organic), ("played", np.where(listen, played, 0)),
                         ("length", np.where(listen, length, 0))):
        parts[name].append(values[keep].astype(STORED[name]))
