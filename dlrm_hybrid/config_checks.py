"""Checks of a run configuration that its dataclasses' types cannot express: `validate` checks
values against config.py's CHOICES and POSITIVE and calls the checks below, grouped by the
section they guard in the order of `Config` (the model: ranker, compositional rules, DHEN,
tasks, two-tower; then parallel; then train).

Each problem is a one-line `ConfigError` naming the key and the fix. No torch here: configs are
checked before it is imported.
"""

from __future__ import annotations

from typing import Any

from dlrm_hybrid.config import (CHOICES, DHEN_MODULES, POSITIVE, QR_OPERATIONS,
                                RETRIEVAL_KINDS, TASK_NAME, TECHNIQUES, CompositionalRule, Config,
                                ConfigError, parse_bytes, task_names)
from dlrm_hybrid.model.mixed_dimensions import check_mixed_dimensions


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
        _validate_tasks(cfg, world_size)
        _validate_sequence(cfg)
    elif m.sequence != "none":
        raise ConfigError(f"model.sequence: is the ranker's sequence feature (model.kind dlrm); "
                          f"a {m.kind} model has none, leave it at none")
    check_mixed_dimensions(cfg)
    _validate_two_tower(cfg, world_size)
    _validate_exchange(cfg)
    _validate_dense(cfg)
    _validate_schedule(cfg)
    _validate_optim(cfg.optim)
    from dlrm_hybrid.parallel.cost_model import device_constants  # numpy: not before it is needed

    device_constants("h100" if cfg.parallel.device == "auto" else cfg.parallel.device,
                     cfg.parallel.cost_model)
    for key in ("train.eval_every", "checkpoint.every", "data.stream_window_s",
                "model.hstu.attention_chunk"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"{key}: must be >= 0, got {_get(cfg, key)}")
    memory = parse_bytes(cfg.parallel.memory_per_rank, "parallel.memory_per_rank", allow_auto=True)
    reserve = parse_bytes(cfg.parallel.reserve_per_rank, "parallel.reserve_per_rank")
    if memory is not None and reserve >= memory:
        raise ConfigError(f"parallel.reserve_per_rank: {cfg.parallel.reserve_per_rank} leaves nothing "
                          f"of parallel.memory_per_rank ({cfg.parallel.memory_per_rank}) for tables")


# --- model -----------------------------------------------------------------------------------

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


def _validate_tasks(cfg: Config, world_size: int = 1) -> None:
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
    if m.task_dot_dim < 0:
        raise ConfigError(f"model.task_dot_dim: must be >= 0, got {m.task_dot_dim}")
    if m.task_dot_dim and not m.tasks:
        raise ConfigError("model.task_dot_dim: gives each task its own dot interaction, and "
                          "model.tasks is empty; name the tasks, or leave it at 0")
    if m.task_dot_dim and m.interaction not in ("dot", "dcn", "dhen"):
        raise ConfigError(f"model.task_dot_dim: needs the bottom-MLP output and the pooled "
                          f"vectors of one width (interaction dot, dcn or dhen), and "
                          f"interaction {m.interaction} has not; leave it at 0")
    r = m.ranking_loss
    if r.kind != "none":
        local = d.global_batch_size // world_size
        if not m.tasks:
            raise ConfigError("model.ranking_loss: ranks by the tasks' logits; name model.tasks")
        if r.group < 2 or local % r.group:
            raise ConfigError(f"model.ranking_loss.group: {r.group}: give the rows of one request "
                              f"(2 or more: the ranking dataset's train_request_rows), a divisor "
                              f"of each rank's batch ({local})")
        if not r.weight >= 0:
            raise ConfigError(f"model.ranking_loss.weight: must be >= 0, got {r.weight}")
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
    """The retrieval kinds (two_tower, hstu): their models and the `retrieval` section."""
    m = cfg.model
    if m.kind not in RETRIEVAL_KINDS:
        return
    if m.tasks or cfg.value_model:
        key = "model.tasks" if m.tasks else "value_model"
        raise ConfigError(f"{key}: is for the ranker (model.kind dlrm); a {m.kind} model has "
                          f"one retrieval score, leave {key} empty")
    if m.kind == "two_tower":
        _validate_towers(m)
    else:
        _validate_hstu(cfg)
    _validate_retrieval(cfg, world_size)


