"""`predict`: score a split-binary dataset, or a CSV/TSV file of preprocessed rows, with an
exported model file, writing one click probability per line (in row order) and, where the data
has labels, printing AUC and log loss. A multi-task model (or one with a value model) writes a
CSV with a header instead: each task's probability, then the value model's `value`; per-task
metrics leave out missing labels. `--top-k-label K` also writes, per request, which rows are
its top K by value: the distillation label of a first-stage ranker. The outputs appear whole
or not at all."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.nn.functional import binary_cross_entropy

from dlrm_hybrid.compat import jit_load
from dlrm_hybrid.data.batch import Columns
from dlrm_hybrid.data.feature_spec import load_feature_spec
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.text_rows import HEADERS, ScoringRows, text_row_chunks
from dlrm_hybrid.errors import DataError, UserError
from dlrm_hybrid.serve.export import (DESCRIPTION, FORMAT, FORMAT_FP32_CODED, FORMAT_MULTITASK,
                                      require_folder_of, value_weights)
from dlrm_hybrid.serve.raw_rows import raw_criteo_chunks
from dlrm_hybrid.train.checkpoint import META
from dlrm_hybrid.train.evaluate import auc_or_nan
from dlrm_hybrid.output_paths import temporary_beside


def load_scoring_model(path: Path) -> Tuple[torch.jit.ScriptModule, dict]:
    """An `export`ed file and the description stored in it."""
    importlib.import_module("fbgemm_gpu")  # registers the embedding kernels the file calls

    if (path / META).is_file():
        raise UserError(f"--model: {path} is a checkpoint; export it first (export --checkpoint "
                        f"{path} --out model.pt) and give that file")
    if (path / "retrieval.yaml").is_file():
        raise UserError(f"--model: {path} is a retrieval export (two_tower or hstu), which "
                        f"`predict` does not score; query it with `retrieve --model {path} --user "
                        f"USER`")
    if not path.is_file():
        raise UserError(f"--model: {path} {'is a folder' if path.is_dir() else 'does not exist'}"
                        f"; give a file `export` wrote")
    extra = {DESCRIPTION: ""}
    try:
        module = jit_load(str(path), map_location="cpu", _extra_files=extra)
        description = json.loads(extra[DESCRIPTION] or "{}")
    except (RuntimeError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
        raise DataError(f"{path}: not a readable model file ({reason}); it is truncated or "
                        f"corrupt, export it again") from None
    if not extra[DESCRIPTION]:
        raise DataError(f"{path}: a TorchScript file without {DESCRIPTION}, so not one `export` "
                        f"wrote; export the checkpoint with this program")
    if description.get("format") == FORMAT_FP32_CODED:
        if "int8" in description["quantization"]["tables"].values():
            warnings.warn(f"{path}: its int8 tables were quantized by an earlier `export`, up to "
                          f"8x less precisely for rows narrower than 0.016; export the "
                          f"checkpoint again")
    elif description.get("format") not in (FORMAT, FORMAT_MULTITASK):
        raise DataError(f"{path}: was not written by `export` (format "
                        f"{description.get('format')!r}, expected {FORMAT})")
    return module, description


@dataclasses.dataclass
class Outputs:
    """What `predict` writes for a model: its tasks, whether it has several (a header and one
    column each), and the value weights applied (None: the file's own value model; no `value`
    column where it has none and none were given)."""

    tasks: List[str]
    multi_task: bool
    weights: Optional[torch.Tensor]
    value_model: Dict[str, float]  # the value model applied, for the user; empty: none

    @property
    def valued(self) -> bool:
        return bool(self.value_model)

    @property
    def columns(self) -> List[str]:
        return self.tasks + ["value"] * self.valued


def predict(model_path: str, data: str, out: str, split: str = "test",
            batch_size: int = 4096, header: str = "auto", raw_criteo: str = "",
            value: str = "", top_k_label: int = 0, label_out: str = "",
            request_feature: str = "") -> dict:
    """Score every row of `data`; returns {"samples", and "auc", "logloss" when labelled}
    (several tasks: "auc_<task>", "logloss_<task>" of each labelled one, and "value_model").
    `header` (CSV/TSV): whether the first line is a header, "yes", "no" or "auto".
    `raw_criteo`: `data` is raw Criteo TSV, mapped to ids by this dataset's vocabulary.
    `value`: "task=weight,..." in place of the file's value model. `top_k_label` K > 0: write
    to `label_out` 1 for each row among the K of highest value of its request (the
    rows with one id of `request_feature`, or of the feature the dataset records), else 0.
    Ids are checked here as well as in the model: here the error can name the row."""
    targets = _targets(out, label_out, data, top_k_label)
    module, description = load_scoring_model(Path(model_path))
    outputs = _outputs(description, value)
    if top_k_label and not outputs.valued:
        raise UserError(f"--top-k-label: ranks rows by the value model, and {model_path} was "
                        f"exported without one (value_model); give --value "
                        f"{','.join(f'{t}=1' for t in outputs.tasks)} or other weights")
    names = [f["name"] for f in description["features"]]
    request = _request_index(Path(data), request_feature, names) if top_k_label else None
    cardinalities = [f["cardinality"] for f in description["features"]]
    chunks = _chunks(Path(data), split, description, batch_size, header, raw_criteo,
                     outputs.tasks if outputs.multi_task else None)
    partials = [temporary_beside(target) for target in targets]
    scored, labels, requests = [], [], []
    try:
        with open(partials[0], "w") as stream, torch.inference_mode():
            if outputs.multi_task or outputs.valued:
                stream.write(",".join(outputs.columns) + "\n")
            for rows in chunks:
                _check_ids(rows, names, cardinalities)
                table = score(module, rows, outputs)
                np.savetxt(stream, table, fmt="%.7g", delimiter=",")
                scored.append(table)
                if rows.labels is not None:
                    labels.append(rows.labels)
                if request is not None:
                    requests.append(_request_ids(rows, request, names[request]))
        table = np.concatenate(scored) if scored else np.zeros((0, len(outputs.columns)))
        if top_k_label:
            ids = np.concatenate(requests) if requests else np.zeros(0, np.int64)
            np.savetxt(partials[1], top_k_labels(ids, table[:, -1], top_k_label), fmt="%d")
        for partial, target in zip(partials, targets):  # both written: now both in place
            os.replace(partial, target)
    finally:
        for partial in partials:
            partial.unlink(missing_ok=True)
    result = {"samples": len(table)}
    if labels:
        result.update(_task_metrics(table, np.concatenate(labels), outputs))
    if outputs.multi_task or outputs.valued:
        result["value_model"] = outputs.value_model
    return result


def _targets(out: str, label_out: str, data: str, top_k_label: int) -> List[Path]:
    """--out (and --label-out): files that can be written, none of them the data."""
    if top_k_label < 0:
        raise UserError(f"--top-k-label: {top_k_label}; give K >= 1, the rows per request "
                        f"labelled 1")
    if bool(top_k_label) != bool(label_out):
        raise UserError("--top-k-label K and --label-out FILE go together: the labels of "
                        "each request's top K rows are written to FILE")
    targets = [Path(out)] + ([Path(label_out)] if label_out else [])
    for flag, target in zip(("--out", "--label-out"), targets):
        require_folder_of(target)
        if target.resolve() == Path(data).resolve():
            raise UserError(f"{flag}: {target} is the data being scored; write elsewhere")
    if label_out and targets[0].resolve() == targets[1].resolve():
        raise UserError(f"--label-out: {label_out} is --out as well; give another file")
    return targets


def _outputs(description: dict, value: str) -> Outputs:
    tasks = description.get("tasks", ["click"])
    exported = description.get("value_model") or {}
    weights = parse_value(value, tasks) if value else None
    applied = dict(zip(tasks, weights.tolist())) if weights is not None else exported
    return Outputs(tasks, description["format"] == FORMAT_MULTITASK, weights, applied)


def parse_value(text: str, tasks: List[str]) -> torch.Tensor:
    """`--value click=1,like=0.5`: one weight per task, in `tasks` order (unnamed tasks: 0)."""
    model: Dict[str, float] = {}
    for item in text.split(","):
        name, equals, number = (part.strip() for part in item.partition("="))
        if name not in tasks:
            raise UserError(f"--value {item.strip()}: no task {name!r}; the model's tasks are "
                            f"{', '.join(tasks)} (e.g. --value {tasks[0]}=1)")
        try:
            weight = float(number) if equals else float("nan")
        except ValueError:
            weight = float("nan")
        if not np.isfinite(weight):
            raise UserError(f"--value {item.strip()}: {number!r} is not a finite number; give "
                            f"TASK=WEIGHT, e.g. {name}=0.5")
        if name in model:
            raise UserError(f"--value {text}: task {name} is given twice; give each once")
        model[name] = weight
    return torch.tensor(value_weights(tasks, model), dtype=torch.float32)


def _request_index(data: Path, flag: str, features: List[str]) -> int:
    """The feature whose id names a row's request: --request-feature, else the one a
    split-binary dataset's feature_spec.yaml records (metadata.request_feature). A name is the
    model's (cat_<i>) or the dataset's own (metadata.categorical_features, in cat_<i> order)."""
    notes = load_feature_spec(str(data)).notes if data.is_dir() else {}
    name = flag or notes.get("request_feature")
    if not name:
        raise UserError(f"--top-k-label: which feature names a row's request? {data} records "
                        f"none (metadata.request_feature); give --request-feature NAME, one of "
                        f"{', '.join(features)}")
    own = list(notes.get("categorical_features") or [])
    if name in features:
        return features.index(name)
    if name in own and len(own) == len(features):
        return own.index(name)
    source = "--request-feature" if flag else f"{data}: metadata.request_feature"
    raise UserError(f"{source}: {name!r} is not a feature of the model; its features are "
                    f"{', '.join(features)}")


def _request_ids(rows: ScoringRows, f: int, name: str) -> np.ndarray:
    if (rows.lengths[f] != 1).any():
        i = int(np.argwhere(rows.lengths[f] != 1)[0, 0])
        raise DataError(f"{rows.locate(i)}: request feature {name} has {rows.lengths[f][i]} ids; "
                        f"a request is named by one id per row")
    return rows.ids[f][:, 0]


def top_k_labels(requests: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """1 for each row among the `k` of highest value in its request (every row with its
    request id, wherever it is: a ranking log's shuffled train split too; ties: the earlier
    row first), else 0."""
    order = np.lexsort((-values, requests))  # by request, then value; stable: ties in row order
    grouped = requests[order]
    first = np.ones(len(order), bool)  # a request's first row in `order`
    first[1:] = grouped[1:] != grouped[:-1]
    starts = np.flatnonzero(first)
    labels = np.zeros(len(values), np.int8)
    labels[order] = (np.arange(len(order)) - starts[np.cumsum(first) - 1]) < k
    return labels


def _chunks(path: Path, split: str, description: dict, batch_size: int, header: str,
            raw_criteo: str = "", tasks: Optional[List[str]] = None) -> Iterator[ScoringRows]:
    """The rows of `path`, labels [B] for a single-task model, [B, T] for `tasks` (NaN where
    the data lacks a task's label)."""
    num_dense, features = description["num_dense"], description["features"]
    if header not in HEADERS:
        raise UserError(f"--header: {header!r} is not one of {', '.join(HEADERS)}")
    if raw_criteo:
        if header != "auto":
            raise UserError("--header: is for CSV/TSV files of ids; raw Criteo rows have none")
        if not path.is_file():
            raise UserError(f"--data: {path} {'is a folder' if path.is_dir() else 'does not exist'}"
                            f"; with --raw-criteo give a raw Criteo TSV file (.gz ok)")
        chunks = raw_criteo_chunks(path, raw_criteo, num_dense, features, batch_size)
        return chunks if tasks is None else _task_labels(chunks, ["click"], tasks)
    if path.is_dir():
        if header != "auto":
            raise UserError(f"--header: is for CSV/TSV files; {path} is a split-binary folder")
        return _split_binary_chunks(path, split, num_dense, features, batch_size, tasks)
    if not path.is_file():
        raise UserError(f"--data: {path} does not exist; give a split-binary folder or a "
                        f".csv/.tsv file")
    return text_row_chunks(path, num_dense, [f["name"] for f in features], batch_size, header,
                           tasks)


def _split_binary_chunks(path: Path, split: str, num_dense: int, features: List[dict],
                         batch_size: int, tasks: Optional[List[str]]) -> Iterator[ScoringRows]:
    dataset = SplitBinaryDataset(str(path))
    spec: DataSpec = dataset.fspec.spec
    if spec.num_dense != num_dense or len(spec.cardinalities) != len(features):
        raise DataError(f"{path}: {spec.num_dense} dense and {len(spec.cardinalities)} "
                        f"categorical features, the model takes {num_dense} and {len(features)}; "
                        f"score data preprocessed like its training data")
    for name, rows, feature in zip(spec.feature_names, spec.cardinalities, features):
        if rows != feature["cardinality"]:
            raise DataError(f"{path}: feature {name} has {rows:,} ids (feature_spec.yaml), the "
                            f"model's table for {feature['name']} {feature['cardinality']:,}; "
                            f"score data preprocessed like its training data")
    if split not in dataset.sizes:
        raise UserError(f"--split: {path} has no {split} split; it has {', '.join(dataset.sizes)}")
    labels = list(dataset.label_names)
    if tasks is None and labels == ["click"]:
        return _read_split(dataset, split, batch_size)  # the one click label, [B]
    known = [t for t in (tasks or ["click"]) if t in labels]
    dataset.use_tasks(known or labels[:1], str(path))
    chunks = _task_labels(_read_split(dataset, split, batch_size), known, tasks or ["click"])
    return chunks if tasks is not None else (_flat_labels(rows) for rows in chunks)


def _task_labels(chunks: Iterator[ScoringRows], names: List[str], tasks: List[str]
                 ) -> Iterator[ScoringRows]:
    """Chunks whose labels [B] or [B, len(names)] are those of `names` as [B, T]: one column
    per task, NaN where the data has no label of that task."""
    for rows in chunks:
        if rows.labels is not None:
            given = rows.labels.reshape(len(rows.labels), -1)
            labels = np.full((len(given), len(tasks)), np.nan, np.float32)
            for j, name in enumerate(names):
                if name in tasks:
                    labels[:, tasks.index(name)] = given[:, j]
            rows.labels = labels
        yield rows


def _flat_labels(rows: ScoringRows) -> ScoringRows:
    """A single-task model's labels as [B] (NaN: missing, left out of its metrics)."""
    rows.labels = rows.labels[:, 0]
    return rows


def _read_split(dataset: SplitBinaryDataset, split: str, batch_size: int
                ) -> Iterator[ScoringRows]:
    total = dataset.num_samples(split)
    for first in range(0, total, batch_size):
        yield scoring_rows(dataset.columns(split, first, min(batch_size, total - first)),
                           _sample_locator(split, first))


def _sample_locator(split: str, first: int) -> Callable[[int], str]:
    return lambda i: f"{split} sample {first + i:,}"


def scoring_rows(c: Columns, locate: Callable[[int], str]) -> ScoringRows:
    lengths = c.lengths or [np.full(len(c.labels), i.shape[1], np.int64) for i in c.ids]
    return ScoringRows(c.dense, c.ids, lengths, c.labels, locate)


def _check_ids(rows: ScoringRows, names: List[str], cardinalities: List[int]) -> None:
    for name, ids, lengths, rows_of_table in zip(names, rows.ids, rows.lengths, cardinalities):
        used = np.arange(ids.shape[1]) < lengths[:, None]
        bad = used & ((ids < 0) | (ids >= rows_of_table))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise DataError(f"{rows.locate(int(i))}: id {ids[i, j]} of feature {name} is outside "
                            f"its table (0..{rows_of_table - 1}); the data was preprocessed for "
                            f"another model")


def score(module, rows: ScoringRows, outputs: Optional[Outputs] = None) -> np.ndarray:
    """The rows' probabilities [B]; with `outputs` of several tasks or a value model, a table
    [B, T] or [B, T + 1], the value last."""
    try:
        if outputs is None or not outputs.valued:
            p = module.score_bags(*bags_input(rows)).numpy()
            return p if outputs is None else p.reshape(len(p), -1)
        probabilities, value = module.score_bags_with_value(*bags_input(rows), outputs.weights)
        return torch.cat([probabilities, value[:, None]], 1).numpy()
    except torch.jit.Error as e:  # the model's own checks: its message is the last line
        reason = next((line.split(": ", 1)[1] for line in reversed(str(e).splitlines())
                       if line.startswith("builtins.")), str(e).splitlines()[-1])
        raise DataError(f"{rows.locate(0)} (a chunk of {len(rows.dense)} rows): {reason}"
                        ) from None


def bags_input(rows: ScoringRows) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """score_bags' arguments (the jagged layout: no padding across features of different
    hotness)."""
    values = np.concatenate([ids[np.arange(ids.shape[1]) < n[:, None]]
                             for ids, n in zip(rows.ids, rows.lengths)])
    lengths = np.stack(rows.lengths).astype(np.int64)
    return torch.from_numpy(rows.dense), torch.from_numpy(values), torch.from_numpy(lengths)


def _task_metrics(table: np.ndarray, labels: np.ndarray, outputs: Outputs) -> dict:
    """Single-task without a value model: "auc", "logloss" (as before tasks existed); else
    each task's that has labels, over the rows that have them."""
    labels = labels.reshape(len(labels), -1)
    if not outputs.multi_task and not outputs.valued:
        keep = ~np.isnan(labels[:, 0])
        return metrics(table[keep, 0], labels[keep, 0]) if keep.any() else {}
    result = {}
    for t, task in enumerate(outputs.tasks):
        keep = ~np.isnan(labels[:, t])
        if keep.any():
            found = metrics(table[keep, t], labels[keep, t])
            result.update({f"{k}_{task}": v for k, v in found.items()})
    return result


def metrics(scores: np.ndarray, labels: np.ndarray) -> dict:
    """AUC (nan, with a warning, for one class only) and log loss of probabilities."""
    p, y = torch.from_numpy(scores).double(), torch.from_numpy(labels).double()
    return {"auc": auc_or_nan(p, y, "auc"), "logloss": binary_cross_entropy(p, y).item()}
