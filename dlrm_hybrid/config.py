"""Run configuration: YAML (safe_load) into typed dataclasses, `--set` overrides, validation.

Every problem is a `ConfigError` whose message is one line naming the key and the fix;
the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from dlrm_hybrid.errors import UserError


class ConfigError(UserError):
    """A bad configuration: the message names the key and what to do."""


@dataclass
class CompositionalRule:
    """Smaller tables for some features, ids transformed at lookup (model/compositional.py): the
    features named in `features`, or else every feature whose table has more than `rows_above`
    rows. The first rule that names or selects a feature applies to it."""

    technique: str = "qr"  # full | hash | qr
    features: List[str] = field(default_factory=list)  # e.g. [cat_0, cat_9]
    rows_above: int = 0  # used when `features` is empty
    buckets: int = 0  # hash: rows of the hashed table; id -> id mod buckets
    collisions: int = 4  # qr: c, the remainder table's rows; the quotient table has ceil(n / c)
    operation: str = "mult"  # qr: how Q[id // c] and R[id % c] combine: mult | add | concat


@dataclass
class DcnConfig:
    """`dcn` (model/interactions.py): DCN-v2's cross layers x_{l+1} = x_0 * (W_l x_l + b_l) + x_l
    over x_0 = [dense, sparse_1..F] flattened, W_l of rank `rank`."""

    layers: int = 3
    rank: int = 512
    # stacked: the cross network, then the top MLP on its output | parallel: the cross network
    # and the top MLP's hidden layers both on x_0, concatenated into its last layer
    structure: str = "stacked"
    experts: int = 1  # > 1: a gated mixture of this many low-rank experts per layer


@dataclass
class DhenConfig:
    """`dhen` (model/dhen.py): layers of several interaction modules over the list [B, l, d] of
    the bottom-MLP output and the F pooled embeddings, ensembled, with a skip and a norm."""

    layers: int = 2
    modules: List[str] = field(default_factory=lambda: ["dot", "self_attention"])
    ensemble: str = "concat"  # concat (then a projection along the list) | sum
    width: int = 0  # l': the list length each layer returns; 0: its input's, F + 1
    heads: int = 2  # self_attention's heads; model.embedding_dim must be divisible by it
    activation_checkpointing: bool = False  # recompute each layer in the backward: less memory


@dataclass
class TowerConfig:
    """One tower of `model.kind: two_tower` (model/two_tower.py): its side's features pooled
    from their tables, concatenated with its dense features, through an MLP."""

    features: List[str] = field(default_factory=list)  # empty: all of the dataset's for this side
    embedding_dim: int = 0  # of this tower's tables; 0: model.embedding_dim
    mlp: List[int] = field(default_factory=lambda: [64, 32])  # the last is the output width
    normalize: bool = True  # L2-normalise the output (the score is then a cosine)


@dataclass
class TaskConfig:
    """One engagement a multi-task ranker predicts (model/task_heads.py): the dataset's label of
    this name, its weight in the loss, and its head's hidden widths (a last layer of width 1,
    the task's logit, follows them)."""

    name: str = "click"
    weight: float = 1.0
    head: List[int] = field(default_factory=list)


@dataclass
class MmoeConfig:
    """A multi-gate mixture of experts over the shared trunk: `experts` MLPs read the trunk's
    output and each task's head reads its own softmax-gated mix of them (Ma et al., KDD 2018)."""

    experts: int = 0  # 0: every head reads the trunk itself
    expert_mlp: List[int] = field(default_factory=lambda: [32])


@dataclass
class ModelConfig:
    # dlrm: the ranker (one click logit) | two_tower: a user and an item tower trained for
    # retrieval (model/two_tower.py; the `retrieval` section sets its loss and evaluation)
    kind: str = "dlrm"
    embedding_dim: int = 16
    embedding_precision: str = "fp32"  # fp32 | fp16
    bottom_mlp: List[int] = field(default_factory=lambda: [64, 16])
    top_mlp: List[int] = field(default_factory=lambda: [64, 32, 1])
    interaction: str = "dot"  # dot | cat | dcn | fm (factorization machine, docs/des.md) | dhen
    self_interaction: bool = False  # dot: also include each vector's dot with itself
    dcn: DcnConfig = field(default_factory=DcnConfig)
    dhen: DhenConfig = field(default_factory=DhenConfig)
    compositional: List[CompositionalRule] = field(default_factory=list)  # hashing trick, QR
    user_tower: TowerConfig = field(default_factory=TowerConfig)  # two_tower
    item_tower: TowerConfig = field(default_factory=TowerConfig)  # two_tower
    temperature: float = 0.05  # two_tower: score = <user, item> / temperature
    # Multi-task ranking: one head per task replaces the top MLP's last layer (the layers
    # before it are the shared trunk); empty: one click logit
    tasks: List[TaskConfig] = field(default_factory=list)
    mmoe: MmoeConfig = field(default_factory=MmoeConfig)


