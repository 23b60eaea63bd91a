"""The configured dataset (planted synthetic, or a split-binary folder at `data.path`) and the
configured loader over one rank's slices of it."""

from __future__ import annotations

from dlrm_hybrid.data.loader import PrefetchLoader, rank_batches, rank_columns
from dlrm_hybrid.data.split_binary import SplitBinaryDataset
from dlrm_hybrid.data.synthetic import SyntheticClicks


def open_dataset(data_cfg):
    return SplitBinaryDataset(data_cfg.path) if data_cfg.path else SyntheticClicks(data_cfg)


def make_loader(data_cfg, dataset, split: str, env, seed: int = 0, start_step: int = 0,
                on_device: bool = True):
    """This rank's batches of `split` on its device (or pinned on the host, for a consumer that
    copies them itself): endless for "train" (from `start_step`), one pass otherwise."""
    args = (dataset, split, data_cfg.global_batch_size, env.rank, env.world_size,
            data_cfg.shuffle and split == "train", seed, start_step)
    if data_cfg.loader == "dali":
        from dlrm_hybrid.data.dali_loader import DaliLoader

        return DaliLoader(rank_columns(*args), dataset.spec.feature_names, env.device,
                          data_cfg.prefetch)
    return PrefetchLoader(rank_batches(*args), env.device, data_cfg.prefetch, on_device)
