"""`python -m dlrm_hybrid <command>` and the `dlrm-hybrid` console script."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

from dlrm_hybrid import curves, rank_failure
from dlrm_hybrid.config_loading import load_config, world_size_from_env
from dlrm_hybrid.data.criteo import day23, multi_hot, npy_days
from dlrm_hybrid.data.interactions import (first_stage_labels, impression_dataset,
                                           preprocess_interactions)
from dlrm_hybrid.data.criteo import preprocess as criteo_preprocess
from dlrm_hybrid.data.yambda import preprocess as yambda_preprocess
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.graph import commands as pixie_commands
from dlrm_hybrid.output_paths import refuse_overwriting_inputs, require_file_target
from dlrm_hybrid.parallel import dry_run
from dlrm_hybrid.serve import memboost_command, recommend, recommend_tune, retrieve
from dlrm_hybrid.startup import collector_paused
from dlrm_hybrid.threads import apply_thread_defaults
from dlrm_hybrid.train.checkpoint_folder import checkpoint_config_path

FOLLOWER_ERROR_DELAY_S = 3.0


def main(argv: Optional[List[str]] = None) -> None:
    args = _parser().parse_args(argv)
    _quiet_library_noise()
    commands = {"train": run_train, "plan": dry_run.run, "synth": run_synth, "eval": run_eval,
                "export": run_export, "predict": run_predict, "preprocess": run_preprocess,
                "bench": run_bench, "plot": curves.run, "retrieve": retrieve.run,
                "pixie": pixie_commands.run, "recommend": recommend.run,
                "recommend-tune": recommend_tune.run, "memboost": memboost_command.run}
    try:
        commands[args.command](args)
    except UserError as e:
        _fail(str(e))
    except BrokenPipeError:  # `dlrm-hybrid plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        _exit(1)
    except KeyboardInterrupt:  # Ctrl-C where no step boundary is near (training catches it)
        if os.environ.get("RANK", "0") == "0":
            print("interrupted (Ctrl-C)", file=sys.stderr)
        _exit(130)
    except Exception:
        peer = rank_failure.peer_error()  # this rank's collective broke: a peer stopped on it
        if peer is None:
            raise
        rank_failure.record(peer)
        _exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlrm-hybrid", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _config_arguments(commands.add_parser(
        "train", help="train a DLRM (launch with torchrun for several ranks)"))
    dry_run.add_arguments(_config_arguments(commands.add_parser(
        "plan", help="print the embedding placement for a config, no GPU needed")))
    synth = _config_arguments(commands.add_parser(
        "synth", help="write the planted synthetic dataset (the config's data section) to files"))
    synth.add_argument("--output", required=True, help="new dataset folder")
    evaluate = _config_arguments(commands.add_parser(
        "eval", help="AUC and log loss of a checkpoint on a split (default: test); a two_tower "
                  "or hstu checkpoint: recall, HR, NDCG@K and MRR over the whole item corpus"))
    evaluate.add_argument("--checkpoint", required=True, help="a step_<n> checkpoint folder")
    evaluate.add_argument("--split", default="test", choices=("test", "val"))
    export = commands.add_parser(
        "export", help="a checkpoint as a served model: one TorchScript file (+ its .json)")
    export.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="change the checkpoint's config, e.g. "
                        "--set data.path=DIR where its dataset has moved (repeatable)")
    export.add_argument("--checkpoint", required=True, help="a step_<n> checkpoint folder")
    export.add_argument("--out", required=True, help="file to write, e.g. model.pt")
    export.add_argument("--quantize", default="fp32", metavar="fp32|fp16|int8|int4",
                        help="embedding tables' precision (row-wise int8/int4; default fp32)")
    export.add_argument("--quantize-table", dest="table_overrides", action="append", default=[],
                        metavar="TABLE=PRECISION", help="another precision for one table, e.g. "
                        "t_cat_0=int4 (repeatable)")
    export.add_argument("--state-dict", action="store_true", help="write the unsharded fp32 "
                        "state dict (torch.save) instead, e.g. to fine-tune elsewhere")
    export.add_argument("--retrieval", action="store_true", help="a two_tower or hstu "
                        "checkpoint: write the folder --out (user tower, item vectors, FAISS "
                        "index) `retrieve` reads")
    export.add_argument("--index", metavar="flat|ivf|hnsw", help="--retrieval's index: exact "
                        "(flat, the default), inverted lists (ivf) or a graph (hnsw)")
    for flag, what in (("--nlist", "ivf: lists (default sqrt(items))"),
                       ("--nprobe", "ivf: lists a query scans (default 8)"),
                       ("--hnsw-m", "hnsw: links per node (default 32)"),
                       ("--ef-construction", "hnsw: candidates per insertion (default 200)"),
                       ("--ef-search", "hnsw: candidates per search (default 64)")):
        export.add_argument(flag, type=int, help=what)
    predict = commands.add_parser(
        "predict", help="score a split-binary dataset or a CSV/TSV with an exported model")
    predict.add_argument("--model", required=True, help="a file `export` wrote")
    predict.add_argument("--data", required=True,
                         help="a split-binary folder, or a .csv/.tsv file of preprocessed rows "
                         "(or of raw Criteo rows: --raw-criteo)")
    predict.add_argument("--split", default="test", choices=("test", "val", "train"),
                         help="which split of a split-binary folder (default test)")
    predict.add_argument("--out", required=True, help="file to write, one probability per line "
                         "(several tasks or a value model: a CSV, each task's, then the value)")
    predict.add_argument("--batch-size", type=int, default=4096, help="rows per call (4096)")
    predict.add_argument("--header", default="auto", choices=("auto", "yes", "no"),
                         help="CSV/TSV: is the first line a header (auto: only when it is not "
                         "numbers); a header's names (label, num_<i>, cat_<i>) place the columns")
    predict.add_argument("--raw-criteo", metavar="DATASET", default="",
                         help="--data is raw Criteo TSV (label first or none; .gz ok): map its "
                         "values to ids with the vocabulary of DATASET, the model's training data")
    predict.add_argument("--value", default="", metavar="TASK=W,...", help="value model weights "
                         "in place of the exported value_model, e.g. click=1,like=0.5 (tasks "
                         "left out weigh 0)")
    predict.add_argument("--top-k-label", type=int, default=0, metavar="K", help="also write "
                         "--label-out: 1 for each row among its request's K of highest value")
    predict.add_argument("--label-out", default="", metavar="FILE", help="--top-k-label's file, "
                         "one 0/1 per row in row order")
    predict.add_argument("--request-feature", default="", metavar="NAME", help="the categorical "
                         "feature whose id names a row's request (all its rows); default: "
                         "the dataset's metadata.request_feature")
    retrieve.add_arguments(commands.add_parser(
        "retrieve", help="top-K items for a user (or a history) from an `export --retrieval` "
                         "folder"))
    pixie_commands.add_arguments(commands.add_parser(
        "pixie", help="Pixie random walks: build the item-user graph of an interaction dataset, "
                      "query it"))
    recommend.add_arguments(commands.add_parser(
        "recommend", help="a user's top K: candidates (two-tower, history, Pixie), ranked by a "
                          "multi-task model and its value model, filtered by rules"))
    recommend_tune.add_arguments(commands.add_parser(
        "recommend-tune", help="choose the funnel's merge weights, ranker, value model and "
                               "priors on validation; write the settings `recommend --settings` "
                               "reads"))
    memboost_command.add_arguments(commands.add_parser(
        "memboost", help="Memboost: impression logs into position-corrected engagement "
                         "statistics per (query, item); show them"))
    bench = _config_arguments(commands.add_parser(
        "bench", help="training speed in one process vs a reference-style baseline"))
    bench.add_argument("--steps", type=int, default=60, help="timed steps (default 60)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    bench.add_argument("--peers", nargs="+", choices=("reference", "torchrec", "none"),
                       help="what to time beside ours on the same batches (default: the "
                            "reference, and torchrec's own stack where torchrec's DLRM can "
                            "model the config); none: ours alone (a model only ours fits)")
    bench.add_argument("--profile", metavar="DIR",
                       help="also print the step's top kernels (ops on a CPU) with the FLOP/s or "
                            "GB/s each achieved, and write the profile's trace to DIR")
    curves.add_arguments(commands.add_parser(
        "plot", help="draw runs' loss and AUC against steps and time (from metrics.jsonl)"))
    formats = commands.add_parser("preprocess", help="raw click logs -> split-binary dataset"
                                  ).add_subparsers(dest="format", required=True)
    criteo_preprocess.add_arguments(formats.add_parser(
        "criteo", help="Criteo TSV (Kaggle or 1TB, .gz ok)"))
    npy_days.add_arguments(formats.add_parser("npy", help="torchrec/MLPerf day_N_*.npy files"))
    multi_hot.add_arguments(formats.add_parser(
        "multihot", help="MLPerf DLRM-DCNv2's multi-hot variant of a one-hot split-binary dataset"))
    day23.add_arguments(formats.add_parser(
        "day23", help="make day 23's first half validation, as MLPerf does, in a dataset "
                      "split the earlier way (in place)"))
    preprocess_interactions.add_arguments(formats.add_parser(
        "interactions", help="interaction logs (MovieLens, CSV/TSV) -> a retrieval dataset "
                             "(model.kind two_tower), or with --labels a ranking dataset"))
    impression_dataset.add_arguments(formats.add_parser(
        "impressions", help="impression logs (docs/memboost.md) -> a ranking dataset of what "
                            "was shown, with Memboost's statistics before each row as features"))
    first_stage_labels.add_arguments(formats.add_parser(
        "first-stage", help="a first-stage ranker's two-tower dataset: the heavy ranker's top-K "
                            "labels (predict --top-k-label) as its training engagements"))
    yambda_preprocess.add_arguments(formats.add_parser(
        "yambda", help="Yambda's flat parquet log -> a ranking dataset (one row per listen, "
                       "label listen_plus, split in time, --history L); --generate N: a "
                       "synthetic Yambda-shaped log"))
    return parser


def _config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", help="YAML config; defaults apply to keys it leaves out")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set train.max_steps=40 (repeatable)")
    return parser


def run_train(args) -> None:
    from dlrm_hybrid.train.tensorboard_log import check_tensorboard

    cfg = load_config(args.config, args.overrides, world_size=world_size_from_env())
    record = Path(cfg.train.run_dir) / "config.yaml"
    if (args.config and record.exists() and os.path.samefile(args.config, record)
            and not (record.parent / "metrics.jsonl").exists()):  # not an earlier run's record
        raise UserError(f"train.run_dir: {cfg.train.run_dir} holds --config {args.config}, and a "
                        f"run writes its resolved config.yaml there; keep yours elsewhere, or use "
                        f"another train.run_dir")
    check_tensorboard(cfg.train.tensorboard)  # `true` without the package: before any work
    if cfg.data.loader == "dali":  # likewise `dali` without DALI (its module imports torch)
        from dlrm_hybrid.data.dali_loader import check_dali
        check_dali(cfg.data.loader)

    def job(env) -> None:
        # after the config check and the process group's own (nccl without GPUs):
        # torchrec takes seconds to import
        with collector_paused():
            from dlrm_hybrid.train.loop import train

        train(cfg, env)

    run_distributed(job, cfg.parallel.backend)


def run_eval(args) -> None:
    checkpoint_config_path(Path(args.checkpoint))  # before torchrec's seconds of import
    with collector_paused():
        from dlrm_hybrid.train.inference import evaluate_checkpoint

    run_distributed(lambda env: evaluate_checkpoint(args.checkpoint, args.config, args.overrides,
                                                    env, args.split))


def run_export(args) -> None:
    checkpoint_config_path(Path(args.checkpoint))  # before torch's seconds of import
    index_settings = {name: getattr(args, name) for name in INDEX_SETTINGS
                      if getattr(args, name) is not None}
    if args.retrieval:
        return run_retrieval_export(args, index_settings)
    if args.index or index_settings:
        raise UserError("export: --index and its settings are for --retrieval (a two_tower "
                        "or hstu checkpoint)")
    with collector_paused():
        from dlrm_hybrid.serve.export import description_path, export_model
        from dlrm_hybrid.train.inference import export_checkpoint

    outputs = [("--out", args.out)]
    if not args.state_dict:
        outputs.append(("--out's description", str(description_path(Path(args.out)))))
    refuse_overwriting_inputs(outputs, [("--checkpoint", args.checkpoint)], "export")
    if args.state_dict:
        if args.quantize != "fp32" or args.table_overrides:
            raise UserError("export: --state-dict writes the fp32 weights for training; "
                            "--quantize and --quantize-table are for the served model")
        require_file_target("--out", args.out)

        count = export_checkpoint(args.checkpoint, args.out)
        print(f"wrote {args.out}: {count} tensors, an unsharded state dict (torch.load it with "
              f"weights_only=True into dlrm_hybrid.model.dlrm.build_model(...))")
        return
    description = export_model(args.checkpoint, args.out, args.quantize, args.table_overrides,
                               args.overrides)
    tables = sum(t["bytes"] for t in description["tables"])
    fp32 = sum(4 * t["rows"] * t["dim"] for t in description["tables"])
    print(f"wrote {args.out} ({os.path.getsize(args.out):,} bytes, TorchScript; embedding tables "
          f"{args.quantize}: {tables:,} bytes, {tables / fp32:.1%} of fp32) and "
          f"{description_path(Path(args.out))}; load: import torch, fbgemm_gpu; "
          f"model = torch.jit.load('{args.out}')")


INDEX_SETTINGS = ("nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search")


def run_retrieval_export(args, index_settings: dict) -> None:
    if args.state_dict or args.quantize != "fp32" or args.table_overrides:
        raise UserError("export: --retrieval writes fp32 vectors and an index; --state-dict, "
                        "--quantize and --quantize-table are for the ranker")
    refuse_overwriting_inputs([("--out", args.out)], [("--checkpoint", args.checkpoint)], "export")
    from dlrm_hybrid.retrieval.index import index_params
    from dlrm_hybrid.serve.retrieval_export import export_retrieval

    params = index_params(args.index or "flat", index_settings)
    description = export_retrieval(args.checkpoint, args.out, params, args.overrides)
    index = description["index"]
    settings = ", ".join(f"{k}={v}" for k, v in index.items() if k != "kind")
    print(f"wrote {args.out}: user tower, {description['items']:,} item vectors "
          f"({description['dim']} wide), {index['kind']} index{f' ({settings})' if settings else ''}"
          f"; retrieve --model {args.out} --user USER")


def run_predict(args) -> None:
    with collector_paused():
        from dlrm_hybrid.serve.export import description_path
        from dlrm_hybrid.serve.predict import predict

    if args.batch_size < 1:
        raise UserError("predict: --batch-size must be at least 1")
    refuse_overwriting_inputs([("--out", args.out), ("--label-out", args.label_out)],
                              [("--model", args.model), ("--data", args.data),
                               ("--model's description", str(description_path(Path(args.model)))),
                               ("--raw-criteo", args.raw_criteo)], "predict")
    result = predict(args.model, args.data, args.out, args.split, args.batch_size, args.header,
                     args.raw_criteo, args.value, args.top_k_label, args.label_out,
                     args.request_feature)
    value = result.pop("value_model", None)
    metrics = "".join(f" {k}={v:.5f}" for k, v in result.items() if k != "samples")
    if value is not None:
        metrics += " value_model=" + (",".join(f"{k}:{v:g}" for k, v in value.items()) or "none")
    labels = f" and {args.label_out}" if args.label_out else ""
    print(f"predict: wrote {args.out}{labels} samples={result['samples']}{metrics}")


def run_synth(args) -> None:
    from dlrm_hybrid.data.synth_dataset import write_synthetic

    refuse_overwriting_inputs([("--output", args.output)], [("--config", args.config)], "synth")
    cfg = load_config(args.config, args.overrides)
    if cfg.model.kind == "two_tower":  # the planted interaction log, as training generates it
        from dlrm_hybrid.data.interactions.interaction_data import write_interactions
        from dlrm_hybrid.data.interactions.planted_interactions import planted_interactions

        data = planted_interactions(cfg.data)
        write_interactions(data, args.output)
        counts = {split: data.num_samples(split) for split in data.pairs}
    else:
        counts = write_synthetic(cfg.data, args.output, [t.name for t in cfg.model.tasks])
    print(f"wrote {args.output}: " + ", ".join(f"{split} {n:,}" for split, n in counts.items()))


def run_preprocess(args) -> None:
    if getattr(args, "seed", 0) < 0:  # numpy's generators take none (a traceback, not a line)
        raise UserError(f"--seed: 0 or more, got {args.seed}")
    # day23: in place; first-stage, impressions and yambda: their own inputs and check
    if args.format not in ("day23", "first-stage", "impressions", "yambda"):
        inputs = args.input if isinstance(args.input, list) else [args.input]
        refuse_overwriting_inputs([("--output", args.output)], [("--input", p) for p in inputs],
                                  f"preprocess {args.format}")
    {"criteo": criteo_preprocess, "npy": npy_days, "multihot": multi_hot,
     "day23": day23, "interactions": preprocess_interactions,
     "first-stage": first_stage_labels, "impressions": impression_dataset,
     "yambda": yambda_preprocess}[args.format].run(args)


def run_bench(args) -> None:
    with collector_paused():
        from dlrm_hybrid.bench.kernels import check_profile_dir
        from dlrm_hybrid.bench.run import ROUNDS, bench, default_peers
        from dlrm_hybrid.bench.torchrec_peer import require_torchrec_shape

    if world_size_from_env() > 1:
        raise UserError("bench: runs in one process (ours and the baseline side by side); for "
                        "several ranks use benchmarks/train_throughput.py")
    if args.steps < ROUNDS or args.warmup < 1:
        raise UserError(f"bench: --steps must be at least {ROUNDS} and --warmup at least 1")
    cfg = load_config(args.config, args.overrides)
    if cfg.model.kind != "dlrm":
        peer = {"hstu": "sequential_speed.py"}.get(cfg.model.kind, "retrieval.py")
        raise UserError(f"bench: measures the ranker (model.kind dlrm) against its baseline; for "
                        f"{cfg.model.kind} use benchmarks/{peer}")
    if cfg.model.tasks:
        raise UserError("bench: its baseline is a one-logit DLRM, and model.tasks names "
                        f"{len(cfg.model.tasks)} tasks; benchmarks/multitask.py measures the cost "
                        "of each task per step")
    profile_dir = check_profile_dir(args.profile) if args.profile else None
    if args.peers and "none" in args.peers and len(args.peers) > 1:
        raise UserError(f"bench --peers: none means ours alone; it cannot go with "
                        f"{', '.join(p for p in args.peers if p != 'none')}")
    peers = default_peers(cfg) if not args.peers else [p for p in args.peers if p != "none"]
    if "torchrec" in peers:
        require_torchrec_shape(cfg.model)
    run_distributed(lambda env: bench(cfg, env, args.steps, args.warmup, profile_dir, peers),
                    cfg.parallel.backend)


def run_distributed(job, backend: str = "auto") -> None:
    """Run `job(env)` in the process group torchrun started (or a one-process group), with
    this rank's share of the host's cores unless OMP_NUM_THREADS says otherwise (threads.py)."""
    apply_thread_defaults(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    with collector_paused():
        from dlrm_hybrid.parallel.host_memory import keep_freed_memory
        from dlrm_hybrid.parallel.process_group import init_distributed, shutdown
        from dlrm_hybrid.train.stop_request import RunStopped

    keep_freed_memory()
    env = init_distributed(backend)
    try:
        job(env)
    except RunStopped as stopped:  # on a signal, after its checkpoint and its line
        shutdown()
        _exit(stopped.exit_code)
    except BaseException:
        shutdown(finished=False)
        raise
    shutdown()
    _exit(0)


def _exit(code: int) -> None:
    """Leave without interpreter teardown: about one 2-rank run in 30 here had a rank abort
    after a complete run, and a run stopped by an error after the process group existed aborted
    often ("terminate called without an active exception": C++ threads of the distributed
    stack destroyed during finalization, cf. pytorch PR 179291), turning exit code 2 into 134.
    Files are written and flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(message: str) -> None:
    """Under torchrun every rank usually hits the same error: rank 0 says it at once; another
    rank waits a moment first, so that when rank 0 failed too torchrun stops this rank before it
    repeats it (and a rank's own error, e.g. a file only its host lacks, is still said)."""
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        time.sleep(FOLLOWER_ERROR_DELAY_S)
    line = f"error: {message}" if rank == "0" else f"error (rank {rank}): {message}"
    print(line, file=sys.stderr)
    rank_failure.record(line)  # for the launcher (dlrm_hybrid.torchrun)
    _exit(2)


def _quiet_library_noise() -> None:
    """torchrec/torch notices that say nothing to a user of this tool."""
    warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor.*", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    # Replicated (data_parallel) tables: torchrec warns once per table that they have no cache,
    # and torch that fbgemm's dense lookup backpropagates through its fallback kernel (its
    # gradients equal a sharded table's: tests/test_replicated.py).
    logging.getLogger("torchrec.distributed.utils").addFilter(
        lambda record: "caching params will be ignored" not in record.getMessage())
    warnings.filterwarnings("ignore", message="fbgemm::dense_embedding_codegen_lookup_function: "
                            "an autograd kernel was not registered", category=UserWarning)