@dataclass
class DataConfig:
    path: str = ""  # a split-binary dataset folder; empty: the planted synthetic data below
    loader: str = "torch"  # torch | dali
    shuffle: bool = False  # seeded shuffle of the training batch order, the same on every rank
    prefetch: int = 4  # batches the loader reads ahead
    global_batch_size: int = 1024
    seed: int = 1234  # fixes the synthetic dataset (teacher and samples), independent of train.seed
    num_dense: int = 13
    cardinalities: List[int] = field(default_factory=lambda: [1000, 100, 10])
    hotness: List[int] = field(default_factory=lambda: [1])  # ids per sample; one value or one per table
    hotness_distribution: str = "fixed"  # fixed: every lookup has `hotness` ids | uniform: 1..hotness
    train_samples: int = 1_000_000
    val_samples: int = 65_536
    zipf_exponent: float = 1.1  # category frequency skew, as in click logs
    # frequency: id 0 is the most frequent value, 1 the next (as `preprocess` numbers them) |
    # scattered: a fixed pseudo-random relabelling of that order (as numbering by first appearance)
    id_order: str = "frequency"
    teacher_dim: int = 8  # width of the planted teacher's latent vectors
    teacher_scale: float = 1.0  # logit scale of the teacher: higher means an easier task
    teacher_order: int = 2  # 2: the teacher sums pairwise dots | 3: and three-way products
    # two_tower's planted interactions (data/planted_interactions.py), when data.path is empty:
    users: int = 2000
    items: int = 1000
    interactions_per_user: int = 30  # engagements drawn per user before the leave-last-out split
    # model.tasks on the planted data: each task's teacher logit shares this fraction of its
    # variance with the other tasks' (the rest is its own latent factors)
    task_correlation: float = 0.5
    label_missing: float = 0.0  # each task's label but the first is missing with this chance
    # the planted data's labels, each with its own teacher (by position); empty: model.tasks'
    # names. A model may train some of them: a single-task `like` model then learns like's.
    labels: List[str] = field(default_factory=list)


@dataclass
class ParallelConfig:
    backend: str = "auto"  # auto | nccl | gloo
    memory_per_rank: str = "auto"  # device memory per rank, e.g. "80GiB"; auto: the GPU's, or 8GiB on CPU
    reserve_per_rank: str = "2GiB"  # kept free of tables, for dense parameters and activations
    strategy: str = "greedy"  # greedy | nvidia
    plan: str = ""  # a plan file from `dlrm_hybrid plan --out`, used as it is
    comm_precision: str = "fp32"  # fp32 | fp16 | bf16: pooled embeddings and their gradients in the all-to-all
    # pooled: owners send each sample's pooled vectors | des: owners send their partial sums of
    # the first operation on them (cat, fm only) | auto: the one that sends fewer bytes
    exchange: str = "auto"
    # what the greedy placer models (parallel/cost_model.py): h100 | h200 | a100 | cpu_gloo |
    # auto (a job: its GPU's kind, cpu_gloo on CPU; `plan`: h100 unless --device)
    device: str = "auto"
    cost_model: Dict[str, float] = field(default_factory=dict)  # overrides of the device's constants
    # true: split row-wise Adagrad tables for speed too (their updates then differ from unsplit ones)
    split_rowwise: bool = False
    # false: shard every table (the greedy placer replicates small ones where that is faster)
    replicate: bool = True
    # The dense modules (bottom MLP, interaction, top MLP): ddp (replicated, gradients
    # all-reduced) | fsdp (parameters, gradients and optimizer state sharded over all ranks) |
    # hsdp (sharded within groups of hsdp_shard_size ranks, replicated across them)
    dense: str = "ddp"
    hsdp_shard_size: int = 0  # 0: the ranks of one host


@dataclass
class OptimConfig:
    embedding: str = "rowwise_adagrad"  # sgd | rowwise_adagrad | adagrad | adam
    embedding_lr: float = 0.1
    dense: str = "sgd"  # sgd | adagrad | adam
    dense_lr: float = 0.1
    eps: float = 1e-8  # adagrad/adam epsilon
    warmup_steps: int = 0  # linear warmup from 0 to the base LR
    decay_start_step: int = 0  # polynomial decay begins here (0: no decay)
    decay_steps: int = 0  # ...and lasts this many steps
    decay_power: float = 2.0
    decay_end_factor: float = 0.0  # LR at the end of the decay, as a fraction of the base LR


