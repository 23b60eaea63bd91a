"""The config of a torchrun job, checked once before torchrun starts any rank: the CLI's own
argument parser, config loading and validation for the world size the launch asks for, and the
dataset's feature_spec.yaml. A mistake then costs one line and exit 2 in a fraction of a
second, not a line from every rank after torchrun's start and a traceback of its own.
Imports no torch: the ranks pay that."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

CHECKED_COMMANDS = ("train", "eval")
MODULE_FLAGS = ("-m", "--module")
WORLD_FLAGS = {"--nnodes": "nnodes", "--nproc_per_node": "nproc", "--nproc-per-node": "nproc"}


def check_launch(torchrun_args: List[str]) -> None:
    """Raise the UserError the ranks would raise at start, for `torchrun ARGS -m dlrm_hybrid
    train|eval ...`; any other launch is left to torchrun."""
    launch = split_launch(torchrun_args)
    if launch is None or not launch[1] or launch[1][0] not in CHECKED_COMMANDS:
        return
    from dlrm_hybrid.cli import _parser
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.configured_spec import data_spec
    from dlrm_hybrid.train.checkpoint_folder import checkpoint_config_path

    args = _parser().parse_args(launch[1])  # a usage error: argparse's message, exit 2
    config = args.config
    if args.command == "eval" and not config:  # the checkpoint's own, as its ranks read it
        config = str(checkpoint_config_path(Path(args.checkpoint)))
    cfg = load_config(config, args.overrides, world_size(launch[0]) or 1)
    data_spec(cfg.data, cfg.model)  # data.path: a readable feature_spec.yaml


def split_launch(torchrun_args: List[str]) -> Optional[Tuple[List[str], List[str]]]:
    """(torchrun's own arguments, the CLI's) when torchrun runs `-m dlrm_hybrid`, else None."""
    for i, arg in enumerate(torchrun_args[:-1]):
        if arg in MODULE_FLAGS and torchrun_args[i + 1] == "dlrm_hybrid":
            return torchrun_args[:i], torchrun_args[i + 2:]
    return None


def world_size(launcher_args: List[str]) -> Optional[int]:
    """nnodes x nproc_per_node where both are fixed numbers (torchrun's defaults: 1 and 1);
    None where the launch decides (an elastic MIN:MAX, nproc_per_node gpu or auto)."""
    found = {"nnodes": "1", "nproc": "1"}
    for arg, following in zip(launcher_args, launcher_args[1:] + [""]):
        flag, sep, value = arg.partition("=")
        if flag in WORLD_FLAGS:
            found[WORLD_FLAGS[flag]] = value if sep else following
    low, _, high = found["nnodes"].partition(":")
    if not (low.isdigit() and found["nproc"].isdigit()) or high not in ("", low):
        return None
    return int(low) * int(found["nproc"])
