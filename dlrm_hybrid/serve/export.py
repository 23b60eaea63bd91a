"""`export`: a checkpoint -> a served model file (TorchScript, embedding tables quantized row-wise
by fbgemm) and a JSON description of it (also stored inside the file).

Why TorchScript and not torch.export: the scripted file carries the code of the whole model
(the id transform, the MLPs, the interaction) and loads with `torch.jit.load` once fbgemm_gpu is
imported, on any batch size and bag length. torch.export would need symbolic shapes for the
data-dependent parts (bag lengths, the ids each table receives) and its loader needs the
fbgemm ops' shape functions as well.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Dict, List, Sequence

import torch
from torchrec.models.dlrm import InteractionDCNArch
from torchrec.modules.crossnet import LowRankMixtureCrossNet

from dlrm_hybrid.compat import jit_save, jit_script
from dlrm_hybrid.config import RETRIEVAL_KINDS, task_names
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.configured_spec import data_spec
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.model.compositional import FeatureLookup, Part
from dlrm_hybrid.model.cross import WithInput
from dlrm_hybrid.model.dlrm import DLRM, build_model
from dlrm_hybrid.model.embeddings import table_order
from dlrm_hybrid.model.interactions import FactorizationMachine
from dlrm_hybrid.model.task_dots import TaskDotsInteraction
from dlrm_hybrid.serve.rowwise import quantize_into
from dlrm_hybrid.serve.scoring_model import (ScoringModel, StackedCrossNet,
                                             StackedMixtureCrossNet)
from dlrm_hybrid.train.checkpoint import check_checkpoint, checkpoint_config_path, read_meta
from dlrm_hybrid.train.inference import read_model_state
from dlrm_hybrid.output_paths import temporary_beside

QUANTIZATIONS = ("fp32", "fp16", "int8", "int4")
DESCRIPTION = "model.json"  # the description's name inside the file and the sidecar's suffix
FORMAT = "dlrm_hybrid.scoring_model/2"
# A multi-task model's file: forward gives [B, T], which a reader of FORMAT would misread as one
# column of click probabilities.
FORMAT_MULTITASK = "dlrm_hybrid.scoring_model.multitask/1"
# /1: int8 codes made with an fp32 scale that fp16 then rounded (fbgemm's quantize_embs); rows
# narrower than ~0.0156 decode with up to 8x the error. Still scored, with a warning.
FORMAT_FP32_CODED = "dlrm_hybrid.scoring_model/1"
TABLE_PREFIX = "embedding_bags.embedding_bags."  # a table's weight in the model's state dict


def export_model(checkpoint: str, out: str, quantize: str = "fp32",
                 table_overrides: Sequence[str] = (), overrides: Sequence[str] = ()) -> dict:
    """Write the served model of `checkpoint` to `out` and its description to
    `<out stem>.json`, both or neither; returns the description. `overrides` change the
    checkpoint's config (e.g. data.path, where its dataset has moved)."""
    path, target = Path(checkpoint), Path(out)
    require_folder_of(target)
    if target.suffix == ".json":
        raise UserError(f"--out: {out} would be overwritten by its own description "
                        f"({DESCRIPTION}); name the model e.g. model.pt")
    cfg, spec, weights = read_checkpoint(path, overrides)
    model = build_model(cfg.model, spec)
    precisions = table_precisions([p.table for p in table_order(model.lookups)], quantize,
                                  table_overrides)
    tasks = task_names(cfg.model)
    scoring = scoring_model(model, weights, precisions, value_weights(tasks, cfg.value_model),
                            spec)
    outputs = (f"[B, {len(tasks)}] probabilities of the tasks" if cfg.model.tasks
               else "[B] click probabilities")
    description = {
        "format": FORMAT_MULTITASK if cfg.model.tasks else FORMAT,
        "load": "import torch, fbgemm_gpu; model = torch.jit.load(path)",
        "inputs": "model(dense [B, num_dense] float32, ids [B, F] or [B, F, H] int64, "
                  f"lengths [B, F] or None) -> {outputs}",
        "value": "model.score_with_value(dense, ids, lengths=None, weights=None) -> "
                 "(probabilities [B, T], value [B] = probabilities @ weights); weights [T] in "
                 "tasks' order, by default value_model's (unnamed tasks 0); without a "
                 "value_model, weights must be given",
        "tasks": tasks,
        "value_model": dict(cfg.value_model),
        "num_dense": spec.num_dense,
        "features": [{"name": name, "cardinality": rows, "hotness": hotness,
                      "technique": technique} for name, rows, hotness, technique
                     in served_features(model, spec)],
        "interaction": cfg.model.interaction,
        "quantization": {"default": quantize, "tables": precisions},
        "tables": table_sizes(scoring.embeddings, precisions),
        "source": {"checkpoint": str(path.resolve()), "step": read_meta(path)["step"],
                   # the folder read (export reads its feature_spec), whole: recommend run
                   # elsewhere would read a relative path's namesake there
                   "data": str(Path(cfg.data.path).resolve()) if cfg.data.path else cfg.data.path,
                   "model": dataclasses.asdict(cfg.model)},
        "torch": torch.__version__,
    }
    text = json.dumps(description, indent=1)
    scripted = jit_script(scoring)
    _write_both(target, lambda p: jit_save(scripted, str(p), _extra_files={DESCRIPTION: text}),
                description_path(target), lambda p: p.write_text(text + "\n"))
    return description


