"""Reading a checkpoint without running code from it.

torch.distributed.checkpoint's FileSystemReader unpickles `.metadata` with plain `pickle`, and
its default planner reads non-tensor entries with `torch.load(weights_only=False)`: a crafted
checkpoint folder would run arbitrary code in `eval`, `export` and resume. `checkpoint_reader`
returns a FileSystemReader that
- unpickles `.metadata` with an allowlist: DCP's own metadata classes, torch.Size, dtypes,
  layouts, paths and plain containers/scalars (what torch 2.13 writes; see `_ALLOWED`),
- checks that the result is shaped like DCP metadata and names only files inside the folder,
  and that no file it reads (`.metadata` included) is a link resolving outside the folder,
- loads non-tensor entries with `torch.load(weights_only=True)` and hands the planner a
  re-serialized copy, so the planner's own `weights_only=False` load sees only safe objects.
All of it is checked when the reader is made (and again on `reset` to another folder), outside
DCP's collectives, which would bury the one-line error in a wrapped traceback.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    _MEM_FORMAT_ENCODING,
)

from dlrm_hybrid.errors import DataError

METADATA = ".metadata"


def _allowed_globals() -> dict:
    """(module, name) -> object, exactly what DCP's `.metadata` may reference. Dotted names
    (pickle protocol 4 lets `find_class` walk attributes) never match, so nothing is reachable
    through an allowed class."""
    dcp_meta = "torch.distributed.checkpoint.metadata"
    allowed = {(dcp_meta, cls.__name__): cls for cls in (
        Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata,
        TensorProperties, MetadataIndex, StorageMeta, _MEM_FORMAT_ENCODING)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # torch.dtype pickles as the global torch.<name>; torch.layout through _get_layout(str),
    # which only looks the name up among torch's layouts.
    allowed.update({("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    # StorageMeta.checkpoint_id is the folder the writer was given (Python 3.13 moved the
    # classes to pathlib._local).
    for module in ("pathlib", "pathlib._local"):
        for cls in (pathlib.PosixPath, pathlib.PurePosixPath):
            allowed[(module, cls.__name__)] = cls
    # Plain containers, for pickles written with protocols before 4.
    allowed.update({("builtins", cls.__name__): cls for cls in (set, frozenset)})
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    return allowed


_ALLOWED = _allowed_globals()


class _Disallowed(Exception):
    """Raised by the unpickler before it imports or calls anything it was not meant to."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Disallowed(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Disallowed("a persistent id")


def _one_line(text: str, limit: int = 120) -> str:
    """Names and messages from a crafted file, printable in one line."""
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit] + "..."


def _refused(folder, what: str) -> DataError:
    return DataError(f"{folder}: the checkpoint metadata references a disallowed object "
                     f"({_one_line(what)}); it is not a checkpoint this program wrote, and "
                     f"nothing in it was run")


def _corrupt(folder, why: str) -> DataError:
    return DataError(f"{folder}: the checkpoint metadata ({METADATA}) is truncated or corrupt "
                     f"({_one_line(why)})")


