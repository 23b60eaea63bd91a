"""What a resumed run may change: how long and how it runs, where it writes, how it is
parallelised (checkpoints reshard), not what it trains. A checkpoint records the resolved config
it was trained with; resuming it under settings that change the experiment (the model, the
data, the optimizer; anything but `MAY_CHANGE`) is refused, naming the keys that differ.

A dataset at `data.path` is compared by its identity (dataset_identity.py), not by how its path
is spelled, and the planted synthetic data's settings do not apply to it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

from dlrm_hybrid.config import Config, ConfigError, task_names

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.train.checkpoint import CONFIG, read_meta
from dlrm_hybrid.train.dataset_identity import (dataset_identity, identity_changes,
                                                readable_identity)

MAY_CHANGE = ("train.max_steps", "train.log_every", "train.eval_every", "train.run_dir",
              "train.progress_bar", "train.rank_logs", "train.tensorboard", "train.precision",
              "train.precision_fallback", "train.cuda_graphs", "train.pipeline",
              "train.evals_per_epoch", "train.target_auc", "train.mlperf_log",
              "train.stop_grace_s", "data.loader", "data.prefetch", "data.stream_eval", "parallel.", "checkpoint.",
              "retrieval.eval_k", "retrieval.eval_items_per_chunk", "value_model.")
# The planted synthetic data's settings (data/synthetic.py): unused when data.path is set.
SYNTHETIC_ONLY = ("data.seed", "data.num_dense", "data.cardinalities", "data.hotness",
                  "data.hotness_distribution", "data.train_samples", "data.val_samples",
                  "data.zipf_exponent", "data.id_order", "data.teacher_dim", "data.teacher_scale",
                  "data.teacher_order", "data.users", "data.items", "data.interactions_per_user",
                  "data.task_correlation", "data.label_missing", "data.labels")


def check_same_experiment(path: Path, cfg: Config) -> None:
    """Refuse to resume `path` under settings that change what is trained."""
    there_cfg = load_config(str(path / CONFIG))
    _refuse_task_count_change(path, there_cfg, cfg)
    there, here = _flat(there_cfg.to_dict()), _flat(cfg.to_dict())
    on_files = bool(there_cfg.data.path and cfg.data.path)
    free = MAY_CHANGE + (("data.path", *SYNTHETIC_ONLY) if on_files else ())
    diffs = [f"{key} ({there.get(key)!r} there, {here[key]!r} here)" for key in here
             if there.get(key) != here[key]
             and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in free)]
    if on_files:
        diffs += _dataset_change(read_meta(path).get("dataset"), there_cfg.data.path,
                                 cfg.data.path)
    if diffs:
        raise ConfigError(f"checkpoint.resume: {path} was trained with other settings: "
                          f"{', '.join(diffs)}; resume it with its own settings, or start anew "
                          f"with checkpoint.resume=none or another train.run_dir")


def _refuse_task_count_change(path: Path, there: Config, here: Config) -> None:
    """A single-task model's one logit and a multi-task model's heads are different models:
    neither continues as the other, so say that rather than list the keys that differ."""
    if bool(there.model.tasks) == bool(here.model.tasks):
        return
    tasks = ", ".join(task_names(there.model if there.model.tasks else here.model))
    if there.model.tasks:
        raise ConfigError(f"model.tasks: {path} is a multi-task model ({tasks}), and a "
                          f"multi-task model cannot continue as a single-task (click) one; "
                          f"resume it with its model.tasks, or start anew with "
                          f"checkpoint.resume=none or another train.run_dir")
    raise ConfigError(f"model.tasks: {path} is a single-task (click) model, and a single-task "
                      f"model cannot continue as a multi-task one ({tasks}); start the "
                      f"multi-task model anew with checkpoint.resume=none or another "
                      f"train.run_dir, or resume with model.tasks empty")


def _dataset_change(recorded: Optional[dict], there: str, here: str) -> List[str]:
    """The data.path difference, if the datasets differ; a checkpoint of an earlier version
    records no identity, so the dataset still at its path stands in for it."""
    identity = recorded or readable_identity(there)
    if identity is None:
        return [] if there == here else [
            f"data.path ({there!r} there, {here!r} here; the checkpoint, from an earlier version, "
            f"records no dataset identity and there is no dataset at {there} to compare: resume "
            f"once with the dataset at {there}, and the checkpoints written then record it)"]
    changes = identity_changes(identity, dataset_identity(here))
    return [f"data.path ({there!r} there, {here!r} here: another dataset, "
            f"{'; '.join(changes)})"] if changes else []


def _flat(tree: dict, prefix: str = "") -> Dict[str, object]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