@dataclass
class TrainConfig:
    max_steps: int = 100
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate only at the end
    run_dir: str = "runs/default"
    seed: int = 0  # model initialisation
    # auto: rank 0's tqdm bar when stdout and stderr are terminals, else a line per log_every
    # steps (a batch log gets no carriage returns) | true: the bar | false: the lines
    progress_bar: str = "auto"
    rank_logs: bool = False  # every rank also writes run_dir/rank_<r>.jsonl (its shards, losses, time)
    # Rank 0 writes TensorBoard event files in run_dir/tensorboard: auto (when the tensorboard
    # package is installed) | true (an error if it is not) | false.
    tensorboard: str = "auto"
    # auto (bf16 on a GPU, fp32 on a CPU) | fp32 | tf32 | bf16 | fp16 (autocast; fp16 with a
    # loss scaler)
    precision: str = "auto"
    # On a CPU whose oneDNN has no bf16/fp16 matmul (e.g. AVX2-only), that precision runs torch's
    # reference kernels, 20-100x slower than fp32: true computes in fp32 instead, with a warning.
    precision_fallback: bool = True
    # Replay the dense part of each step as a CUDA graph: auto (on a GPU, where the step can be
    # captured: ddp dense layers, pooled exchange, the ranker) | true | false.
    cuda_graphs: str = "auto"
    pipeline: str = "auto"  # auto (enabled with CUDA) | enabled | disabled: overlap batch i+1's copy and id exchange with step i
    # MLPerf's schedule: evaluate N times per epoch, every floor(train samples / (batch * N))
    # steps, for at most one epoch in the dataset's order (max_steps 0: all N evaluations).
    evals_per_epoch: int = 0
    target_auc: float = 0.0  # > 0: stop at the first evaluation reaching this validation AUC
    mlperf_log: str = ""  # a file: MLPerf Training's log of the run (mlperf-logging), rank 0
    # On SIGINT/SIGTERM the ranks stop after their step and write a checkpoint; a stop that has
    # not finished this many seconds after the signal ends at once without it (keep it below
    # the scheduler's grace before SIGKILL: torchrun, SLURM KillWait, Kubernetes: 30 s).
    stop_grace_s: float = 25.0


@dataclass
class RetrievalConfig:
    """two_tower's loss (retrieval/loss.py) and evaluation (retrieval/evaluate.py)."""

    # softmax over the global batch's items: every rank's positives are every sample's negatives
    logq: bool = True  # subtract log p(item), p streamed from the batches (Yi et al., RecSys 2019)
    logq_decay: float = 0.01  # the streaming estimate's learning rate (Yi et al.'s alpha)
    remove_accidental_hits: bool = True  # a sample's own item elsewhere in the batch is no negative
    uniform_negatives: int = 0  # per global batch, drawn uniformly from the corpus (mixed negatives)
    cross_batch_memory: int = 0  # item embeddings of recent batches kept as extra negatives
    eval_k: List[int] = field(default_factory=lambda: [10, 50, 100])  # recall/HR/NDCG@K
    eval_items_per_chunk: int = 65536  # items scored at once per user batch: bounds eval memory


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints (0: only at the end)
    dir: str = ""  # empty: <train.run_dir>/checkpoints
    keep: int = 2  # newest complete checkpoints kept
    resume: str = "auto"  # auto (newest complete one, if any) | none | a checkpoint folder


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    # task name -> weight: value = sum_t weight_t * P(task t), what `predict` and the exported
    # model rank by; changing it needs no retraining
    value_model: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        """Write atomically: a reader never sees half a file."""
        partial = path.with_name(path.name + ".partial")
        partial.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        partial.replace(path)


