"""Run configuration's schema: the sections as typed dataclasses, the values each key allows.

Reading a YAML file and `--set` overrides into a `Config` is config_loading.py; the checks across
fields, config_checks.py. Every problem is a `ConfigError` whose message is one line naming the
key and the fix; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import temporary_beside


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
class MixedDimensionsConfig:
    """Mixed-dimension embeddings (Ginart et al. 2019; model/mixed_dimensions.py): a table of n
    rows is d0 * (n_min / n)^temperature wide (n_min: the smallest table's rows, d0:
    base_width), as facebookresearch/dlrm's md_solver assigns, then a learned projection
    brings its pooled vectors to model.embedding_dim."""

    temperature: float = 0.0  # alpha; 0: every table model.embedding_dim wide (off)
    # widths rounded to a power of two (md_solver's round_dim); false: to a multiple of 4
    round_dims: bool = False
    base_width: int = 0  # d0, the smallest table's width; 0: model.embedding_dim
    # tables of at most this many rows keep model.embedding_dim (facebookresearch/dlrm's
    # --md-threshold)
    threshold: int = 200


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
class UserTowerConfig(TowerConfig):
    """The user tower: a tower as above, or one that reads the user's history
    (model/history_encoder.py)."""

    # ids (its features, as above) | history_mean (the mean of the user's last
    # `history_length` items' vectors, looked up in the item table) | history_attention (those
    # items in order through a causal transformer)
    encoder: str = "ids"
    history_length: int = 50  # history_*: the most recent training items read
    attention_layers: int = 2  # history_attention: transformer layers
    attention_heads: int = 2  # ... heads (the item table's width must be divisible by it)
    dropout: float = 0.0  # history_attention: the transformer's dropout in training


@dataclass
class HstuConfig:
    """`model.kind: hstu`, the generative sequence model (model/hstu.py, model/hstu_retrieval.py).
    The defaults are the reference's MovieLens settings (meta-recsys/generative-recommenders,
    configs/ml-1m/hstu-sampled-softmax-n128-final.gin: 2 blocks, 1 head, dqk = dv = the item
    width, dropout 0.2, 128 uniform negatives, temperature 0.05 as `model.temperature`)."""

    max_length: int = 200  # the most recent training items a sequence holds (and N of A / N)
    layers: int = 2
    heads: int = 1
    attention_dim: int = 0  # per head, Q and K; 0: model.embedding_dim / heads
    linear_dim: int = 0  # per head, U and V; 0: model.embedding_dim / heads
    dropout: float = 0.2  # on the input and on each layer's gated output, in training
    # the time bias's log2 buckets, where the dataset has timestamps; 0: no time bias (a
    # request's history then needs no times)
    time_buckets: int = 128
    # the softmax's candidates: every position's next item in the global batch (besides the
    # retrieval.uniform_negatives draws)
    in_batch_negatives: bool = True
    # > 0: attention computed this many query positions at a time, each block's [c, n] scores
    # made again in the backward rather than kept (model/hstu.py): a sample keeps no [n, n]
    # activations, at about one more attention's compute; 0: all positions at once
    attention_chunk: int = 0
    # each layer keeps only its input for the backward and is run again in it (activation
    # checkpointing): a sample keeps one layer's activations at a time, at one more forward
    checkpoint_layers: bool = False


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
class RankingLossConfig:
    """A learning-to-rank term added to the multi-task log loss (model/task_heads.py), over
    requests of `group` consecutive training rows (a ranking dataset made with --candidates
    writes an engagement and its negatives together: group = 1 + negatives)."""

    kind: str = "none"  # none | pairwise (RankNet over a request's pairs) | listwise (softmax)
    group: int = 0  # rows per request; the local batch must be a multiple
    weight: float = 1.0  # the term's weight beside the log loss


@dataclass
class ModelConfig:
    # dlrm: the ranker (one click logit) | two_tower: a user and an item tower trained for
    # retrieval (model/two_tower.py; the `retrieval` section sets its loss and evaluation) |
    # hstu: the generative sequence model, next-item prediction at every position of each
    # user's history (model/hstu_retrieval.py; `model.hstu`, and `retrieval` as two_tower)
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
    mixed_dimensions: MixedDimensionsConfig = field(default_factory=MixedDimensionsConfig)
    user_tower: UserTowerConfig = field(default_factory=UserTowerConfig)  # two_tower
    hstu: HstuConfig = field(default_factory=HstuConfig)  # hstu
    item_tower: TowerConfig = field(default_factory=TowerConfig)  # two_tower
    temperature: float = 0.05  # two_tower: score = <user, item> / temperature
    # Multi-task ranking: one head per task replaces the top MLP's last layer (the layers
    # before it are the shared trunk); empty: one click logit
    tasks: List[TaskConfig] = field(default_factory=list)
    mmoe: MmoeConfig = field(default_factory=MmoeConfig)
    # > 0: each task's own dot interaction, the vectors projected to this width per task, its
    # weighted pair dots added to the task's logit (model/task_dots.py); 0: none
    task_dot_dim: int = 0
    ranking_loss: RankingLossConfig = field(default_factory=RankingLossConfig)
    # The ranker's sequence feature (model/sequence_feature.py): none | hstu, HSTU (`model.hstu`'s
    # layers, heads, widths, dropout) over the user's history with its actions and the
    # candidate after it, its output one more vector of the interaction. The dataset carries the
    # history (`preprocess interactions --labels ... --history L`).
    sequence: str = "none"


@dataclass
class DataConfig:
    path: str = ""  # a split-binary dataset folder; empty: the planted synthetic data below
    loader: str = "torch"  # torch | dali
    shuffle: bool = False  # seeded shuffle of the training batch order, the same on every rank
    # > 0: streaming in time order (data/stream_windows.py): the training split (rows in time
    # order, with row times: `preprocess yambda`) trained once, in windows of this many seconds
    # of the rows' times, each window evaluated after it (train.max_steps 0: the whole pass)
    stream_window_s: float = 0.0
    stream_eval: str = "next"  # next: on the next window's rows | heldout: the validation split | none
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
    # two_tower's planted interactions (data/interactions/planted_interactions.py), when data.path is empty:
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
    dense_betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # dense adam's beta1, beta2
    # > 0: the dense parameters' gradients scaled to this global L2 norm at most before each
    # dense step (after DDP's all-reduce and fp16's unscale); 0: no clipping
    dense_clip_norm: float = 0.0
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
        partial = temporary_beside(path)
        partial.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        partial.replace(path)


CHOICES = {
    "model.kind": ("dlrm", "two_tower", "hstu"),
    "model.sequence": ("none", "hstu"),
    "model.user_tower.encoder": ("ids", "history_mean", "history_attention"),
    "model.embedding_precision": ("fp32", "fp16"),
    "model.interaction": ("dot", "cat", "dcn", "fm", "dhen"),
    "model.dcn.structure": ("stacked", "parallel"),
    "model.dhen.ensemble": ("concat", "sum"),
    "model.ranking_loss.kind": ("none", "pairwise", "listwise"),
    "parallel.dense": ("ddp", "fsdp", "hsdp"),
    "data.loader": ("torch", "dali"),
    "data.stream_eval": ("next", "heldout", "none"),
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
RETRIEVAL_KINDS = ("two_tower", "hstu")  # trained on interaction logs, scored over the corpus
TECHNIQUES = ("full", "hash", "qr")
QR_OPERATIONS = ("mult", "add", "concat")
POSITIVE = ("data.global_batch_size", "data.prefetch", "checkpoint.keep", "data.num_dense", "data.train_samples", "data.val_samples",
            "model.embedding_dim", "data.teacher_dim", "train.log_every", "train.stop_grace_s",
            "model.dcn.layers", "model.dcn.rank", "model.dcn.experts", "model.dhen.layers",
            "model.dhen.heads", "model.temperature", "data.users", "data.items",
            "data.interactions_per_user", "retrieval.eval_items_per_chunk",
            "model.user_tower.history_length", "model.user_tower.attention_layers",
            "model.user_tower.attention_heads", "model.hstu.max_length", "model.hstu.layers",
            "model.hstu.heads")

# floats that torch refuses below 0 (with a traceback); every float must be finite
NON_NEGATIVE = ("optim.embedding_lr", "optim.dense_lr", "optim.eps")

DHEN_MODULES = ("linear", "self_attention", "conv", "dot", "dcn")  # model/dhen.py's MODULES


TASK_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


def task_names(model_cfg) -> List[str]:
    """The ranker's tasks in output order; a single-task model's one task is `click`."""
    return [t.name for t in model_cfg.tasks] or ["click"]


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