def _validate_towers(m) -> None:
    for side in ("user_tower", "item_tower"):
        tower = getattr(m, side)
        if not tower.mlp or min(tower.mlp) <= 0:
            raise ConfigError(f"model.{side}.mlp: need at least one positive layer width, e.g. [64, 32]")
        dim = tower.embedding_dim or m.embedding_dim
        if tower.embedding_dim < 0 or dim % 4:
            raise ConfigError(f"model.{side}.embedding_dim: {dim} is not a positive multiple of 4, "
                              f"which fbgemm's embedding tables need; use e.g. 32")
    _validate_history(m)
    if m.user_tower.mlp[-1] != m.item_tower.mlp[-1]:
        raise ConfigError(f"model.item_tower.mlp: its output width {m.item_tower.mlp[-1]} must "
                          f"equal model.user_tower.mlp's {m.user_tower.mlp[-1]} (their dot product "
                          f"is the score); make the last widths equal")


def _validate_hstu(cfg: Config) -> None:
    m = cfg.model
    h = m.hstu
    if not h.in_batch_negatives and cfg.retrieval.uniform_negatives <= 0:
        raise ConfigError("model.hstu.in_batch_negatives: false leaves the softmax no candidates "
                          "without retrieval.uniform_negatives; set it (e.g. 128) or keep the "
                          "batch's items")
    _validate_hstu_layers(m)
    if m.compositional:
        raise ConfigError("model.compositional: hstu reads whole item vectors from one table; "
                          "leave it empty")


def _validate_sequence(cfg: Config) -> None:
    """The ranker's sequence feature (model.sequence hstu): HSTU's settings, and what it
    cannot run with. Its data (a dataset with history; `plan`: data.cardinalities) is checked
    where it is read: model/compositional.sequence_lookups, parallel/dry_run.planned_spec."""
    m = cfg.model
    if m.sequence == "none":
        return
    refused = {"model.interaction": m.interaction == "fm",
               "model.compositional": bool(m.compositional),
               "parallel.exchange": cfg.parallel.exchange == "des",
               "parallel.dense": cfg.parallel.dense != "ddp"}
    for key, bad in refused.items():
        if bad:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} does not run with model.sequence=hstu "
                              f"(its HSTU reads whole pooled vectors of the item table, under "
                              f"DDP); leave {key} at its default")
    _validate_hstu_layers(m)


def _validate_hstu_layers(m) -> None:
    """model.hstu's layer settings, for the sequence model and the ranker's sequence feature."""
    h = m.hstu
    for key in ("attention_dim", "linear_dim"):
        if getattr(h, key) < 0:
            raise ConfigError(f"model.hstu.{key}: must be >= 0 (0: model.embedding_dim / heads)")
        if not getattr(h, key) and m.embedding_dim % h.heads:
            raise ConfigError(f"model.hstu.heads: {h.heads} does not divide model.embedding_dim "
                              f"{m.embedding_dim}; set model.hstu.{key}, or use e.g. 1 or 2 heads")
    if not 0 <= h.dropout < 1:
        raise ConfigError(f"model.hstu.dropout: {h.dropout} is not in [0, 1); use e.g. 0.2")
    if h.time_buckets < 0:
        raise ConfigError(f"model.hstu.time_buckets: {h.time_buckets}; use e.g. 128, or 0 for "
                          f"no time bias")


def _validate_retrieval(cfg: Config, world_size: int) -> None:
    r = cfg.retrieval
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
                          f"val and test); use {4 if cfg.model.kind == 'hstu' else 3} or more")
    unsupported = {"parallel.dense": cfg.parallel.dense != "ddp",
                   "parallel.exchange": cfg.parallel.exchange == "des",
                   "train.cuda_graphs": cfg.train.cuda_graphs == "true",
                   "train.mlperf_log": bool(cfg.train.mlperf_log),
                   "train.target_auc": cfg.train.target_auc > 0}
    for key, asked in unsupported.items():
        if asked:
            raise ConfigError(f"{key}: {_get(cfg, key)!r} is for the ranker; model.kind "
                              f"{cfg.model.kind} trains without it (leave {key} at its default)")


