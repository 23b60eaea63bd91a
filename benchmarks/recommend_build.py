"""What benchmarks/recommend.py measures, built: the datasets, two-tower models, multi-task
rankers and graphs (`build`), and the first-stage ranker of the chosen heavy ranker
(`build_first_stage`), the validation world's log (`validation_log`), and the history a request
asks with (`asked_history`). Each part is named by the settings it depends on, inside a folder
named by the log it is made of (`log_folder`: a digest of the file's bytes), so a `--work`
folder keeps several, a later run makes only what its settings change, and another log never
reads what an earlier log made."""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402

import retrieval as retrieval_bench  # noqa: E402  (its BASE, cli)
import sequential  # noqa: E402  (its HSTU BASE and write_config)

LABELS = "watched,liked:rating>=4,disliked:rating<=2"
TASKS = "[{name: watched}, {name: liked, head: [16]}, {name: disliked, head: [16]}]"
VALUE = {"watched": 0.5, "liked": 1.0, "disliked": -2.0}  # the rankers' exported value model
TOWER = {"model.temperature": 0.2, "optim.embedding_lr": 0.05}
# --tower hstu: sequential.py's choice on ml-100k, without the time bias (a request's history,
# the validation item included, comes without times)
HSTU_FUNNEL = {"model.hstu.max_length": 50, "model.hstu.dropout": 0.5,
               "model.hstu.time_buckets": 0}


def log_folder(scratch: Path, data: str) -> Path:
    """Where `scratch` keeps what is made of the log `data`: log_<the first 16 hex digits of
    the BLAKE2b of its bytes> (5 s a GB on a 2-core EPYC), so a copy of the same log reuses
    it and another log (even under the same name, size and time) does not."""
    try:
        with open(data, "rb") as f:
            digest = hashlib.file_digest(f, "blake2b").hexdigest()[:16]
    except OSError as e:
        raise SystemExit(f"error: --data {data}: cannot read ({e.strerror})") from None
    return Path(scratch) / f"log_{digest}"


def train_tower(args, data: str, scratch: Path, name: str, sequence: bool = False) -> str:
    """The two-tower model of `data` (with `sequence`, the sequence model, HSTU) trained and
    exported (exact index): its folder (kept where --work already has it)."""
    cli = retrieval_bench.cli
    if (scratch / name).is_dir():
        return str(scratch / name)
    config = scratch / f"{name}.yaml"
    if sequence:
        epochs, per_epoch = args.hstu_epochs, hstu_config(config, data, args.hstu_epochs)
    else:
        train = len(np.load(Path(data) / "train_user.npy"))
        epochs = args.epochs
        per_epoch = retrieval_bench.write_config(config, {"path": data}, epochs, train, TOWER)
    start = time.perf_counter()
    cli(["train", "--config", str(config), "--set", f"train.run_dir={scratch / (name + '_run')}"])
    steps = max(1, epochs * per_epoch)
    print(f"  {name}: {epochs} epochs ({steps} steps) in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    cli(["export", "--retrieval", "--checkpoint", str(scratch / f"{name}_run/checkpoints" /
                                                       f"step_{steps}"),
         "--out", str(scratch / name)])
    return str(scratch / name)


