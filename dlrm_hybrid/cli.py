"""`python -m dlrm_hybrid <command>` and the `dlrm-hybrid` console script."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from typing import List, Optional

from dlrm_hybrid.config import ConfigError, load_config
from dlrm_hybrid.parallel import dry_run
from dlrm_hybrid.parallel.placement import PlacementError

USER_ERRORS = (ConfigError, PlacementError)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="dlrm-hybrid", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a DLRM (launch with torchrun for several ranks)")
    train.add_argument("--config", help="YAML config; defaults apply to keys it leaves out")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.max_steps=40 (repeatable)")
    plan = commands.add_parser("plan", help="print the embedding placement for a config, no GPU needed")
    dry_run.add_arguments(plan)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            run_train(args.config, args.overrides)
        else:
            dry_run.run(args)
    except USER_ERRORS as e:
        _fail(str(e))


def run_train(config_path: Optional[str], overrides: List[str]) -> None:
    from dlrm_hybrid.parallel.process_group import init_distributed, shutdown, world_size_from_env

    cfg = load_config(config_path, overrides, world_size=world_size_from_env())
    _quiet_library_noise()
    from dlrm_hybrid.train.loop import train

    env = init_distributed(cfg.parallel.backend)
    try:
        train(cfg, env)
    except BaseException:
        shutdown(finished=False)
        raise
    shutdown()


def _fail(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank hits it: say it once
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _quiet_library_noise() -> None:
    """torchrec/torch notices that say nothing to a user of this tool."""
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
