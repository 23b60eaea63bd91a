"""The configured dataset (planted synthetic, or a split-binary folder at `data.path`) and the
configured loader over one rank's slices of it."""

from __future__ import annotations

from typing import Sequence

from dlrm_hybrid.config import RETRIEVAL_KINDS
from dlrm_hybrid.data.interactions.interaction_data import InteractionData, open_interactions
from dlrm_hybrid.data.interactions.interaction_meta import META_FILE, is_interaction_folder
from dlrm_hybrid.data.loader import PrefetchLoader, rank_batches, rank_columns
from dlrm_hybrid.data.split_binary import SPLIT_NAMES, SplitBinaryDataset
from dlrm_hybrid.data.interactions.planted_interactions import planted_interactions
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.errors import DataError


def open_dataset(data_cfg, model_cfg=None, retrieval_cfg=None):
    """The ranker's dataset, its labels those of `model_cfg.tasks` (one click label if none);
    `model_cfg.kind` two_tower reads interaction logs (data/interactions/interaction_data.py), with the
    side features its towers read, and for training (`retrieval_cfg` given) its training
    batches carry `retrieval.uniform_negatives`."""
    if model_cfg is not None and model_cfg.kind in RETRIEVAL_KINDS:
        dataset = open_interaction_dataset(data_cfg).for_model(model_cfg)
        if retrieval_cfg is not None:
            dataset.set_uniform_negatives(retrieval_cfg.uniform_negatives,
                                          data_cfg.global_batch_size, data_cfg.seed)
        return dataset
    if is_interaction_folder(data_cfg.path):
        raise DataError(f"data.path: {data_cfg.path} is an interaction log for retrieval; train "
                        f"it with model.kind=two_tower or hstu, or give the ranker a click-log "
                        f"dataset")
    tasks = [t.name for t in model_cfg.tasks] if model_cfg is not None else []
    dataset = (SplitBinaryDataset(data_cfg.path) if data_cfg.path
               else SyntheticClicks(data_cfg, data_cfg.labels or tasks))
    dataset.use_tasks(tasks, data_cfg.path or "the planted synthetic data")
    return dataset


def open_interaction_dataset(data_cfg) -> InteractionData:
    if not data_cfg.path:
        return planted_interactions(data_cfg)
    if not is_interaction_folder(data_cfg.path):
        raise DataError(f"data.path: {data_cfg.path} has no {META_FILE}; the retrieval models "
                        f"(model.kind two_tower, hstu) read a folder made by `dlrm_hybrid "
                        f"preprocess interactions`")
    return open_interactions(data_cfg.path)


def require_samples(dataset, splits: Sequence[str], where: str) -> None:
    """Stop at start, in one line, when a split that `where` (e.g. "training", "eval") reads is
    empty: later it would fail inside the first evaluation with a raw traceback."""
    for split in splits:
        if dataset.num_samples(split):
            continue
        if isinstance(dataset, InteractionData) and not dataset.root:  # hstu: 2+ per user
            raise DataError(f"planted interactions: the {split} split has no samples and "
                            f"{where} reads it (hstu trains on users with two or more training "
                            f"engagements); set data.interactions_per_user to 4 or more")
        if isinstance(dataset, InteractionData):
            raise DataError(f"{dataset.root}: the {split} split has no samples and {where} reads "
                            f"it; preprocess with more users or another split rule")
        if isinstance(dataset, SplitBinaryDataset):
            raise DataError(f"{dataset.fspec.root}: the {SPLIT_NAMES[split]} split has no samples "
                            f"and {where} reads it; preprocess again with rows for it (Criteo day "
                            f"files: include day_23, or use --split hash)")
        key = "data.train_samples" if split == "train" else "data.val_samples"
        raise DataError(f"synthetic data: the {SPLIT_NAMES[split]} split has no samples and "
                        f"{where} reads it; set {key} above 0")


def require_one_batch(dataset, global_batch: int, world_size: int) -> None:
    """Stop at start, before the plan is printed or the run folder touched, in one line, when the
    training split holds fewer samples than one global batch: no step could be read."""
    n = dataset.num_samples("train")
    if n >= global_batch:
        return
    fits = n // world_size * world_size  # a batch the world size divides
    lower = (f"lower data.global_batch_size to at most {fits}" if fits
             else f"use fewer ranks than {world_size}")
    batch = f"one global batch (data.global_batch_size={global_batch})"
    if isinstance(dataset, SplitBinaryDataset):
        where = dataset.fspec.root
    elif isinstance(dataset, InteractionData):
        where = dataset.root or "planted interactions"
    else:
        raise DataError(f"synthetic data: data.train_samples={n} is fewer than {batch}; {lower}, "
                        f"or raise data.train_samples")
    raise DataError(f"{where}: its training split holds {n:,} samples, fewer than {batch}; "
                    f"{lower}, or train on more data")


def make_loader(data_cfg, dataset, split: str, env, seed: int = 0, start_step: int = 0,
                on_device: bool = True):
    """This rank's batches of `split` on its device (or pinned on the host, for a consumer that
    copies them itself): endless for "train" (from `start_step`), one pass otherwise. On a GPU
    the torch loader has a dataset that can (the planted synthetic data) make each batch there,
    whatever `on_device` says: nothing to copy."""
    args = (dataset, split, data_cfg.global_batch_size, env.rank, env.world_size,
            data_cfg.shuffle and split == "train", seed, start_step)
    if data_cfg.loader == "dali":
        from dlrm_hybrid.data.dali_loader import DaliLoader

        return DaliLoader(rank_columns(*args), dataset.spec.feature_names, env.device,
                          data_cfg.prefetch)
    made_on = env.device if makes_on_device(dataset, env.device) else None
    return PrefetchLoader(rank_batches(*args, device=made_on), env.device, data_cfg.prefetch,
                          on_device, made_on_device=made_on is not None)


def makes_on_device(dataset, device) -> bool:
    """Whether `dataset`'s batches for `device` are made there rather than copied from the host."""
    return device.type == "cuda" and getattr(dataset, "device_batches", False)
