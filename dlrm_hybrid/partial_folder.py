"""The folder `OUT.partial` a command builds its output folder in before renaming it to OUT.

A stopped run leaves it behind; the next run may remove it only when it is sure that a run of
the same command made it (a marker file inside), not a user's folder that happens to bear the
name: that one is refused, in one line, and left untouched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from dlrm_hybrid.errors import UserError

MARKER = ".dlrm_hybrid_partial"  # inside a partial folder: the command that made it


def start_partial(target: Path, command: str) -> Path:
    """A new, empty `target.partial` holding the marker; a stopped `command`'s one is removed
    first, anything else there refused."""
    partial = target.with_name(target.name + ".partial")
    if partial.exists() or partial.is_symlink():
        made_by = partial / MARKER
        if partial.is_symlink() or not made_by.is_file() or \
                made_by.read_text(encoding="utf-8", errors="replace").strip() != command:
            raise UserError(f"{partial}: exists and is not a stopped {command}'s work (no "
                            f"{MARKER} of it inside); move or remove it, or choose another "
                            f"output name")
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / MARKER).write_text(command + "\n", encoding="utf-8")
    return partial


def finish_partial(partial: Path, target: Path) -> None:
    """`partial`, complete, becomes `target` (without the marker)."""
    (partial / MARKER).unlink()
    partial.replace(target)