def hstu_config(path: Path, data: str, epochs: int) -> int:
    """benchmarks/sequential.py's HSTU with its ml-100k choice (HSTU_FUNNEL) for `epochs` on
    `data`, written to `path`; returns the steps per epoch."""
    import yaml

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import open_dataset

    sequential.write_config(path, {"path": data}, HSTU_FUNNEL, 1, 1, 0)
    cfg = load_config(str(path))
    windows = open_dataset(cfg.data, cfg.model).num_samples("train")
    per_epoch = -(-windows // cfg.data.global_batch_size)
    sequential.write_config(path, {"path": data}, HSTU_FUNNEL, epochs, per_epoch, 0)
    written = yaml.safe_load(path.read_text())
    written["train"]["eval_every"] = 0  # the funnel evaluates; training needs no validation
    written["checkpoint"]["keep"] = 1
    path.write_text(yaml.safe_dump(written, sort_keys=False))
    return per_epoch


def train_ranker(args, ranking: str, scratch: Path, loss: str, steps: int) -> str:
    """The multi-task ranker of configs/multitask_demo.yaml on `ranking`, with the ranking
    loss `loss` (pointwise: none), `steps` steps, exported: its file (kept where --work already
    has it)."""
    cli, name = retrieval_bench.cli, f"{Path(ranking).name}_{loss}_{steps}"
    if (scratch / f"{name}.pt").is_file():
        return str(scratch / f"{name}.pt")
    start = time.perf_counter()
    half = steps // 2
    sets = [f"data.path={ranking}", f"model.tasks={TASKS}", "data.label_missing=0",
            "value_model={" + ", ".join(f"{t}: {w}" for t, w in VALUE.items()) + "}",
            f"train.max_steps={steps}", "train.eval_every=0", f"train.log_every={steps}",
            f"optim.warmup_steps={min(20, half)}", f"optim.decay_start_step={half}",
            f"optim.decay_steps={steps - half}", "train.progress_bar=false",
            "train.tensorboard=false", f"train.run_dir={scratch / (name + '_run')}"]
    if args.ranker_history:  # the dataset carries the histories: the sequence feature reads them
        sets += ["model.sequence=hstu"]
    if loss != "pointwise":
        sets += [f"model.ranking_loss.kind={loss}",
                 f"model.ranking_loss.group={1 + args.negatives}"]
    cli(["train", "--config", str(ROOT / "configs/multitask_demo.yaml"),
         *[a for s in sets for a in ("--set", s)]])
    print(f"  ranker ({loss}): {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    cli(["export", "--checkpoint", str(scratch / f"{name}_run/checkpoints" / f"step_{steps}"),
         "--out", str(scratch / f"{name}.pt")])
    return str(scratch / f"{name}.pt")


def validation_log(data: str, scratch: Path) -> str:
    """The validation world's log (u.data in `scratch`'s folder of `data`, `log_folder`; kept
    where it is already): `data` without each test user's last positive (rating >= 4, by time
    then file order: the retrieval dataset's test item) and every later row of that user, so
    that its test item is the real validation item and every model built from it stops where
    the test world's stop before the test item. Users with fewer than 3 positives (no test
    item) keep every row. A row equal to an earlier one in every column is no positive of its
    own (the datasets keep one copy: interaction_split.duplicate_rows)."""
    from dlrm_hybrid.data.interactions.interaction_log import read_log
    from dlrm_hybrid.data.interactions.interaction_split import SHORT, duplicate_rows

    out = log_folder(scratch, data) / "u.data"
    if out.is_file():
        return str(out)
    log = read_log([data])
    if "rating" not in log.columns or "timestamp" not in log.columns:
        raise SystemExit(f"{data}: the benchmark needs a log with ratings and timestamps")
    users = np.unique(log.columns["user"], return_inverse=True)[1]
    rows = np.arange(len(users))
    order = np.lexsort((rows, log.columns["timestamp"]))  # oldest first, ties: file order
    position = np.empty_like(order)
    position[order] = rows
    positive = (log.columns["rating"] >= 4) & ~duplicate_rows(log)
    last = np.full(users.max() + 1, -1)  # each user's last positive, in time order
    np.maximum.at(last, users[positive], position[positive])
    last[np.bincount(users[positive], minlength=len(last)) < SHORT] = len(rows)  # no test item
    keep = position < last[users]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".part"), "w", encoding="utf-8") as f:
        for r in np.flatnonzero(keep).tolist():
            f.write("\t".join((log.columns["user"][r].decode("utf-8"),
                               log.columns["item"][r].decode("utf-8"),
                               f"{log.columns['rating'][r]:g}",
                               f"{log.columns['timestamp'][r]:.0f}")) + "\n")
    out.with_suffix(".part").rename(out)
    return str(out)