def _validate_history(m) -> None:
    """A history user tower reads the item table: its width, no user features of its own."""
    user = m.user_tower
    if user.encoder == "ids":
        return
    item_dim = m.item_tower.embedding_dim or m.embedding_dim
    if user.embedding_dim and user.embedding_dim != item_dim:
        raise ConfigError(f"model.user_tower.embedding_dim: {user.embedding_dim}; the "
                          f"{user.encoder} tower reads the item table ({item_dim} wide), leave it 0")
    if user.features:
        raise ConfigError(f"model.user_tower.features: {user.encoder} reads the user's history "
                          f"only, leave it empty (or use encoder ids)")
    if user.encoder == "history_attention" and item_dim % user.attention_heads:
        raise ConfigError(f"model.user_tower.attention_heads: {user.attention_heads} does not "
                          f"divide the item table's width {item_dim}; use e.g. 2")
    if not 0 <= user.dropout < 1:
        raise ConfigError(f"model.user_tower.dropout: {user.dropout} is not in [0, 1); use e.g. 0.1")


# --- parallel --------------------------------------------------------------------------------

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


# --- optim -----------------------------------------------------------------------------------

def _validate_optim(o) -> None:
    if len(o.dense_betas) != 2 or not all(0 <= b < 1 for b in o.dense_betas):
        raise ConfigError(f"optim.dense_betas: {o.dense_betas} is not two values in [0, 1) "
                          f"(Adam's beta1, beta2); use e.g. [0.9, 0.999]")
    if o.dense_clip_norm < 0:
        raise ConfigError(f"optim.dense_clip_norm: must be >= 0 (0: no clipping), got "
                          f"{o.dense_clip_norm}")


# --- train -----------------------------------------------------------------------------------

def _validate_schedule(cfg: Config) -> None:
    t = cfg.train
    if t.max_steps < 0 or (t.max_steps == 0 and not (t.evals_per_epoch or
                                                     cfg.data.stream_window_s)):
        raise ConfigError(f"train.max_steps: must be positive, got {t.max_steps} (0 means one "
                          f"epoch only with train.evals_per_epoch or data.stream_window_s)")
    if t.evals_per_epoch < 0:
        raise ConfigError(f"train.evals_per_epoch: must be >= 0, got {t.evals_per_epoch}")
    if t.evals_per_epoch and t.eval_every:
        raise ConfigError("train.eval_every: train.evals_per_epoch sets when to evaluate; leave "
                          "eval_every at 0")
    if (t.evals_per_epoch or cfg.data.stream_window_s) and cfg.data.shuffle:
        why = ("train.evals_per_epoch trains one epoch in the dataset's order, as MLPerf's "
               "reference does" if t.evals_per_epoch else "data.stream_window_s: time order")
        raise ConfigError(f"data.shuffle: {why}; set data.shuffle=false")
    if not 0 <= t.target_auc < 1:
        raise ConfigError(f"train.target_auc: must be in [0, 1), got {t.target_auc}")
    if t.mlperf_log and cfg.optim.embedding_lr != cfg.optim.dense_lr:
        raise ConfigError(f"train.mlperf_log: MLPerf logs one learning rate, and "
                          f"optim.embedding_lr ({cfg.optim.embedding_lr}) differs from "
                          f"optim.dense_lr ({cfg.optim.dense_lr}); set them equal")
    if t.mlperf_log and cfg.model.sequence == "hstu":  # DLRMv4: its own rules
        from dlrm_hybrid.train.mlperf_dlrmv4 import check_rules
        return check_rules(cfg)
    for key in ("optim.embedding", "optim.dense"):  # the reference's torch.optim.Adagrad
        if t.mlperf_log and _get(cfg, key) != "adagrad":
            raise ConfigError(f"{key}: MLPerf's closed division trains with exact Adagrad, as its "
                              f"reference does, not {_get(cfg, key)}; set {key}=adagrad (or "
                              f"leave train.mlperf_log empty)")


def _get(cfg: Config, dotted: str) -> Any:
    node = cfg
    for name in dotted.split("."):
        node = getattr(node, name)
    return node
