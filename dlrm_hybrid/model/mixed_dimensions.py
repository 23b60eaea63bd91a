"""Mixed-dimension embeddings (Ginart et al. 2019, "Mixed Dimension Embeddings with Application
to Memory-Efficient Recommendation Systems"): a table's width falls with its row count, so a
large table of rare ids stores narrow vectors and a small table of frequent ones wide vectors;
a learned projection (composed_lookup.WidenParts) brings each narrow table's pooled vectors to
the width the interaction reads.

The rule is facebookresearch/dlrm's `md_solver` with `d0` (its `--md-temperature`,
`--md-round-dims`, `--md-threshold`): over the tables' row counts n sorted ascending,
lambda = d0 * n_min^alpha and d = round(lambda * n^-alpha), the smallest table exactly d0 and
none below 1, then (round_dims) 2^round(log2 d). Tables of at most `threshold` rows keep the
full width, as its DLRM builds them. Two deviations, both because fbgemm's tables need widths
that are multiples of 4: a width below 4 is raised to 4, and without round_dims a width is
rounded to the nearest multiple of 4.

Every vector part gets a width by its own rows: a hashed table by its buckets, a QR feature's
quotient and remainder tables each by theirs (each projected back to the width its combination
needs). This module is plain Python (no torch), so that `plan` stays fast.
"""

from __future__ import annotations

from dataclasses import replace
from typing import List, Sequence

import numpy as np

from dlrm_hybrid.config import ConfigError

FBGEMM_WIDTH_STEP = 4  # fbgemm's tables (CPU and CUDA) are multiples of 4 wide


def md_solver_widths(rows: Sequence[int], alpha: float, d0: int, round_dims: bool) -> List[int]:
    """facebookresearch/dlrm's md_solver(n, alpha, d0, round_dim) on `rows`, one width per table
    in `rows` order, in float32 as its torch code computes (round: half to even, as torch's)."""
    n = np.asarray(rows, np.int64)
    order = np.argsort(n, kind="stable")
    sorted_rows = n[order].astype(np.float32)
    scale = np.float32(d0) * sorted_rows[0] ** np.float32(alpha)
    widths = np.maximum(scale * sorted_rows ** np.float32(-alpha), np.float32(1))
    widths[0] = d0
    widths = np.round(widths)
    if round_dims:
        widths = np.float32(2) ** np.round(np.log2(widths))
    out = np.empty(len(n), np.int64)
    out[order] = widths.astype(np.int64)
    return out.tolist()


def fbgemm_width(width: int, round_dims: bool) -> int:
    """A solver width fbgemm can hold: at least 4, and (without power-of-two rounding) the
    nearest multiple of 4."""
    if not round_dims:
        width = FBGEMM_WIDTH_STEP * round(width / FBGEMM_WIDTH_STEP)
    return max(FBGEMM_WIDTH_STEP, width)


def mixed_widths(lookups: list, cfg) -> list:
    """`lookups` with each vector part's table narrowed by `cfg` (model.mixed_dimensions) and
    marked to be projected back to its width; unchanged when the temperature is 0. (The
    lookups are compositional.FeatureLookup, which imports this module.)"""
    if cfg.temperature == 0:
        return lookups
    parts = [p for lookup in lookups for p in lookup.parts]
    d0 = cfg.base_width or lookups[0].dim
    solved = md_solver_widths([p.rows for p in parts], cfg.temperature, d0, cfg.round_dims)
    width = {}
    for part, solver_width in zip(parts, solved):
        narrowed = min(part.dim, fbgemm_width(solver_width, cfg.round_dims))
        width[part.table] = part.dim if part.rows <= cfg.threshold else narrowed
    return [replace(lookup, parts=tuple(
        replace(p, dim=width[p.table], projected=p.dim) if width[p.table] < p.dim else p
        for p in lookup.parts)) for lookup in lookups]


def check_mixed_dimensions(cfg) -> None:
    """model.mixed_dimensions (config_checks): its values, and the models whose tables it can
    narrow."""
    m = cfg.model
    md = m.mixed_dimensions
    if md.temperature < 0:
        raise ConfigError(f"model.mixed_dimensions.temperature: must be >= 0 (0: off), got "
                          f"{md.temperature}")
    if md.threshold < 0:
        raise ConfigError(f"model.mixed_dimensions.threshold: must be >= 0, got {md.threshold}")
    if md.base_width < 0 or md.base_width % 4 or md.base_width > m.embedding_dim:
        raise ConfigError(f"model.mixed_dimensions.base_width: {md.base_width} must be a "
                          f"multiple of 4 (fbgemm's tables) up to model.embedding_dim "
                          f"({m.embedding_dim}); 0 means model.embedding_dim")
    if md.temperature == 0:
        return
    refused = {"model.kind": (m.kind, m.kind != "dlrm", "mixed dimensions narrow the ranker's "
                              "tables"),
               "model.sequence": (m.sequence, m.sequence != "none", "HSTU reads whole item "
                                  "vectors"),
               "model.interaction": (m.interaction, m.interaction == "fm", "fm reads its tables' "
                                     "vectors and first-order weights unprojected"),
               "parallel.exchange": (cfg.parallel.exchange, cfg.parallel.exchange == "des",
                                     "des sends partial sums of unprojected vectors")}
    for key, (value, bad, why) in refused.items():
        if bad:
            raise ConfigError(f"{key}: {value!r} does not run with model.mixed_dimensions "
                              f"({why}); set model.mixed_dimensions.temperature=0 or change "
                              f"{key}")
