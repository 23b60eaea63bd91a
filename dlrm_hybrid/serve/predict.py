"""`predict`: score a split-binary dataset, or a CSV/TSV file of preprocessed rows, with an
exported model file, writing one click probability per line (in row order) and, where the data
has labels, printing AUC and log loss. The output appears whole or not at all."""

from __future__ import annotations

import importlib
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Iterator, List, Tuple

import numpy as np
import torch
from torch.nn.functional import binary_cross_entropy

from dlrm_hybrid.data.batch import Columns
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.text_rows import HEADERS, ScoringRows, text_row_chunks
from dlrm_hybrid.errors import DataError, UserError
from dlrm_hybrid.serve.export import (DESCRIPTION, FORMAT, FORMAT_FP32_CODED,
                                      require_folder_of)
from dlrm_hybrid.serve.raw_rows import raw_criteo_chunks
from dlrm_hybrid.train.checkpoint import META
from dlrm_hybrid.train.evaluate import auc_or_nan


def load_scoring_model(path: Path) -> Tuple[torch.jit.ScriptModule, dict]:
    """An `export`ed file and the description stored in it."""
    importlib.import_module("fbgemm_gpu")  # registers the embedding kernels the file calls

    if (path / META).is_file():
        raise UserError(f"--model: {path} is a checkpoint; export it first (export --checkpoint "
                        f"{path} --out model.pt) and give that file")
    if (path / "retrieval.yaml").is_file():
        raise UserError(f"--model: {path} is a two_tower retrieval export, which `predict` does "
                        f"not score; query it with `retrieve --model {path} --user USER`")
    if not path.is_file():
        raise UserError(f"--model: {path} {'is a folder' if path.is_dir() else 'does not exist'}"
                        f"; give a file `export` wrote")
    extra = {DESCRIPTION: ""}
    try:
        module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
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
    elif description.get("format") != FORMAT:
        raise DataError(f"{path}: was not written by `export` (format "
                        f"{description.get('format')!r}, expected {FORMAT})")
    return module, description


def predict(model_path: str, data: str, out: str, split: str = "test",
            batch_size: int = 4096, header: str = "auto", raw_criteo: str = "") -> dict:
    """Score every row of `data`; returns {"samples", and "auc", "logloss" when labelled}.
    `header` (CSV/TSV): whether the first line is a header, "yes", "no" or "auto".
    `raw_criteo`: `data` is raw Criteo TSV, mapped to ids by this dataset's vocabulary.
    Ids are checked here as well as in the model: here the error can name the row."""
    target = Path(out)
    require_folder_of(target)
    if target.resolve() == Path(data).resolve():
        raise UserError(f"--out: {out} is the data being scored; write elsewhere")
    module, description = load_scoring_model(Path(model_path))
    cardinalities = [f["cardinality"] for f in description["features"]]
    names = [f["name"] for f in description["features"]]
    chunks = _chunks(Path(data), split, description, batch_size, header, raw_criteo)
    partial = target.with_name(target.name + ".partial")
    probabilities, labels = [], []
    try:
        with open(partial, "w") as stream, torch.inference_mode():
            for rows in chunks:
                _check_ids(rows, names, cardinalities)
                p = score(module, rows)
                np.savetxt(stream, p, fmt="%.7g")
                probabilities.append(p)
                if rows.labels is not None:
                    labels.append(rows.labels)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    scores = np.concatenate(probabilities) if probabilities else np.zeros(0, np.float32)
    result = {"samples": len(scores)}
    if labels:
        result.update(metrics(scores, np.concatenate(labels)))
    return result


def _chunks(path: Path, split: str, description: dict, batch_size: int, header: str,
            raw_criteo: str = "") -> Iterator[ScoringRows]:
    num_dense, features = description["num_dense"], description["features"]
    if header not in HEADERS:
        raise UserError(f"--header: {header!r} is not one of {', '.join(HEADERS)}")
    if raw_criteo:
        if header != "auto":
            raise UserError("--header: is for CSV/TSV files of ids; raw Criteo rows have none")
        if not path.is_file():
            raise UserError(f"--data: {path} {'is a folder' if path.is_dir() else 'does not exist'}"
                            f"; with --raw-criteo give a raw Criteo TSV file (.gz ok)")
        return raw_criteo_chunks(path, raw_criteo, num_dense, features, batch_size)
    if path.is_dir():
        if header != "auto":
            raise UserError(f"--header: is for CSV/TSV files; {path} is a split-binary folder")
        return _split_binary_chunks(path, split, num_dense, features, batch_size)
    if not path.is_file():
        raise UserError(f"--data: {path} does not exist; give a split-binary folder or a "
                        f".csv/.tsv file")
    return text_row_chunks(path, num_dense, [f["name"] for f in features], batch_size, header)


def _split_binary_chunks(path: Path, split: str, num_dense: int, features: List[dict],
                         batch_size: int) -> Iterator[ScoringRows]:
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
    return _read_split(dataset, split, batch_size)


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


def score(module, rows: ScoringRows) -> np.ndarray:
    try:
        return module.score_bags(*bags_input(rows)).numpy()
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


def metrics(scores: np.ndarray, labels: np.ndarray) -> dict:
    """AUC (nan, with a warning, for one class only) and log loss of probabilities."""
    p, y = torch.from_numpy(scores).double(), torch.from_numpy(labels).double()
    return {"auc": auc_or_nan(p, y, "auc"), "logloss": binary_cross_entropy(p, y).item()}