CHOICES = {
    "model.kind": ("dlrm", "two_tower"),
    "model.embedding_precision": ("fp32", "fp16"),
    "model.interaction": ("dot", "cat", "dcn", "fm", "dhen"),
    "model.dcn.structure": ("stacked", "parallel"),
    "model.dhen.ensemble": ("concat", "sum"),
    "parallel.dense": ("ddp", "fsdp", "hsdp"),
    "data.loader": ("torch", "dali"),
    "data.hotness_distribution": ("fixed", "uniform"),
    "data.id_order": ("frequency", "scattered"),
    "parallel.backend": ("auto", "nccl", "gloo"),
    "parallel.strategy": ("greedy", "nvidia"),
    "parallel.comm_precision": ("fp32", "fp16", "bf16"),
    "parallel.exchange": ("pooled", "des", "auto"),
    "train.precision": ("auto", "fp32", "tf32", "bf16", "fp16"),
    "train.cuda_graphs": ("auto", "true", "false"),
    "train.pipeline": ("auto", "enabled", "disabled"),
    "train.progress_bar": ("auto", "true", "false"),
    "train.tensorboard": ("auto", "true", "false"),
    "optim.embedding": ("sgd", "rowwise_adagrad", "adagrad", "adam"),
    "optim.dense": ("sgd", "adagrad", "adam"),
}
TECHNIQUES = ("full", "hash", "qr")
QR_OPERATIONS = ("mult", "add", "concat")
POSITIVE = ("data.global_batch_size", "data.prefetch", "checkpoint.keep", "data.num_dense", "data.train_samples", "data.val_samples",
            "model.embedding_dim", "data.teacher_dim", "train.log_every", "train.stop_grace_s",
            "model.dcn.layers", "model.dcn.rank", "model.dcn.experts", "model.dhen.layers",
            "model.dhen.heads", "model.temperature", "data.users", "data.items",
            "data.interactions_per_user", "retrieval.eval_items_per_chunk")
LEGACY_KEYS = {"dcn_layers": "layers", "dcn_low_rank": "rank"}  # model.<old> -> model.dcn.<new>


def world_size_from_env() -> int:
    """The job's size as torchrun tells each rank (1 without torchrun): configs are validated
    for it before torch is imported."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_config(path: Optional[str], overrides: List[str] = (), world_size: int = 1) -> Config:
    """Read `path` (or the defaults), apply `key=value` overrides, validate for `world_size` ranks."""
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"config file {path}: cannot read ({e.strerror}); check the path")
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML ({str(e).splitlines()[0]})")
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping of sections (model, data, ...)")
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item}: expected KEY=VALUE, e.g. --set train.max_steps=40")
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: {text!r} is not a valid YAML value "
                              f"({str(e).splitlines()[0]}); quote it or fix its brackets")
        _assign(raw, key.strip(), value)
    _move_legacy_keys(raw)
    cfg = _build(Config, raw, "")
    validate(cfg, world_size)
    return cfg


def _assign(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for name in parents:
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{name}' is not a section")
    node[leaf] = value


def _move_legacy_keys(raw: dict) -> None:
    """Configs (and checkpoints) written before `model.dcn` existed name its keys
    model.dcn_layers and model.dcn_low_rank: read them as model.dcn.layers and .rank."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    for old, new in LEGACY_KEYS.items():
        if old in model:
            dcn = model.setdefault("dcn", {})
            if not isinstance(dcn, dict):
                return  # _build names the bad section
            if new in dcn and dcn[new] != model[old]:
                raise ConfigError(f"model.{old}: {model[old]!r} contradicts model.dcn.{new} "
                                  f"({dcn[new]!r}); give only model.dcn.{new}")
            dcn[new] = model.pop(old)


