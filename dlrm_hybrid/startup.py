"""Importing torch, torchrec and fbgemm without the garbage collector's passes over them.

Those imports make about 330,000 objects that live until the process ends. While they are
made, each full collection walks all of them and finds nothing to free. A 2-step `train` took
5.1 s of CPU (median of 7: 5.7 s) with the collector on throughout, 4.5 s (4.9 s) with it
paused for the imports (AMD EPYC, AVX2, 2026-11-28), on every rank of every start; importing
the training path alone, 5.7 s against 4.3 s. Once imported they are frozen
(`gc.freeze`): later collections, the training loop's included, skip them, and a process
forked afterwards (tests/cli_zygote.py) does not write to their pages to mark them.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block (imports) with the collector off, then freeze what exists and turn the
    collector back on as it was. Cycles made before the freeze are not freed: a few thousand
    import-time objects."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