def load_metadata(data: bytes, folder) -> Metadata:
    """Unpickle `.metadata` bytes with the allowlist and check their shape; DataError if they
    reference anything else, or are not DCP metadata."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Disallowed as e:
        raise _refused(folder, str(e)) from None
    except Exception as e:  # only allowed constructors ran: any failure means a bad file
        raise _corrupt(folder, f"{type(e).__name__}: {e}") from None
    _check_shape(metadata, folder)
    return metadata


def _check_shape(metadata: Any, folder) -> None:
    """DCP trusts the metadata's types and file names: a wrong type would fail deep inside a
    collective, and a path like `../../x` would read a file outside the checkpoint."""
    if not isinstance(metadata, Metadata):
        raise _corrupt(folder, f"holds a {type(metadata).__name__}, not checkpoint metadata")
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(
            isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
            for k, v in entries.items()):
        raise _corrupt(folder, "its table of entries is malformed")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not all(
            isinstance(k, MetadataIndex) and isinstance(v, _StorageInfo)
            and isinstance(v.relative_path, str) for k, v in storage.items()):
        raise _corrupt(folder, "its table of storage locations is malformed")
    for info in storage.values():
        parts = Path(info.relative_path).parts
        if not parts or Path(info.relative_path).is_absolute() or ".." in parts:
            raise DataError(f"{folder}: the checkpoint metadata points at a file outside the "
                            f"checkpoint folder ({_one_line(info.relative_path)}); it is not a "
                            f"checkpoint this program wrote")


def inside(folder, name: str) -> Path:
    """`folder / name` if it resolves inside `folder`, else a DataError naming it: a symbolic
    link in a checkpoint folder must not make a reader open a file elsewhere."""
    path = Path(folder) / name
    target, root = path.resolve(), Path(folder).resolve()
    if not target.is_relative_to(root):
        raise DataError(f"{path}: a link to {_one_line(str(target))}, outside the checkpoint "
                        f"folder; put the file itself in the folder")
    return path


def load_plain_object(stream: io.BytesIO, folder, fqn: str) -> Any:
    """A non-tensor checkpoint entry, loaded with `torch.load(weights_only=True)`: tensors,
    containers and scalars only; DataError for anything else."""
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's message is a page; keep the name it refused
        name = re.search(r"GLOBAL (\S+)", str(e))
        raise DataError(f"{folder}: the checkpoint entry {_one_line(fqn)} references a "
                        f"disallowed object ({_one_line(name.group(1)) if name else 'not data'}); "
                        f"it is not a checkpoint this program wrote, and nothing in it was run"
                        ) from None
    except Exception as e:
        raise DataError(f"{folder}: the checkpoint entry {_one_line(fqn)} is truncated or "
                        f"corrupt ({type(e).__name__})") from None


class _SafeBytesPlanner:
    """Stands in for the load planner inside `read_data`: non-tensor entries reach the real
    planner (whose `load_bytes` calls `torch.load(weights_only=False)`) only as bytes that
    `torch.save` wrote from an object `weights_only=True` admitted."""

    def __init__(self, planner, folder):
        self._planner, self._folder = planner, folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = load_plain_object(value, self._folder, read_item.dest_index.fqn)
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        self._planner.load_bytes(read_item, clean)

    def __getattr__(self, name: str) -> Any:  # resolve_tensor, commit_tensor, ...
        return getattr(self._planner, name)


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that never unpickles anything outside the allowlist (module doc)."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        super().__init__(path)
        self._validate()

    def reset(self, checkpoint_id: Union[str, os.PathLike, None] = None) -> None:
        super().reset(checkpoint_id)
        if checkpoint_id:
            self._validate()

    def _validate(self) -> None:
        """Read and check `.metadata` and every non-tensor entry now, so that an error is one
        line raised here rather than a wrapped CheckpointException. The metadata bytes are kept:
        DCP's later `read_metadata` parses exactly what was checked."""
        folder = self.path
        try:
            with open(inside(folder, METADATA), "rb") as f:
                self._metadata_bytes = f.read()
        except FileNotFoundError:
            raise DataError(f"{folder}: no {METADATA} in it; it is not a complete checkpoint"
                            ) from None
        except OSError as e:
            raise DataError(f"{folder}: cannot read {METADATA} ({type(e).__name__}: "
                            f"{_one_line(str(e))})") from None
        metadata = load_metadata(self._metadata_bytes, folder)
        for info in metadata.storage_data.values():
            inside(folder, info.relative_path)
        self._check_plain_entries(metadata)

    def _check_plain_entries(self, metadata: Metadata) -> None:
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                load_plain_object(self._read_entry(info), self.path, index.fqn)

    def _read_entry(self, info: _StorageInfo) -> io.BytesIO:
        """One stored entry's bytes, decoded as `read_data` decodes them."""
        folder = self.path
        try:
            with open(inside(folder, info.relative_path), "rb") as f:
                raw = self._slice_file(f, info)
                stream = self.transforms.transform_load_stream(
                    None, info.transform_descriptors or (), raw)
                return io.BytesIO(stream.read(-1))
        except OSError as e:
            raise DataError(f"{folder}: cannot read {_one_line(info.relative_path)} "
                            f"({type(e).__name__}); the checkpoint is incomplete") from None
        except Exception as e:
            raise _corrupt(folder, f"entry in {info.relative_path}: {type(e).__name__}") from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # Per-rank metadata files are a fallback for checkpoints without a global one;
            # ours always have it, and _validate has read it.
            raise DataError(f"{self.path}: per-rank checkpoint metadata is not supported")
        metadata = load_metadata(self._metadata_bytes, self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        return super().read_data(plan, _SafeBytesPlanner(planner, self.path))


def checkpoint_reader(path: Union[str, os.PathLike]) -> SafeFileSystemReader:
    """The storage reader to pass to `dcp.load(..., storage_reader=...)` and
    `_load_state_dict_from_keys(..., storage_reader=...)`. Raises DataError (one line) if
    `path` has no readable metadata, or references anything but checkpoint data."""
    return SafeFileSystemReader(path)