def _build(cls: type, raw: Any, prefix: str) -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys and wrong types."""
    where = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; valid keys here: {', '.join(sorted(names))}")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            values[name] = _check_type(f"{prefix}{name}", hint, value)
    return cls(**values)


def _check_type(key: str, hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) in (dict, Dict):
        _, item = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {k: _check_type(f"{key}.{k}", item, v) for k, v in value.items()}
    if typing.get_origin(hint) in (list, List):
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {value!r}")
        if dataclasses.is_dataclass(item):
            return [_build(item, v, f"{key}[{i}].") for i, v in enumerate(value)]
        return [_check_type(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, bool) and "true" in CHOICES.get(key, ()):
        return str(value).lower()  # YAML reads true/false as booleans
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r}")
    return value


def validate(cfg: Config, world_size: int) -> None:
    """Cross-field checks that a dataclass type cannot express."""
    for key, allowed in CHOICES.items():
        if _get(cfg, key) not in allowed:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is not one of {', '.join(allowed)}")
    for key in POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"{key}: must be positive, got {_get(cfg, key)}")
    m, d = cfg.model, cfg.data
    if d.global_batch_size % world_size:
        raise ConfigError(
            f"data.global_batch_size: {d.global_batch_size} is not divisible by the world size "
            f"{world_size}; use a multiple of {world_size}")
    if m.embedding_dim % 4:  # fbgemm's embedding kernels (CPU and CUDA) assert it per table
        down = m.embedding_dim // 4 * 4
        near = " or ".join(str(d) for d in (down, down + 4) if d)
        raise ConfigError(f"model.embedding_dim: {m.embedding_dim} is not a multiple of 4, which "
                          f"fbgemm's embedding tables need (CPU and GPU); use {near}")
    if m.kind == "dlrm":
        _validate_ranker(cfg)
        _validate_tasks(cfg)
    _validate_two_tower(cfg, world_size)
    _validate_exchange(cfg)
    _validate_dense(cfg)
    _validate_schedule(cfg)
    from dlrm_hybrid.parallel.cost_model import device_constants  # numpy: not before it is needed

    device_constants("h100" if cfg.parallel.device == "auto" else cfg.parallel.device,
                     cfg.parallel.cost_model)
    for key in ("train.eval_every", "checkpoint.every"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {_get(cfg, key)}")
    memory = parse_bytes(cfg.parallel.memory_per_rank, "parallel.memory_per_rank", allow_auto=True)
    reserve = parse_bytes(cfg.parallel.reserve_per_rank, "parallel.reserve_per_rank")
    if memory is not None and reserve >= memory:
        raise ConfigError(f"parallel.reserve_per_rank: {cfg.parallel.reserve_per_rank} leaves nothing "
                          f"of parallel.memory_per_rank ({cfg.parallel.memory_per_rank}) for tables")


def _validate_schedule(cfg: Config) -> None:
    t = cfg.train
    if t.max_steps < 0 or (t.max_steps == 0 and not t.evals_per_epoch):
        raise ConfigError(f"train.max_steps: must be positive, got {t.max_steps} (0 means one "
                          f"epoch only with train.evals_per_epoch)")
    if t.evals_per_epoch < 0:
        raise ConfigError(f"train.evals_per_epoch: must be >= 0, got {t.evals_per_epoch}")
    if t.evals_per_epoch and t.eval_every:
        raise ConfigError("train.eval_every: train.evals_per_epoch sets when to evaluate; leave "
                          "eval_every at 0")
    if t.evals_per_epoch and cfg.data.shuffle:
        raise ConfigError("data.shuffle: train.evals_per_epoch trains one epoch in the dataset's "
                          "order, as MLPerf's reference does; set data.shuffle=false")
    if not 0 <= t.target_auc < 1:
        raise ConfigError(f"train.target_auc: must be in [0, 1), got {t.target_auc}")
    if t.mlperf_log and cfg.optim.embedding_lr != cfg.optim.dense_lr:
        raise ConfigError(f"train.mlperf_log: MLPerf logs one learning rate, and "
                          f"optim.embedding_lr ({cfg.optim.embedding_lr}) differs from "
                          f"optim.dense_lr ({cfg.optim.dense_lr}); set them equal")
    for key in ("optim.embedding", "optim.dense"):  # the reference's torch.optim.Adagrad
        if t.mlperf_log and _get(cfg, key) != "adagrad":
            raise ConfigError(f"{key}: MLPerf's closed division trains with exact Adagrad, as its "
                              f"reference does, not {_get(cfg, key)}; set {key}=adagrad (or "
                              f"leave train.mlperf_log empty)")


DHEN_MODULES = ("linear", "self_attention", "conv", "dot", "dcn")  # model/dhen.py's MODULES


def _validate_dhen(cfg: Config) -> None:
    """What would fail inside model/dhen.py; with another interaction model.dhen is unused."""
    m, h = cfg.model, cfg.model.dhen
    if m.interaction != "dhen":
        return
    valid = ", ".join(DHEN_MODULES)
    if not h.modules:
        raise ConfigError(f"model.dhen.modules: empty; name at least one of {valid}")
    unknown = [name for name in h.modules if name not in DHEN_MODULES]
    if unknown:
        raise ConfigError(f"model.dhen.modules: {unknown[0]!r} is not a module; use {valid}")
    twice = sorted({name for name in h.modules if h.modules.count(name) > 1})
    if twice:
        raise ConfigError(f"model.dhen.modules: {twice[0]} is listed twice; name each module once")
    if h.width < 0:
        raise ConfigError(f"model.dhen.width: must be >= 0 (0: the input's length, the tables "
                          f"+ 1), got {h.width}")
    if "self_attention" in h.modules and m.embedding_dim % h.heads:
        raise ConfigError(f"model.dhen.heads: {h.heads} does not divide model.embedding_dim "
                          f"({m.embedding_dim}), which self_attention splits among its heads; "
                          f"use a divisor of {m.embedding_dim}")
    if "dot" in h.modules and h.width == 1 and h.layers > 1:
        raise ConfigError("model.dhen.width: 1 leaves the dot module of layers 2.. a list of one "
                          "vector, without pairs to dot; use a width of 2 or more (or 0)")


def _validate_ranker(cfg: Config) -> None:
    """The DLRM's layers and its planted click data (model.kind dlrm)."""
    m, d = cfg.model, cfg.data
    if not m.bottom_mlp or not m.top_mlp:
        raise ConfigError("model.bottom_mlp/model.top_mlp: need at least one layer each")
    if m.top_mlp[-1] != 1:
        raise ConfigError(f"model.top_mlp: last layer must be 1 (the click logit), got {m.top_mlp[-1]}")
    if len(m.top_mlp) == 1 and not (m.interaction == "dcn" and m.dcn.structure == "parallel"):
        raise ConfigError(f"model.top_mlp: {m.top_mlp} has no hidden layer, which only "
                          f"model.dcn.structure=parallel takes; add one, e.g. [64, 1]")
    if m.interaction in ("dot", "dcn", "dhen") and m.bottom_mlp[-1] != m.embedding_dim:
        raise ConfigError(
            f"model.embedding_dim: {m.embedding_dim} must equal the bottom MLP output "
            f"(model.bottom_mlp[-1] = {m.bottom_mlp[-1]}) for interaction '{m.interaction}'")
    if not d.cardinalities or min(d.cardinalities) <= 0:
        raise ConfigError("data.cardinalities: need one positive row count per categorical feature")
    if len(d.hotness) not in (1, len(d.cardinalities)) or min(d.hotness) <= 0:
        raise ConfigError(
            f"data.hotness: give one positive value or one per table ({len(d.cardinalities)})")
    if d.teacher_order not in (2, 3):
        raise ConfigError(f"data.teacher_order: {d.teacher_order} is not 2 (pairwise terms) or 3 "
                          f"(pairwise and three-way terms); use 2 or 3")
    if d.teacher_order == 3 and len(d.cardinalities) < 2:
        raise ConfigError("data.teacher_order: 3 needs three latent vectors (the dense one and "
                          "at least 2 tables); add a table to data.cardinalities or use 2")
    for i, rule in enumerate(m.compositional):
        _validate_rule(rule, f"model.compositional[{i}]", m.embedding_dim)
        if m.interaction == "fm" and rule.technique == "qr":
            raise ConfigError(f"model.compositional[{i}]: interaction fm needs one vector and one "
                              f"first-order weight per id, which qr parts do not give; use hash")
    _validate_dhen(cfg)


