"""A checkpoint folder's file names and the config it was written with, without torch: the CLI
and the launcher check a `--checkpoint` before paying for torch and torchrec."""

from __future__ import annotations

from pathlib import Path

from dlrm_hybrid.config import ConfigError

META, CONFIG = "meta.json", "config.yaml"


def checkpoint_config_path(path: Path) -> Path:
    """The resolved config a checkpoint was written with."""
    if not (path / META).exists():
        raise ConfigError(f"--checkpoint: {path} is not a complete checkpoint (no {META}); give a "
                          f"step_<n> folder")
    return path / CONFIG
