"""A ranking dataset's history read from the users' timelines at load time
(`preprocess yambda --history L --history-store timelines`), not from L item and L action
columns: a row stores how many of its user's engagements come before it, and the reader
gathers the last L of them from timelines.npz (mapped, not loaded) into the very columns the
slot files would hold (ranking_history.Histories.before: oldest first, left-aligned, item and
action 0 past the history's end). Why: at DLRMv4's 4,095 slots the slot files are about 20 KB a
row (some 47 TB for Yambda-5b's training rows); the timelines are 24 bytes an event and the
offsets 4 bytes a row.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path
from typing import List

import numpy as np

from dlrm_hybrid.data.interactions.ranking_history import TIMELINES
from dlrm_hybrid.errors import DataError

OFFSETS = "timeline_offset.bin"  # per split: each row's count of its user's earlier engagements
HEADERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def store_note(item_rows: int, action_rows: int) -> dict:
    """feature_spec.yaml's `history_store` note: what the reader needs to rebuild the slots."""
    return {"kind": "timelines", "timelines": TIMELINES, "offsets": OFFSETS,
            "item_rows": int(item_rows), "action_rows": int(action_rows)}


class TimelineHistory:
    """The history slots of any rows, from `root`'s timelines (each array mapped)."""

    def __init__(self, root: Path, slots: int) -> None:
        path = root / TIMELINES
        self.slots = slots
        self.items, self.actions, self.starts = (mapped_member(path, key)
                                                 for key in ("items", "actions", "starts"))

    def columns(self, users: np.ndarray, offsets: np.ndarray) -> List[np.ndarray]:
        """[L item columns, then L action columns] for rows of `users` (dense ids) whose users
        had `offsets` engagements before them."""
        earlier = offsets.astype(np.int64)
        end = self.starts[users] + earlier
        count = np.minimum(earlier, self.slots)
        slot = np.arange(self.slots)
        used = slot[None, :] < count[:, None]
        index = np.where(used, end[:, None] - count[:, None] + slot[None, :], 0)
        items = np.where(used, self.items[index] if len(self.items) else 0, 0)
        actions = np.where(used, self.actions[index] if len(self.actions) else 0, 0)
        return [*items.T, *actions.T]


def mapped_member(path: Path, key: str) -> np.ndarray:
    """The array `key` of an uncompressed .npz (np.savez's, or one written member by member),
    mapped from the file rather than read: np.load cannot map an .npz member."""
    try:
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(f"{key}.npy")
        if info.compress_type != zipfile.ZIP_STORED:
            raise DataError(f"{path}: its {key} array is compressed and cannot be mapped; "
                            f"preprocess it again")
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            local = f.read(30)  # the local file header: its name and extra field lengths
            name, extra = struct.unpack("<HH", local[26:30])
            f.seek(info.header_offset + 30 + name + extra)
            read_header = HEADERS[np.lib.format.read_magic(f)]
            shape, fortran, dtype = read_header(f)
            offset = f.tell()
    except DataError:
        raise
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise DataError(f"{path}: cannot map its {key} array ({e}); the dataset's history is "
                        f"read from it: preprocess it again") from None
    if fortran:
        raise DataError(f"{path}: its {key} array is Fortran-ordered and cannot be mapped; "
                        f"preprocess it again")
    if not np.prod(shape):
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype, "r", offset, shape)
