"""Checks on where a command writes, made before it does any work: no output writes over one of
its inputs, however either path is spelled (relative or absolute, through a symlink, a hard link
of the same file), and a file output has a folder to go in."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional, Sequence, Tuple

from dlrm_hybrid.errors import UserError

Named = Tuple[str, Optional[str]]  # (the option that names it, e.g. "--out"; the path or None)


def refuse_overwriting_inputs(outputs: Sequence[Named], inputs: Sequence[Named],
                              command: str) -> None:
    """Raise a one-line UserError when an output is an input, is a folder holding an input, or
    already exists inside an input folder (writing it would replace a file there). Unset
    (None or "") outputs and inputs, and inputs that do not exist, are skipped."""
    for out_flag, out in outputs:
        for in_flag, source in inputs:
            if not out or not source or not os.path.lexists(out) or not os.path.exists(source):
                continue
            clash = _clash(out, source)
            if clash:
                raise UserError(f"{command}: {out_flag} {out} {clash} {in_flag} {source}, an "
                                f"input; write it elsewhere")


def temporary_beside(target: Path) -> Path:
    """Where `target` is written before it is renamed into place: a hidden name of this process
    beside it (`.NAME.partial-PID`). No file of the user's goes by it, so a write stopped half-way,
    and the clean-up after it, leave the user's files (an `OUT.partial` of theirs included) as
    they were."""
    return target.with_name(f".{target.name}.partial-{os.getpid()}")


def require_file_target(flag: str, path: str) -> None:
    """`path` can be written as a file: its folder exists and it is not a folder itself."""
    target = Path(path)
    try:
        folder, parent = target.is_dir(), target.parent.is_dir()
    except OSError as e:  # a name too long, say
        raise UserError(f"{flag}: cannot write {path} ({e.strerror})") from None
    if folder:
        raise UserError(f"{flag}: {path} is a folder; give a file name in it")
    if not parent:
        raise UserError(f"{flag}: folder {target.parent} does not exist; create it first")


def _clash(out: str, source: str) -> Optional[str]:
    """How writing the existing path `out` would destroy the existing input `source`, if it would."""
    if os.path.exists(out) and os.path.samefile(out, source):
        return "is"
    real_out, real_source = Path(os.path.realpath(out)), Path(os.path.realpath(source))
    if real_source.is_relative_to(real_out):
        return "holds"
    if os.path.isdir(source) and (real_out.is_relative_to(real_source)
                                  or _hard_link_inside(out, source)):
        return "would replace a file inside"
    return None


def _hard_link_inside(out: str, folder: str) -> bool:
    """`out` is a file with more names than one, one of them under `folder` (only then is the
    folder walked: an output with a single name cannot be a file of the folder)."""
    try:
        st = os.stat(out)
    except OSError:
        return False  # a dangling symlink: writing it creates a new file
    if not stat.S_ISREG(st.st_mode) or st.st_nlink < 2:
        return False
    for root, _, files in os.walk(folder):
        for name in files:
            other = os.stat(os.path.join(root, name), follow_symlinks=False)
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return True
    return False