TASK_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def task_names(model_cfg) -> List[str]:
    """The ranker's tasks in output order; a single-task model's one task is `click`."""
    return [t.name for t in model_cfg.tasks] or ["click"]


def _validate_tasks(cfg: Config) -> None:
    """model.tasks, model.mmoe and value_model (model.kind dlrm)."""
    m, d = cfg.model, cfg.data
    names = [t.name for t in m.tasks]
    for i, task in enumerate(m.tasks):
        if not TASK_NAME.fullmatch(task.name):
            raise ConfigError(f"model.tasks[{i}].name: {task.name!r} is not a name (a letter, then "
                              f"letters, digits or _); it names the dataset's label and metrics")
        if task.name in names[:i]:
            raise ConfigError(f"model.tasks[{i}].name: {task.name} is listed twice; name each "
                              f"task once")
        if not task.weight >= 0:
            raise ConfigError(f"model.tasks[{i}].weight: must be >= 0, got {task.weight}")
        if task.head and min(task.head) <= 0:
            raise ConfigError(f"model.tasks[{i}].head: {task.head}: hidden widths must be "
                              f"positive (the logit layer follows them), e.g. [16]")
    if m.tasks and not any(t.weight > 0 for t in m.tasks):
        raise ConfigError("model.tasks: every weight is 0, so nothing would be trained; give "
                          "at least one task a positive weight")
    if m.mmoe.experts < 0:
        raise ConfigError(f"model.mmoe.experts: must be >= 0, got {m.mmoe.experts}")
    if m.mmoe.experts and (not m.mmoe.expert_mlp or min(m.mmoe.expert_mlp) <= 0):
        raise ConfigError(f"model.mmoe.expert_mlp: {m.mmoe.expert_mlp}: give each expert's "
                          f"positive layer widths, e.g. [32]")
    if m.mmoe.experts and not m.tasks:
        raise ConfigError("model.mmoe.experts: gates one mix of experts per task, and "
                          "model.tasks is empty; name the tasks, or leave experts at 0")
    if not 0 <= d.task_correlation <= 1:
        raise ConfigError(f"data.task_correlation: {d.task_correlation} is not in [0, 1]")
    if not 0 <= d.label_missing < 1:
        raise ConfigError(f"data.label_missing: {d.label_missing} is not in [0, 1)")
    for i, name in enumerate(d.labels):
        if not TASK_NAME.fullmatch(name) or d.labels.index(name) != i:
            raise ConfigError(f"data.labels[{i}]: {name!r} is not a new name (a letter, then "
                              f"letters, digits or _; each once)")
    if d.labels and not d.path and set(names) - set(d.labels):
        missing = sorted(set(names) - set(d.labels))[0]
        raise ConfigError(f"model.tasks: {missing} is not one of data.labels "
                          f"({', '.join(d.labels)}), the planted labels; add it there")
    if d.label_missing and len(d.labels or m.tasks) < 2:
        raise ConfigError(f"data.label_missing: {d.label_missing} leaves out the planted labels "
                          f"after the first, and there is {len(d.labels or m.tasks)}; plant two "
                          f"or more (data.labels or model.tasks), or leave it at 0")
    unknown = [k for k in cfg.value_model if k not in task_names(m)]
    if unknown:
        raise ConfigError(f"value_model.{unknown[0]}: no such task; the model's tasks are "
                          f"{', '.join(task_names(m))}")
    if not m.tasks:
        return
    refused = {"train.target_auc": cfg.train.target_auc > 0,
               "train.mlperf_log": bool(cfg.train.mlperf_log),
               "data.loader": d.loader == "dali"}
    for key, asked in refused.items():
        if asked:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} works with one click label, and "
                              f"model.tasks names {len(m.tasks)}; leave {key} at its default or "
                              f"train one task")


