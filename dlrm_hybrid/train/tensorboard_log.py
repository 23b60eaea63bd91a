"""TensorBoard event files of a run (`train.tensorboard`), rank 0's: each metrics.jsonl record of
training or evaluation mirrored into scalars, and the placement as text. Fields map to tags
generically (`train/<key>`, `eval/<key>`), so a field added to the records appears unasked."""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Optional

from dlrm_hybrid.config import ConfigError

FOLDER = "tensorboard"  # in the run directory
NOT_SCALARS = ("step", "time")  # the point's x and its wall time


def check_tensorboard(setting: str) -> bool:
    """Whether to write event files: `auto` when the package is installed, `true` insists
    (a one-line error saying how to install it), `false` never. Imports only the package's
    top module (about a millisecond; torch's writer loads the rest)."""
    if setting == "false":
        return False
    try:
        import tensorboard  # noqa: F401
        installed = True
    except ImportError:
        installed = False
    if setting == "true" and not installed:
        raise ConfigError("train.tensorboard: true, but the tensorboard package is not installed; "
                          "install it (.venv/bin/pip install tensorboard) or set "
                          "train.tensorboard=auto or false")
    return installed


class TensorBoardSink:
    """A SummaryWriter in `run_dir/tensorboard`. A run resumed after step `resumed` purges what
    an earlier attempt wrote for the steps it trains again (as `metrics_log.supersede` does for
    metrics.jsonl), so each tag keeps one value per step."""

    def __init__(self, run_dir: Path, placement: str, resumed: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / FOLDER), purge_step=resumed + 1)
        # Markdown: the table keeps its columns in a code block.
        self.writer.add_text("placement", "\n".join("    " + line for line in placement.split("\n")),
                             resumed)
        self.writer.flush()

    def record(self, event: dict) -> None:
        """A training record (it has `loss`) or an evaluation (`val_*` fields): its numeric
        fields; a run's other events (its start, a stop, the target's verdict) are no curves."""
        group = _group(event)
        if group is None:
            return
        for key, value in event.items():
            if key not in NOT_SCALARS and isinstance(value, numbers.Real) \
                    and not isinstance(value, bool):
                self.writer.add_scalar(f"{group}/{key}", value, event["step"],
                                       walltime=event.get("time"))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _group(event: dict) -> Optional[str]:
    if any(key.startswith("val_") for key in event):
        return "eval"
    return "train" if "loss" in event else None