def build(args, scratch: Path, data: str = "") -> Dict[str, str]:
    """The datasets, the models exported and the graphs of the log `data` (default
    args.data): {what: path}; `ranker_<loss>_<steps>` for each of args.losses and
    args.ranker_steps. Each is named by the settings it depends on, in `scratch`'s (--work)
    folder of the log (`log_folder`), and kept where that already has it, so a second run with
    other ranker settings makes only what they change, and a run on another log makes all."""
    cli, k, data = retrieval_bench.cli, args.holdout_recent, data or args.data
    scratch = log_folder(scratch, data)
    kind = (f"{k}_{tower_name(args)}_{args.negatives}_{args.candidate_ratio:g}_sim"  # similarity
            if args.ranker_data == "candidates"
            else f"uniform_{args.negatives}") + (f"_h{args.ranker_history}"
                                                  if args.ranker_history else "")
    out = {name: str(scratch / folder) for name, folder in (
        ("retrieval", "retrieval"), ("early", f"early_{k}"), ("ranking", f"ranking_{kind}"),
        ("graph", "graph"), ("early_graph", f"early_graph_{k}"))}

    def make(what: str, command: List[str], done: str) -> None:
        if not (Path(out[what]) / done).is_file():
            cli(command)

    make("retrieval", ["preprocess", "interactions", "--input", data, "--output",
                       out["retrieval"], "--positive", "rating>=4"], "interactions.yaml")
    ranking = ["preprocess", "interactions", "--input", data, "--output", out["ranking"],
               "--labels", LABELS, "--ranking-negatives", str(args.negatives),
               "--holdout", out["retrieval"]]
    if args.ranker_history:
        ranking += ["--history", str(args.ranker_history)]
    if args.ranker_data == "candidates":
        make("early", ["preprocess", "interactions", "--input", data, "--output",
                       out["early"], "--positive", "rating>=4", "--holdout-recent", str(k)],
             "interactions.yaml")
        early_tower = train_tower(args, out["early"], scratch,
                                  f"early_{tower_name(args)}_{k}", args.tower == "hstu")
        make("early_graph", ["pixie", "build", "--data", out["early"], "--out",
                             out["early_graph"]], "graph.yaml")
        ranking += ["--candidates", f"{early_tower},{out['early_graph']}",
                    "--candidate-ratio", str(args.candidate_ratio)]
    make("ranking", ranking, "feature_spec.yaml")
    out["tower"] = train_tower(args, out["retrieval"], scratch, tower_name(args),
                               args.tower == "hstu")
    for loss in args.losses:
        for steps in args.ranker_steps:
            out[f"ranker_{loss}_{steps}"] = train_ranker(args, out["ranking"], scratch, loss,
                                                         steps)
    make("graph", ["pixie", "build", "--data", out["retrieval"], "--out", out["graph"]],
         "graph.yaml")
    return out


def build_first_stage(args, scratch: Path, paths: Dict[str, str], ranker: str,
                      value: Dict[str, float]) -> str:
    """The first-stage ranker of the heavy ranker `ranker` (an exported file) with the value
    model `value`: its top args.top_k_label of each request of the ranking train split, the
    first-stage dataset (with the retrieval training engagements unless
    args.first_stage_labels_only), its two-tower model exported: the model's folder. Each part
    is named by what it depends on and kept where `scratch` (--work) already has it: in the
    log's folder there that `build` made `paths` in, beside them."""
    cli, scratch = retrieval_bench.cli, Path(paths["retrieval"]).parent
    labels_name = f"{Path(ranker).stem}_{value_tag(value)}_top{args.top_k_label}"
    kind = labels_name + ("" if args.first_stage_labels_only else "_engaged")
    labels, data = scratch / f"{labels_name}.labels", scratch / f"first_stage_data_{kind}"
    if not labels.is_file():
        scores = scratch / f"{labels_name}.scores.csv"
        cli(["predict", "--model", ranker, "--data", paths["ranking"], "--split", "train",
             "--out", str(scores), "--top-k-label", str(args.top_k_label), "--label-out",
             str(labels), "--value", ",".join(f"{t}={w:g}" for t, w in value.items())])
        scores.unlink()
    if not (data / "interactions.yaml").is_file():
        cli(["preprocess", "first-stage", "--retrieval", paths["retrieval"], "--ranking",
             paths["ranking"], "--labels", str(labels), "--output", str(data),
             *([] if args.first_stage_labels_only else ["--engagements"])])
    return train_tower(args, str(data), scratch, f"first_stage_{kind}_e{args.epochs}")


def tower_name(args) -> str:
    """The retrieval model's folder name: its kind and training length."""
    return (f"hstu_e{args.hstu_epochs}" if args.tower == "hstu" else f"tower_e{args.epochs}")


def value_tag(value: Dict[str, float]) -> str:
    """A value model in a file name, e.g. watched0.5_liked1_disliked-2."""
    return "_".join(f"{t}{w:g}" for t, w in value.items())


def asked_history(rec, user: int, val: Dict[int, int]
                  ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """(history, timeline) a test request asks with: the validation item then the training
    items most recent first (`Recommender.stored_latest_first`: what the ranker's similarity
    features read), every one of them excluded; a history tower's timeline (the training items
    in time order, then validation's; None without one or without a validation item: the
    stored one). The package's (funnel_tuning.request_history), as validation asks."""
    from dlrm_hybrid.serve.funnel_tuning import request_history

    return request_history(rec, user, [val[user]] if user in val else [])