def _validate_two_tower(cfg: Config, world_size: int) -> None:
    m, r = cfg.model, cfg.retrieval
    if m.kind != "two_tower":
        return
    if m.tasks or cfg.value_model:
        key = "model.tasks" if m.tasks else "value_model"
        raise ConfigError(f"{key}: is for the ranker (model.kind dlrm); a two_tower model has "
                          f"one retrieval score, leave {key} empty")
    for side in ("user_tower", "item_tower"):
        tower = getattr(m, side)
        if not tower.mlp or min(tower.mlp) <= 0:
            raise ConfigError(f"model.{side}.mlp: need at least one positive layer width, e.g. [64, 32]")
        dim = tower.embedding_dim or m.embedding_dim
        if tower.embedding_dim < 0 or dim % 4:
            raise ConfigError(f"model.{side}.embedding_dim: {dim} is not a positive multiple of 4, "
                              f"which fbgemm's embedding tables need; use e.g. 32")
    if m.user_tower.mlp[-1] != m.item_tower.mlp[-1]:
        raise ConfigError(f"model.item_tower.mlp: its output width {m.item_tower.mlp[-1]} must "
                          f"equal model.user_tower.mlp's {m.user_tower.mlp[-1]} (their dot product "
                          f"is the score); make the last widths equal")
    if not 0 < r.logq_decay <= 1:
        raise ConfigError(f"retrieval.logq_decay: {r.logq_decay} is not in (0, 1]; use e.g. 0.01")
    for key in ("retrieval.uniform_negatives", "retrieval.cross_batch_memory"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {_get(cfg, key)}")
    if r.uniform_negatives % world_size:
        raise ConfigError(f"retrieval.uniform_negatives: {r.uniform_negatives} do not split over "
                          f"{world_size} ranks (each rank's batch carries its share); use a "
                          f"multiple of {world_size}")
    if not r.eval_k or min(r.eval_k) <= 0 or len(set(r.eval_k)) < len(r.eval_k):
        raise ConfigError(f"retrieval.eval_k: {r.eval_k}: give distinct positive cut-offs, e.g. "
                          f"[10, 50, 100]")
    if not cfg.data.path and cfg.data.interactions_per_user < 3:
        raise ConfigError(f"data.interactions_per_user: {cfg.data.interactions_per_user} leaves "
                          f"the planted log no training engagements (each user's last two are "
                          f"val and test); use 3 or more")
    unsupported = {"parallel.dense": cfg.parallel.dense != "ddp",
                   "parallel.exchange": cfg.parallel.exchange == "des",
                   "train.cuda_graphs": cfg.train.cuda_graphs == "true",
                   "train.mlperf_log": bool(cfg.train.mlperf_log),
                   "train.target_auc": cfg.train.target_auc > 0}
    for key, asked in unsupported.items():
        if asked:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is for the ranker; model.kind "
                              f"two_tower trains without it (leave {key} at its default)")


