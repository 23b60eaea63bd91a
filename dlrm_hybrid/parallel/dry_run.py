"""`python -m dlrm_hybrid plan`: the placement training would use, computed without a GPU or a
process group, printed, compared across strategies, saved and plotted."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, List, Optional

from dlrm_hybrid.config import RETRIEVAL_KINDS, ConfigError, parse_bytes

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.configured_spec import data_spec
from dlrm_hybrid.data.interactions.interaction_meta import ITEM_ID, USER_ID
from dlrm_hybrid.data.interactions.ranking_history import history_features
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.parallel.attention_memory import describe_attention
from dlrm_hybrid.parallel.dense_memory import all_modes, describe_dense
from dlrm_hybrid.parallel.exchange_bytes import describe_exchange
from dlrm_hybrid.parallel.cost_model import DEVICES, device_constants
from dlrm_hybrid.parallel.greedy_search import STRATEGIES, plan_tables, search_rules
from dlrm_hybrid.parallel.plan_file import save_plan
from dlrm_hybrid.model.compositional import lookups_of
from dlrm_hybrid.output_paths import refuse_overwriting_inputs, require_file_target
from dlrm_hybrid.parallel.plan_report import (compare, describe, describe_lookups,
                                              describe_towers, explain_table, plot, plot_format)
from dlrm_hybrid.parallel.tables import table_specs

DEFAULT_GPU_MEMORY = "80GiB"


def add_arguments(parser) -> None:
    """The plan options (the CLI adds --config and --set: tables, dims, optimizer, batch)."""
    parser.add_argument("--world-size", type=int, default=8, help="ranks (default 8)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="ranks per host: balance hosts too and group the printout by host")
    parser.add_argument("--gpu-memory", default=None,
                        help="memory per rank, e.g. 80GiB (default: parallel.memory_per_rank, "
                             f"or {DEFAULT_GPU_MEMORY} where that is auto)")
    parser.add_argument("--cardinalities", help="text file of table row counts (comma or newline "
                                                "separated) replacing the config's tables")
    parser.add_argument("--strategy", choices=STRATEGIES, default=None,
                        help="default: parallel.strategy")
    parser.add_argument("--compare", action="store_true", help="print every strategy side by side")
    parser.add_argument("--out", help="write the plan as JSON (train with --set parallel.plan=FILE)")
    parser.add_argument("--plot", help="write a bar chart of per-rank memory and all-to-all (PNG)")
    parser.add_argument("--device", choices=sorted(DEVICES), default=None,
                        help="what the cost model assumes (default: parallel.device; h100 where "
                             "that is auto)")
    parser.add_argument("--explain", metavar="TABLE",
                        help="print each way to shard TABLE with its modeled step time")


def run(args) -> None:
    if args.world_size < 1:
        raise ConfigError(f"--world-size: {args.world_size} must be at least 1")
    if args.gpus_per_node is not None and (
            args.gpus_per_node < 1 or args.world_size % args.gpus_per_node):
        raise ConfigError(f"--gpus-per-node: {args.gpus_per_node} must be positive and divide "
                          f"--world-size {args.world_size}")
    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    _check_outputs(args, cfg.data.path)
    if args.cardinalities:
        cfg.data.path = ""  # the file's tables replace the dataset's as well as the config's
        cfg.data.cardinalities = read_cardinalities(args.cardinalities)
        cfg.data.hotness = _hotness_for(cfg.data.hotness, len(cfg.data.cardinalities))
    memory = parse_bytes(args.gpu_memory or _config_memory(cfg), "--gpu-memory")
    budget = memory - parse_bytes(cfg.parallel.reserve_per_rank, "parallel.reserve_per_rank")
    if budget <= 0:
        raise ConfigError(f"--gpu-memory: {args.gpu_memory} is not more than "
                          f"parallel.reserve_per_rank ({cfg.parallel.reserve_per_rank})")
    spec = planned_spec(cfg)
    lookups = lookups_of(cfg.model, spec)  # once: 10,000 features' take ~0.03 s
    specs = table_specs(cfg, spec, lookups)
    if args.explain and args.explain not in {t.name for t in specs}:
        raise ConfigError(f"--explain: no table {args.explain}; the plan printout (without "
                          f"--explain) lists the names")
    setting = cfg.parallel.device
    device = device_constants(args.device or ("h100" if setting == "auto" else setting),
                              cfg.parallel.cost_model)
    strategies = STRATEGIES if args.compare else (args.strategy or cfg.parallel.strategy,)
    plans = [plan_tables(specs, args.world_size, budget, cfg.data.global_batch_size, s,
                         args.gpus_per_node, device, **search_rules(cfg))
             for s in strategies]
    if args.explain:
        print(explain_table(plans[0], args.explain, **search_rules(cfg)))
        return
    towers = lookups if cfg.model.kind in RETRIEVAL_KINDS else []
    for plan in plans:
        print(describe(plan) + "\n")
        if towers:
            print(describe_towers(plan, towers, cfg.model.kind) + "\n")
    print(describe_exchange(plans[0], cfg) + "\n")
    print(describe_dense(cfg, spec, args.world_size, args.gpus_per_node) + "\n")
    dense = all_modes(cfg, spec, args.world_size, args.gpus_per_node or args.world_size)
    attention = describe_attention(cfg, args.world_size, memory - int(plans[0].loads[0].max())
                                   - dense[cfg.parallel.dense].total)
    if attention:
        print(attention + "\n")
    replaced = describe_lookups(lookups, cfg)
    if replaced:
        print(replaced + "\n")
    if args.compare:
        print(compare(plans))
    if args.out:
        _write("--out", args.out, lambda path: save_plan(plans[0], path))
        print(f"wrote {args.out} ({plans[0].strategy})")
    if args.plot:
        _write("--plot", args.plot, lambda path: plot(plans, path))
        print(f"wrote {args.plot}")


def planned_spec(cfg) -> DataSpec:
    """The configured data's shape (configured_spec.data_spec); for a sequence ranker without a
    dataset, the one `preprocess interactions --history L` or `preprocess yambda --history L`
    would write, L = model.hstu.max_length, from data.cardinalities = [users, items, action
    rows]: user_id, item_id, L history slots of items, L of actions."""
    if cfg.model.sequence == "none" or cfg.data.path:
        return data_spec(cfg.data, cfg.model)
    if len(cfg.data.cardinalities) != 3:
        raise ConfigError(f"model.sequence: hstu reads each row's history, which the planted "
                          f"click data has not; set data.path to a ranking dataset made by "
                          f"`preprocess interactions --labels ... --history L`, or, to plan "
                          f"without one, data.cardinalities to [users, items, action rows] (not "
                          f"{cfg.data.cardinalities})")
    users, items, actions = cfg.data.cardinalities
    length = cfg.model.hstu.max_length
    names = (USER_ID, ITEM_ID, *history_features(length))
    return DataSpec(cfg.data.num_dense, [users, items, *[items] * length, *[actions] * length],
                    [1] * len(names), names=names)


def _check_outputs(args, data_path: str) -> None:
    """Before any work: --out and --plot can be written and replace none of the inputs."""
    outputs = [("--out", args.out), ("--plot", args.plot)]
    for flag, path in outputs:
        if path:
            require_file_target(flag, path)
    if args.plot:
        plot_format(args.plot)
    if args.out and args.plot and os.path.realpath(args.out) == os.path.realpath(args.plot):
        raise ConfigError(f"--plot: {args.plot} is --out {args.out}; give them different names")
    refuse_overwriting_inputs(outputs, [("--config", args.config), ("--cardinalities",
                              args.cardinalities), ("data.path", data_path)], "plan")


def _write(flag: str, path: str, write: Callable[[Path], None]) -> None:
    try:
        write(Path(path))
    except OSError as e:
        raise ConfigError(f"{flag}: cannot write {path} ({e.strerror})") from None


def read_cardinalities(path: str) -> List[int]:
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a spreadsheet's BOM
    except OSError as e:
        raise ConfigError(f"--cardinalities: cannot read {path} ({e.strerror})")
    except UnicodeDecodeError:
        raise ConfigError(f"--cardinalities: {path} is not text (UTF-8); give a text file of "
                          f"table row counts") from None
    tokens = [t for t in re.split(r"[,\s]+", text) if t]
    bad = [t for t in tokens if not (t.isascii() and t.isdigit()) or int(t) == 0]
    if bad or not tokens:
        raise ConfigError(f"--cardinalities: {path} must hold positive integers separated by "
                          f"commas or newlines; found {bad[0] if bad else 'nothing'!r}")
    return [int(t) for t in tokens]


def _hotness_for(hotness: List[int], tables: int) -> List[int]:
    if len(hotness) not in (1, tables):
        raise ConfigError(f"data.hotness: {len(hotness)} values for {tables} tables from "
                          f"--cardinalities; give one value or one per table")
    return hotness


def _config_memory(cfg) -> Optional[str]:
    memory = cfg.parallel.memory_per_rank
    return DEFAULT_GPU_MEMORY if memory.strip().lower() == "auto" else memory
