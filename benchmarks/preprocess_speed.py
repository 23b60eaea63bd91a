"""Criteo TSV preprocessing speed on a generated file (default 1 GB), both passes.

    .venv/bin/python benchmarks/preprocess_speed.py [--gigabytes 1] [--workers K] [--tmpdir DIR]

Rows have Criteo's shape: 13 long-tailed integers (20% missing, some negative) and 26
categoricals drawn log-uniformly (Zipf-like) from vocabularies the size of Criteo 1TB's FL15
tables (5% missing). Runs preprocess_criteo(..., max_table_size=1_000_000) and prints rows/s,
seconds and peak RSS (this process plus the largest worker). Deletes its files.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from dlrm_hybrid.data.criteo.preprocess import preprocess_criteo
from dlrm_hybrid.data.criteo.preprocess_report import summary_line

VOCABULARIES = np.array([7912889, 33823, 17139, 7339, 20046, 4, 7105, 1382, 63, 5554114, 582469,
                         245828, 11, 2209, 10667, 104, 4, 968, 15, 8165896, 2675940, 7156453,
                         302516, 12022, 97, 35])
HEX_CHARS = np.frombuffer(b"0123456789abcdef", np.uint8)
BLOCK_ROWS = 200_000
RSS_LIMIT = 4 * 2**30


def decimal_field(values: np.ndarray, missing: np.ndarray, width: int = 6) -> np.ndarray:
    """[rows, width + 1] bytes of each integer (sign, digits); zero bytes are padding."""
    out = np.zeros((len(values), width + 1), np.uint8)
    out[:, 0] = np.where(values < 0, ord("-"), 0)
    magnitude = np.abs(values)
    for k in range(width):
        power = 10 ** (width - 1 - k)
        shown = (magnitude >= power) | (k == width - 1)
        out[:, k + 1] = np.where(shown, ord("0") + (magnitude // power) % 10, 0)
    out[missing] = 0
    return out


def hex_field(values: np.ndarray, missing: np.ndarray) -> np.ndarray:
    out = HEX_CHARS[(values[:, None] >> (4 * np.arange(7, -1, -1))) & 15]
    out[missing] = 0
    return out


def text_block(rng: np.random.Generator, rows: int) -> bytes:
    """`rows` Criteo TSV lines, built as a byte matrix whose padding zeros are then removed."""
    ints = np.exp(rng.random((rows, 13)) * np.log(50_000)).astype(np.int64) - 3
    ranks = np.exp(rng.random((rows, 26)) * np.log(VOCABULARIES)).astype(np.int64) - 1
    cats = (ranks * 2654435761 + np.arange(26) * 40503) % 2**32
    tab, newline = np.full((rows, 1), 9, np.uint8), np.full((rows, 1), 10, np.uint8)
    columns = [(ord("0") + (rng.random((rows, 1)) < 0.25)).astype(np.uint8)]
    int_missing, cat_missing = rng.random((rows, 13)) < 0.2, rng.random((rows, 26)) < 0.05
    columns += [decimal_field(ints[:, j], int_missing[:, j]) for j in range(13)]
    columns += [hex_field(cats[:, j], cat_missing[:, j]) for j in range(26)]
    parts = [x for column in columns for x in (tab, column)][1:] + [newline]
    matrix = np.concatenate(parts, axis=1)
    return matrix[matrix != 0].tobytes()


def generate(path: Path, gigabytes: float, seed: int = 0) -> int:
    rng, size, rows = np.random.default_rng(seed), 0, 0
    with open(path, "wb") as f:
        while size < gigabytes * 1e9:
            block = text_block(rng, BLOCK_ROWS)
            f.write(block)
            size, rows = size + len(block), rows + BLOCK_ROWS
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--tmpdir", default=None, help="where to put the input and output")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        start = time.perf_counter()
        rows = generate(Path(tmp) / "train.txt", args.gigabytes)
        size = (Path(tmp) / "train.txt").stat().st_size
        seconds = time.perf_counter() - start
        print(f"generated {rows:,} rows, {size / 1e9:.2f} GB in {seconds:.1f} s")
        report = preprocess_criteo([Path(tmp) / "train.txt"], Path(tmp) / "out",
                                   max_table_size=1_000_000, workers=args.workers)
    print(summary_line(report))
    rss = report["peak_rss_bytes"]
    seconds = report["seconds"]
    print(f"{args.workers} workers: {report['rows_per_s']:,.0f} rows/s, "
          f"{size / 2**20 / seconds:.0f} MiB/s of input, {seconds:.1f} s, peak RSS "
          f"{rss / 2**20:,.0f} MiB ({'under' if rss < RSS_LIMIT else 'OVER'} the 4 GiB limit)")
    print(f"cardinalities: {report['cardinalities']}")


if __name__ == "__main__":
    main()