def _validate_dense(cfg: Config) -> None:
    """parallel.dense: what fsdp and hsdp (FSDP2's sharded dense modules) cannot run with.
    Whether hsdp_shard_size divides the world size is checked where the job builds its mesh
    (dense_sharding.py): a checkpoint's config is read on other world sizes too."""
    p = cfg.parallel
    if p.hsdp_shard_size and p.dense != "hsdp":
        raise ConfigError(f"parallel.hsdp_shard_size: {p.hsdp_shard_size} applies to "
                          f"parallel.dense=hsdp only, not {p.dense}; set parallel.dense=hsdp or "
                          f"leave hsdp_shard_size at 0")
    if p.hsdp_shard_size < 0:
        raise ConfigError(f"parallel.hsdp_shard_size: must be >= 0 (0: the ranks of one host), "
                          f"got {p.hsdp_shard_size}")
    if p.dense == "ddp":
        return
    if cfg.train.cuda_graphs == "true":
        raise ConfigError(f"train.cuda_graphs: parallel.dense={p.dense} all-gathers the dense "
                          f"parameters inside the step, which a captured graph cannot; set "
                          f"train.cuda_graphs=false or parallel.dense=ddp")
    if p.exchange == "des":
        raise ConfigError(f"parallel.exchange: des reads the top MLP's first weight outside its "
                          f"forward, which parallel.dense={p.dense} shards; use pooled or auto, "
                          f"or parallel.dense=ddp")


def _validate_exchange(cfg: Config) -> None:
    m, exchange = cfg.model, cfg.parallel.exchange
    if exchange != "des":
        return
    if m.interaction not in ("cat", "fm"):
        raise ConfigError(f"parallel.exchange: des needs an interaction whose first operation on "
                          f"the embeddings is linear (cat or fm); {m.interaction} multiplies "
                          f"pooled vectors of different tables, so use pooled or auto")
    if any(r.technique == "qr" and r.operation != "concat" for r in m.compositional):
        raise ConfigError("parallel.exchange: des needs each column of a feature's vector from "
                          "one table, which qr mult and add parts are not (their product or sum "
                          "is); use concat or hash, or pooled")
    if cfg.train.cuda_graphs == "true" or cfg.train.precision == "fp16":
        raise ConfigError("parallel.exchange: des runs neither under train.cuda_graphs nor with "
                          "fp16's loss scaler (both cut the step where the pooled embeddings "
                          "enter, which des moves to the owners); use pooled")


def _validate_rule(rule: CompositionalRule, key: str, dim: int) -> None:
    if rule.technique not in TECHNIQUES:
        raise ConfigError(f"{key}.technique: {rule.technique!r} is not one of {', '.join(TECHNIQUES)}")
    if rule.features and rule.rows_above:
        raise ConfigError(f"{key}: give features or rows_above, not both")
    if rule.rows_above < 0:
        raise ConfigError(f"{key}.rows_above: must be >= 0, got {rule.rows_above}")
    if rule.technique == "hash" and rule.buckets < 1:
        raise ConfigError(f"{key}.buckets: the hashed table's rows, must be positive for "
                          f"technique hash (got {rule.buckets})")
    if rule.technique == "qr":
        if rule.collisions < 2:
            raise ConfigError(f"{key}.collisions: the remainder table's rows c, must be at "
                              f"least 2 (got {rule.collisions})")
        if rule.operation not in QR_OPERATIONS:
            raise ConfigError(f"{key}.operation: {rule.operation!r} is not one of "
                              f"{', '.join(QR_OPERATIONS)}")
        if rule.operation == "concat" and dim % 8:
            raise ConfigError(f"{key}.operation: concat gives each part half of "
                              f"model.embedding_dim ({dim}), which fbgemm needs to be a multiple "
                              f"of 4; use an embedding_dim divisible by 8, or mult or add")


def _get(cfg: Config, dotted: str) -> Any:
    node = cfg
    for name in dotted.split("."):
        node = getattr(node, name)
    return node


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, key: str, allow_auto: bool = False) -> Optional[int]:
    """'80GiB' -> 85899345920; 'auto' -> None where allowed."""
    value = text.strip().lower()
    if allow_auto and value == "auto":
        return None
    number = value.rstrip("kmgtib")
    unit = value[len(number):]
    try:
        amount = float(number)
    except ValueError:
        amount = -1.0
    if unit not in _UNITS or amount < 0:
        raise ConfigError(f"{key}: {text!r} is not a size; write e.g. 80GiB, 512MiB or 2e9")
    return int(amount * _UNITS[unit])
