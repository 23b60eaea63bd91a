"""What `recommend` loads, each checked against the others once: the retrieval folder (with the
raw ids that reach the ranker's), the graph built from its dataset, the multi-task ranker and the
dataset it was trained on, the value model's weights."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from dlrm_hybrid.errors import UserError


def open_retriever(folder: str):
    from dlrm_hybrid.serve.retrieve import DESCRIPTION, Retriever

    if not (Path(folder) / DESCRIPTION).is_file():
        raise UserError(f"--retrieval: {folder} has no {DESCRIPTION}; give a folder `export "
                        f"--retrieval` wrote")
    retriever = Retriever(folder)
    if retriever.item_names is None or retriever.user_names is None:
        raise UserError(f"--retrieval: {folder} has no users.txt/items.txt (its dataset had no "
                        f"raw ids); recommend needs them to reach the ranker's ids")
    return retriever


def check_graph(description: dict, retriever, pixie: str) -> None:
    """The graph and the retrieval folder come from one dataset (its train engagements)."""
    from dlrm_hybrid.graph.bipartite import dataset_digest

    have = (description.get("source") or {}).get("dataset_digest")
    want = dataset_digest(len(retriever.user_side), len(retriever.item_vectors),
                          retriever.seen_indptr, retriever.seen_items)
    if have != want:
        raise UserError(f"--pixie: {pixie} was built from another dataset than the retrieval "
                        f"model's (graph.yaml's dataset_digest {have} is not {want}); build it "
                        f"with `pixie build --data` the retrieval model's dataset")


def open_ranker(path: str):
    from dlrm_hybrid.serve.export import FORMAT_MULTITASK
    from dlrm_hybrid.serve.predict import load_scoring_model

    try:
        module, description = load_scoring_model(Path(path))
    except UserError as e:  # predict's loader names its own flag
        if not str(e).startswith("--model: "):
            raise
        raise UserError("--ranker: " + str(e)[len("--model: "):]) from None
    if description.get("format") != FORMAT_MULTITASK:
        raise UserError(f"--ranker: {path} is not a multi-task ranker (format "
                        f"{description.get('format')!r}); give one trained with model.tasks on "
                        f"a `preprocess interactions --labels` dataset")
    return module, description


def trained_on(description: dict, ranker: str) -> str:
    data = (description.get("source") or {}).get("data")
    if not data:
        raise UserError(f"--ranker-data: {ranker}'s description does not say which dataset it "
                        f"was trained on; give --ranker-data, its ranking dataset folder")
    if not Path(data).is_absolute() and not Path(data).exists():
        raise UserError(f"--ranker-data: {ranker} names its dataset {data}, a path relative to "
                        f"where it was trained, not found from here; give --ranker-data, its "
                        f"ranking dataset folder")
    return data


def check_ranker(description: dict, features, ranker: str) -> None:
    """The ranker reads the dataset's features: as many, with the same sizes."""
    sizes = [f["cardinality"] for f in description["features"]]
    want = list(features.spec.cardinalities)
    if sizes != want or description["num_dense"] != features.spec.num_dense:
        raise UserError(f"--ranker: {ranker} was trained on other data than {features.path} (its "
                        f"features' sizes {sizes} and {description['num_dense']} dense, the "
                        f"dataset's {want} and {features.spec.num_dense}); give the ranking "
                        f"dataset it was trained on")


def value_model_weights(value: Optional[Dict[str, float]], tasks: List[str],
                        description: dict):
    """The value model as a [T] tensor in `tasks` order; None: the ranker's own."""
    import torch

    from dlrm_hybrid.serve.export import value_weights

    if value is not None and not value:
        raise UserError(f"--value: names no task; give TASK=WEIGHT for some of {', '.join(tasks)}")
    if value is None:
        if not description.get("value_model"):
            raise UserError(f"--value: the ranker was exported without a value model; give "
                            f"weights, e.g. --value {','.join(f'{t}=1' for t in tasks)}")
        return None
    for name, weight in value.items():
        if name not in tasks:
            raise UserError(f"--value: no task {name!r}; the ranker's tasks are "
                            f"{', '.join(tasks)}")
        if not np.isfinite(weight):
            raise UserError(f"--value: {name}'s weight {weight} is not a finite number")
    return torch.tensor(value_weights(tasks, value), dtype=torch.float32)
