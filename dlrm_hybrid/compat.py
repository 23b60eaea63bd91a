"""Every difference between the torchrec/fbgemm releases we support (install/torch_versions.txt:
torch 2.11-2.14 with fbgemm/torchrec 1.6-1.9), in one place: the rest of the package writes
against one API and imports the differing names from here. Checked by running the test suite
under each release (benchmarks/other_torch.sh).
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Sequence


class _FbgemmSelfCheckFilter(logging.Filter):
    """fbgemm-gpu 1.6.0's import-time check has no row for its own release in its table
    (`_fbgemm_torch_compat_table` stops at 1.5), so every import under its own torch 2.11 logs
    a multi-line warning to the root logger, which would precede every one-line error. The pair
    is the right one (the table in fbgemm 1.9.0 has "1.6": "2.11"), so that record is dropped;
    fbgemm's real mismatch warning is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_fbgemm_torch_compat_table has no entry" not in str(record.msg)


def install_import_filters() -> None:
    """Before the first torchrec/fbgemm import (dlrm_hybrid/__init__.py calls it)."""
    root = logging.getLogger()
    if not any(isinstance(f, _FbgemmSelfCheckFilter) for f in root.filters):
        root.addFilter(_FbgemmSelfCheckFilter())


def sharding_env(group):
    """torchrec's ShardingEnv for `group`. torchrec 1.6 finds the group's device with torch's
    `_get_pg_default_device`, which torch 2.11 deprecates with two UserWarnings per call
    (torchrec 1.8 calls `_get_object_coll_device`); both give the same device mesh, so the
    warnings, which would precede a user's one-line error, are silenced."""
    from torchrec.distributed.types import ShardingEnv

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`_get_pg_default_device` will be deprecated")
        warnings.filterwarnings("ignore", message="Multiple backends are registered")
        return ShardingEnv.from_process_group(group)


def all_gather_with_grad(local, group):
    """`local`'s rows from every rank of `group`, in rank order, whose backward sends each rank
    the gradient of its own rows (summed over the ranks). torch 2.13 names it
    `all_gather_single_autograd` and deprecates 2.11's `all_gather_tensor_autograd` (2.11 has
    only that name); both return an AsyncCollectiveTensor, waited on here."""
    from torch.distributed import _functional_collectives as collectives

    gather = getattr(collectives, "all_gather_single_autograd", None)
    if gather is None:
        gather = collectives.all_gather_tensor_autograd
    gathered = gather(local, 0, group)
    return gathered.wait() if isinstance(gathered, collectives.AsyncCollectiveTensor) \
        else gathered


def saved_files(written, checkpoint_dir) -> list:
    """The data files `dcp.save` wrote to `checkpoint_dir` (relative paths), from the metadata it
    returned. torch 2.11's FileSystemWriter.finish records them on a copy of that metadata, so
    the returned one has `storage_data` None there; the `.metadata` file it wrote has them."""
    storage = getattr(written, "storage_data", None)
    if storage is None:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(checkpoint_dir)).read_metadata().storage_data
    return sorted({info.relative_path for info in storage.values()})


# torch 2.14 deprecates TorchScript: every torch.jit.load, save and script warns ("`torch.jit.load`
# is deprecated. Please switch to `torch.export`.", a FutureWarning), which would precede each
# `predict`, `retrieve` and `recommend` error line and follow every `export`. The served files
# stay TorchScript (they load without this package; serve/export.py says why not torch.export),
# so the three calls below go without that notice; torch 2.11-2.13 do not give it.
TORCHSCRIPT_NOTICE = r"`torch\.jit\.(load|save|script)` is (deprecated|not supported)"


@contextmanager
def _without_torchscript_notice():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCHSCRIPT_NOTICE, category=FutureWarning)
        yield


def jit_load(path: str, **kwargs):
    """torch.jit.load(path, **kwargs), without torch 2.14's deprecation notice."""
    import torch

    with _without_torchscript_notice():
        return torch.jit.load(path, **kwargs)


def jit_save(module, path: str, **kwargs) -> None:
    """torch.jit.save(module, path, **kwargs), without torch 2.14's deprecation notice."""
    import torch

    with _without_torchscript_notice():
        torch.jit.save(module, path, **kwargs)


def jit_script(module):
    """torch.jit.script(module), without torch 2.14's deprecation notice."""
    import torch

    with _without_torchscript_notice():
        return torch.jit.script(module)


def op_input_dtypes(prof) -> Callable[[Any], Sequence[str]]:
    """A profiled op's input dtypes (record_shapes=True): the event's `input_dtypes` (torch
    2.12 on); torch 2.11's FunctionEvent has none, so there from the kineto event of the same
    id (its correlation id)."""
    events = list(prof.events())
    if not events or hasattr(events[0], "input_dtypes"):
        return lambda event: event.input_dtypes or ()
    dtypes = {k.correlation_id(): k.dtypes() for k in prof.profiler.kineto_results.events()}
    return lambda event: dtypes.get(event.id, ())