def read_checkpoint(path: Path, overrides: Sequence[str] = (), retrieval: bool = False):
    """(config, data spec, unsharded model weights) of a checkpoint whose files are those it
    was written with, a ranker's or with `retrieval` a two_tower model's; `overrides` change
    its config."""
    check_checkpoint(path, print)
    cfg = load_config(str(checkpoint_config_path(path)), list(overrides))
    if retrieval and cfg.model.kind not in RETRIEVAL_KINDS:
        raise UserError(f"export: --retrieval is for two_tower and hstu checkpoints; {path} is a "
                        f"{cfg.model.kind} ranker: export it without --retrieval")
    if not retrieval and cfg.model.kind in RETRIEVAL_KINDS:
        raise UserError(f"export: {path} is a {cfg.model.kind} (retrieval) model; add --retrieval "
                        f"and give --out a new folder")
    return cfg, data_spec(cfg.data, cfg.model), read_model_state(path)


def require_folder_of(out: Path) -> None:
    """`out` can be written: its folder exists and it is not a folder itself."""
    if out.is_dir():
        raise UserError(f"--out: {out} is a folder; give a file name in it")
    if not out.parent.is_dir():
        raise UserError(f"--out: folder {out.parent} does not exist; create it first")


def description_path(artifact: Path) -> Path:
    return artifact.with_suffix(".json")


def table_precisions(tables: List[str], default: str, overrides: Sequence[str]) -> Dict[str, str]:
    """Each table's quantization: `default`, or NAME=PRECISION from `overrides`."""
    if default not in QUANTIZATIONS:
        raise UserError(f"--quantize: {default!r} is not one of {', '.join(QUANTIZATIONS)}")
    precisions = dict.fromkeys(tables, default)
    for item in overrides:
        name, _, precision = item.partition("=")
        if name not in precisions:
            raise UserError(f"--quantize-table {item}: no table {name!r}; the tables are "
                            f"{', '.join(tables)}")
        if precision not in QUANTIZATIONS:
            raise UserError(f"--quantize-table {item}: {precision!r} is not one of "
                            f"{', '.join(QUANTIZATIONS)}")
        precisions[name] = precision
    return precisions


def value_weights(tasks: List[str], value_model: Dict[str, float]) -> List[float]:
    """The value model as one weight per task, in `tasks` order (a task it leaves out: 0);
    empty without one."""
    return [float(value_model.get(task, 0.0)) for task in tasks] if value_model else []


