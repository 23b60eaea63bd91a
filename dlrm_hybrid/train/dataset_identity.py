"""What makes a split-binary dataset (or an interaction log's folder) the same dataset wherever its folder lies: its feature spec,
its labels, the samples of each split, and a digest of every file's size and first bytes (every
label's file too). A checkpoint records it, so that a resume compares datasets, not the spelling
of `data.path` (relative or absolute, a trailing slash, a copy staged into a job's own folder).

The digest reads 64 KiB of each file: enough to tell a dataset preprocessed otherwise (another
shuffle, other days) with the same shape, without reading terabytes at each checkpoint.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, List, Optional

from dlrm_hybrid.data.feature_spec import SINGLE_TASK, load_feature_spec
from dlrm_hybrid.data.interactions.interaction_meta import is_interaction_folder, read_meta
from dlrm_hybrid.errors import UserError

HEAD_BYTES = 64 * 1024


def dataset_identity(path: str) -> dict:
    """The identity of the split-binary dataset or interaction log at `path` (JSON-serialisable)."""
    if is_interaction_folder(path):
        return _interaction_identity(path)
    fspec = load_feature_spec(path)
    spec, heads = fspec.spec, hashlib.sha256()
    samples = {}
    store = fspec.notes.get("history_store")  # a history read from the timelines: theirs too
    root = Path(fspec.root)
    for split, files in sorted(fspec.splits.items()):
        samples[split] = files.label.stat().st_size  # one byte per sample
        offsets = [root / split / store["offsets"]] if store else []
        for file in [*files.labels, files.numerical, *files.categorical, *offsets]:
            if file is None:  # no dense features
                continue
            _digest(heads, file)
    if store:
        _digest(heads, root / store["timelines"])
    return {"num_dense": spec.num_dense, "cardinalities": list(spec.cardinalities),
            "hotness": list(spec.hotness), "labels": list(fspec.label_names),
            "samples": samples, "files_sha256": heads.hexdigest()}


def _digest(heads, file: Path) -> None:
    with open(file, "rb") as f:
        heads.update(f"{file.name} {file.stat().st_size}\n".encode())
        heads.update(f.read(HEAD_BYTES))


def _interaction_identity(path: str) -> dict:
    """An interaction log's tables (users, side features, items), engagements per split, and
    the heads of its arrays."""
    meta, heads = read_meta(path), hashlib.sha256()
    for file in sorted(Path(path).glob("*.npy")):
        with open(file, "rb") as f:
            heads.update(f"{file.name} {file.stat().st_size}\n".encode())
            heads.update(f.read(HEAD_BYTES))
    spec = meta.spec()
    return {"num_dense": 0, "cardinalities": list(spec.cardinalities),
            "hotness": list(spec.hotness), "samples": dict(meta.samples),
            "files_sha256": heads.hexdigest()}


def readable_identity(path: str) -> Optional[dict]:
    """`dataset_identity`, or None where no dataset can be read at `path` any more."""
    try:
        return dataset_identity(path)
    except (UserError, OSError):
        return None


def identity_changes(there: dict, here: dict) -> List[str]:
    """What differs between two identities, in words (empty: the same dataset)."""
    names: Dict[str, str] = {"num_dense": "dense features", "cardinalities": "cardinalities",
                             "hotness": "hotness", "labels": "labels", "samples": "samples per split"}
    there = {"labels": [SINGLE_TASK], **there}  # recorded before datasets had several labels
    here = {"labels": [SINGLE_TASK], **here}  # an interaction log's
    changes = [f"{words} {there.get(key)} there, {here[key]} here"
               for key, words in names.items() if there.get(key) != here[key]]
    if not changes and there.get("files_sha256") != here["files_sha256"]:
        changes.append("same shape, other file contents")
    return changes
