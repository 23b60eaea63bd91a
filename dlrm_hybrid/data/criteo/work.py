"""The work folder of a preprocessing run, `.NAME.preprocess` beside the output: what a killed run
leaves for the same command to continue from.

- `job.json`: what the output depends on (each input's path, size and mtime; the options). A later
  run with anything different refuses to mix its work with this (one line naming the difference)
  unless told `--restart`.
- `done/<step>.json`: a record per finished step (a task counted, a range aggregated or numbered,
  a task written). A record is written whole (temporary file, fsync, rename) after the files it
  speaks for are on disk, so a step either has a record and complete files, or is done again.
- `dataset/`: the output being built; moved into place as a whole at the end.
- `lock`: held (flock) while a run works here, so two runs cannot share one folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Optional

from dlrm_hybrid.data.criteo.budget import NoDiskSpace
from dlrm_hybrid.errors import DataError, UserError

FOLDERS = ("done", "runs", "ranges", "dataset")


def identity(inputs, options: dict) -> dict:
    """What a run's output depends on: the inputs as they are now, and the options."""
    files = []
    for path in inputs:
        try:
            stat = os.stat(path)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror}); check the --input path") from None
        files.append({"path": os.path.abspath(path), "bytes": stat.st_size,
                      "mtime_ns": stat.st_mtime_ns})
    return {"inputs": files, "options": options}


class WorkFolder:
    def __init__(self, output: Path, job: dict, restart: bool) -> None:
        self.root = output.parent / f".{output.name}.preprocess"
        self.output = output
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.root / "lock", "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise DataError(f"{output}: another preprocess run is writing it (work folder "
                            f"{self.root}); wait for it to finish") from None
        self.resumed = self._adopt(job, restart)
        for name in FOLDERS:
            (self.root / name).mkdir(exist_ok=True)

    def _adopt(self, job: dict, restart: bool) -> bool:
        """Whether earlier work of this same job is here; other work is refused or discarded."""
        path = self.root / "job.json"
        earlier = json.loads(path.read_text()) if path.is_file() else None
        if earlier is not None and earlier != job and not restart:
            raise DataError(f"{self.root}: holds the partial work of a run with "
                            f"{_difference(earlier, job)}; run that same command to finish it, "
                            f"or add --restart to discard it")
        if earlier != job:
            for name in FOLDERS:
                shutil.rmtree(self.root / name, ignore_errors=True)
            write_json(path, job)
            return False
        return True

    @property
    def dataset(self) -> Path:
        return self.root / "dataset"

    def path(self, folder: str, name: str) -> Path:
        return self.root / folder / name

    def record(self, step: str) -> Optional[dict]:
        path = self.root / "done" / f"{step}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def commit(self, step: str, record: dict) -> None:
        write_json(self.root / "done" / f"{step}.json", record)

    def forget(self, prefix: str) -> None:
        """Drop the records of steps named `prefix*` (their work is to be done again)."""
        for path in (self.root / "done").glob(f"{prefix}*.json"):
            path.unlink()

    def finish(self) -> None:
        """Move the dataset into place and remove everything else."""
        if self.output.exists():
            self.output.rmdir()  # empty: checked at the start
        self.dataset.rename(self.output)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self._lock.close()

    def keep_or_discard(self, error: BaseException) -> None:
        """After a failure: a refusal (bad data or options: this command cannot succeed as it
        is) leaves nothing; an interruption (Ctrl-C, a full disk, a lost worker) or a refusal for
        want of disk keeps the work done, for the same command to continue."""
        refused = isinstance(error, UserError) and not isinstance(error, NoDiskSpace)
        if refused or not any((self.root / "done").glob("*.json")):
            self.discard()
            return
        size = sum(self.bytes_on_disk(f) for f in ("runs", "ranges", "dataset"))
        print(f"kept the partial work in {self.root} ({size / 2**20:,.0f} MiB): the same "
              f"command continues from it", file=sys.stderr, flush=True)

    def bytes_on_disk(self, folder: str) -> int:
        return sum(p.stat().st_size for p in (self.root / folder).rglob("*") if p.is_file())


def write_json(path: Path, record: dict) -> None:
    """Whole or not at all: a temporary file, fsync, rename."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _difference(earlier: dict, now: dict) -> str:
    """The first thing that differs between two jobs, as a user would say it."""
    before, after = earlier.get("inputs", []), now["inputs"]
    if [f["path"] for f in before] != [f["path"] for f in after]:
        return f"other inputs ({', '.join(Path(f['path']).name for f in before)})"
    for old, new in zip(before, after):
        if old != new:
            return f"{old['path']} as it was then (it has changed since)"
    for key, value in earlier.get("options", {}).items():
        if now["options"].get(key) != value:
            return f"--{key.replace('_', '-')} {value} (now {now['options'].get(key)})"
    return "other settings"