def scoring_model(model: DLRM, weights: Dict[str, torch.Tensor],
                  precisions: Dict[str, str], value: Sequence[float] = (),
                  spec=None) -> ScoringModel:
    """The served form of `model` (built on the meta device) with the checkpoint's `weights`
    and the value model `value` (one weight per task, or none). A ranker with a sequence
    feature takes the dataset's columns (`spec`'s features), history slots and all, one id
    each: every key of its tables reads its own column."""
    parts = table_order(model.lookups)
    load_dense_weights(model, weights)
    tables = quantized_tables(parts, {p.table: weights[f"{TABLE_PREFIX}{p.table}.weight"]
                                      for p in parts}, precisions)
    model.eval().requires_grad_(False)
    features = served_features(model, spec)
    if model.sequence is not None:
        columns = [f[0] for f in features]
        keys = [(columns.index(key), 0, 0, -1) for key in model.lookup_keys]
        max_ids = [1] * len(columns)
        actions = [columns.index(k) for k in model.lookups[-1].parts[0].keys]
    else:
        keys = lookup_keys(model.lookups)
        max_ids = [lookup.slots if lookup.slots > 1 else 0 for lookup in model.lookups]
        actions = []
    return ScoringModel(
        tables, _num_dense(model), [f[0] for f in features], [f[1] for f in features],
        [k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys], [k[3] for k in keys],
        max_ids, model.embedding_dim, model.dense_arch, _scriptable(model.interaction),
        model.over_arch, model.combine_parts, isinstance(model.interaction, FactorizationMachine),
        model.tasks or ["click"], model.tasks is not None, list(value), model.sequence, actions,
        model.widen_parts)


def served_features(model: DLRM, spec) -> List[tuple]:
    """(name, cardinality, hotness, technique) of each feature the served model takes: one per
    lookup, or with a sequence feature the dataset's columns."""
    if model.sequence is not None:
        return [(name, rows, 1, "full") for name, rows
                in zip(spec.feature_names, spec.cardinalities)]
    return [(lookup.feature, lookup.rows, lookup.hotness, lookup.technique)
            for lookup in model.lookups]


def load_dense_weights(model: torch.nn.Module, weights: Dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's non-table `weights` into `model` (built on the meta device), after
    checking that they and its tables' are the ones `model.lookups` needs."""
    parts = table_order(model.lookups)
    dense = {k: v for k, v in weights.items() if not k.startswith(TABLE_PREFIX)}
    own = model.state_dict()
    for key, value in dense.items():
        if key in own and own[key].shape != value.shape:
            raise UserError(f"checkpoint: does not fit the model its config describes ({key}: "
                            f"{list(value.shape)} in the checkpoint, {list(own[key].shape)} in "
                            f"the model); {_OTHER_MODEL}")
    missing, unexpected = model.load_state_dict(dense, strict=False)
    missing = [k for k in missing if not k.startswith(TABLE_PREFIX)]
    if missing or unexpected:
        raise UserError(f"checkpoint: does not fit the model its config describes (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}); {_OTHER_MODEL}")
    absent = [p.table for p in parts if f"{TABLE_PREFIX}{p.table}.weight" not in weights]
    if absent:
        raise UserError(f"checkpoint: has no table {absent[0]}, which the model its config "
                        f"describes has; {_OTHER_MODEL}")


_OTHER_MODEL = ("it was trained with other model settings: export it with the config it was "
                "written with (no --set model.*)")


def _scriptable(interaction: torch.nn.Module) -> torch.nn.Module:
    """dcn's cross network in a form TorchScript compiles (also under model.task_dot_dim's
    per-task dots); the other interactions as they are."""
    if isinstance(interaction, TaskDotsInteraction):
        return interaction.around(_scriptable(interaction.inner))
    if isinstance(interaction, InteractionDCNArch):
        return InteractionDCNArch(interaction.F, _scriptable_crossnet(interaction.crossnet))
    return interaction


def _scriptable_crossnet(crossnet: torch.nn.Module) -> torch.nn.Module:
    """torchrec's cross networks index their layers' parameters with a loop variable, which
    TorchScript cannot: the same tensors, stacked."""
    if isinstance(crossnet, WithInput):  # structure parallel
        return WithInput(_scriptable_crossnet(crossnet.crossnet))
    if isinstance(crossnet, LowRankMixtureCrossNet):
        return StackedMixtureCrossNet(crossnet)
    return StackedCrossNet(crossnet)


def _num_dense(model: DLRM) -> int:
    return model.dense_arch.num_dense


def lookup_keys(lookups: List[FeatureLookup]) -> List[tuple]:
    """(feature index, transform, modulus, slot) of every lookup key, in the tables' order (the
    order of ScoringModel's arguments)."""
    owner = {part.table: (index, lookup) for index, lookup in enumerate(lookups)
             for part in lookup.tables}
    keys = []
    for part in table_order(lookups):
        index, lookup = owner[part.table]
        for slot in range(len(part.keys)):
            keys.append((index, _transform(lookup, part), lookup.modulus,
                         slot if len(part.keys) > 1 else -1))
    return keys


def _transform(lookup: FeatureLookup, part: Part) -> int:
    if lookup.technique == "hash":
        return 1
    if lookup.technique == "qr":
        return 2 if part.table.endswith("_q") else 3
    return 0


def quantized_tables(parts: List[Part], weights: Dict[str, torch.Tensor],
                     precisions: Dict[str, str]) -> torch.nn.Module:
    """fbgemm's inference tables, in host memory, holding `weights`: fp32, fp16, or quantized
    row-wise (`rowwise`: codes made with the fp16 scale and bias they are stored with)."""
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (BoundsCheckMode,
                                                                      EmbeddingLocation,
                                                                      PoolingMode)
    from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
        IntNBitTableBatchedEmbeddingBagsCodegen)

    types = {name: SparseType(name) for name in QUANTIZATIONS}
    for part in parts:
        if precisions[part.table] == "int4" and part.dim % 2:
            raise UserError(f"--quantize: int4 packs two values per byte and table {part.table} "
                            f"is {part.dim} wide; give it int8 (--quantize-table "
                            f"{part.table}=int8)")
    table_of = {part.table: t for t, part in enumerate(parts)}
    tables = IntNBitTableBatchedEmbeddingBagsCodegen(
        [(p.table, p.rows, p.dim, types[precisions[p.table]], EmbeddingLocation.HOST)
         for p in parts],
        feature_table_map=[table_of[p.table] for p in parts for _ in p.keys],
        pooling_mode=PoolingMode.SUM, device="cpu", output_dtype=SparseType.FP32,
        indices_dtype=torch.int64,
        # ScoringModel refuses ids outside their feature's table, and its transforms keep
        # them inside each part: fbgemm's own check (a tenth of a call's time) is redundant.
        bounds_check_mode=BoundsCheckMode.NONE)
    tables.initialize_weights()
    for part, (codes, scale_bias) in zip(parts, tables.split_embedding_weights()):
        weight = weights[part.table].float()
        if tuple(weight.shape) != (part.rows, part.dim):
            raise UserError(f"checkpoint: table {part.table} is {tuple(weight.shape)}, its config "
                            f"says ({part.rows}, {part.dim})")
        precision = precisions[part.table]
        if precision in ("int8", "int4"):
            quantize_into(weight, types[precision].bit_rate(), codes, scale_bias, part.table)
        else:
            codes.copy_(weight.to(torch.float16 if precision == "fp16" else torch.float32
                                  ).view(torch.uint8))
    return tables


def table_sizes(tables, precisions: Dict[str, str]) -> List[dict]:
    """Each table's name, shape, quantization and bytes (rows x (data + scale and bias))."""
    out = []
    for (name, rows, dim, _, _), (weight, scale_shift) in zip(tables.embedding_specs,
                                                                tables.split_embedding_weights()):
        size = weight.numel() + (0 if scale_shift is None else scale_shift.numel())
        out.append({"name": name, "rows": rows, "dim": dim, "quantization": precisions[name],
                    "bytes": int(size)})
    return out


def _write_both(first: Path, write_first, second: Path, write_second) -> None:
    """Both files or neither: each is written beside its name, then both are renamed."""
    partials = [temporary_beside(p) for p in (first, second)]
    try:
        write_first(partials[0])
        write_second(partials[1])
        os.replace(partials[0], first)
        os.replace(partials[1], second)
    finally:
        for partial in partials:
            partial.unlink(missing_ok=True)
