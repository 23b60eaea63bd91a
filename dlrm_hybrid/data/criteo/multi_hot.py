"""`preprocess multihot`: MLPerf DLRM-DCNv2's multi-hot Criteo, from a one-hot split-binary
dataset, as the reference builds it (mlcommons/training recommendation_v2/torchrec_dlrm,
multi_hot.py with the uniform distribution, materialize_synthetic_multihot_dataset.py).

The reference seeds numpy's legacy generator once (`np.random.seed(0)`), then for each feature
j in order draws a lookup table of n_j rows (n_j: the feature's table size): row i is
[i, randint(0, n_j, size=h_j - 1)]. A sample's ids for feature j are the table's row
`id % n_j`, so h_j ids of which the first is the one-hot id.

It holds every table in memory (about 24 GB for the MLPerf sizes: 40M rows x 100 ids for one
feature). Here each table is drawn in chunks of rows into a file beside the output (the same
numbers: the legacy generator's bounded draws are element by element, so chunking does not
change the stream), and the splits are rewritten in chunks of samples: memory stays at a chunk.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import List, Optional

import numpy as np

from dlrm_hybrid.config import ConfigError
from dlrm_hybrid.data.criteo.day23 import RULE_KEY, UNRECORDED, recorded_rule
from dlrm_hybrid.data.feature_spec import LABEL, load_feature_spec
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.split_binary_writer import SplitBinaryWriter

MLPERF_HOTNESS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
MLPERF_ROWS = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282,
               10, 2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108,
               36]  # the reference's num_embeddings_per_feature: ids are taken modulo these
REFERENCE_SEED = 0


def add_arguments(parser) -> None:
    parser.add_argument("--input", required=True, metavar="DIR",
                        help="a one-hot split-binary dataset (preprocess criteo or npy)")
    parser.add_argument("--output", required=True, metavar="DIR", help="new dataset folder")
    parser.add_argument("--hotness", default=",".join(map(str, MLPERF_HOTNESS)),
                        help="ids per sample of each feature (default: MLPerf DLRM-DCNv2's 26)")
    parser.add_argument("--rows", default="input",
                        help="each feature's table size, ids taken modulo it: `input` (the "
                             "input's cardinalities, default), `mlperf` (the reference's, 40M "
                             "caps), or comma-separated numbers")
    parser.add_argument("--seed", type=int, default=REFERENCE_SEED,
                        help="numpy seed of the lookup tables (the reference's: 0)")
    parser.add_argument("--chunk-rows", type=int, default=1 << 20,
                        help="table rows and samples handled at once (memory bound)")


def run(args) -> None:
    hotness = _parse_list(args.hotness, "--hotness")
    rows = _table_rows(args.rows)
    counts = make_multi_hot(args.input, args.output, hotness, args.seed, args.chunk_rows, rows)
    print(f"wrote {args.output}: " + ", ".join(f"{folder} {n:,}" for folder, n in counts.items())
          + f"; hotness {','.join(map(str, hotness))}")


def _table_rows(text: str) -> Optional[List[int]]:
    """`--rows`: None for `input` (the input's cardinalities), the reference's for `mlperf`."""
    if text == "input":
        return None
    return MLPERF_ROWS if text == "mlperf" else _parse_list(text, "--rows")


def _parse_list(text: str, flag: str) -> List[int]:
    try:
        values = [int(h) for h in text.split(",")]
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not comma-separated integers") from None
    if min(values) < 1:
        raise ConfigError(f"{flag}: every value must be at least 1, got {text}")
    return values


def make_multi_hot(input_dir: str, output: str, hotness: List[int], seed: int = REFERENCE_SEED,
                   chunk_rows: int = 1 << 20, rows: Optional[List[int]] = None) -> dict:
    """Write the multi-hot version of the one-hot dataset at `input_dir` to `output` (whole or
    not at all); returns the samples per split. `rows`: each table's size (default the input's
    cardinalities). The input's day-23 rule goes with its splits into the output's metadata."""
    # Here, not at the top: the reader imports torchrec (~2.5 s), which every CLI command paid
    # at start for this module's arguments.
    from dlrm_hybrid.data.split_binary import SPLIT_NAMES, SplitBinaryDataset

    if chunk_rows < 1:  # a range() step: 0 fails, a negative one writes no sample
        raise ConfigError(f"--chunk-rows: at least 1 row at a time, got {chunk_rows}")
    if not 0 <= seed < 2**32:
        raise ConfigError(f"--seed: numpy's legacy seed, 0 to 2**32 - 1, got {seed}")
    load_feature_spec(input_dir, "--input")  # a folder that is no dataset, named by its flag
    source = SplitBinaryDataset(input_dir)
    spec = source.fspec.spec
    rows = rows or spec.cardinalities
    for flag, values in (("--hotness", hotness), ("--rows", rows)):
        if len(values) != len(spec.cardinalities):
            raise ConfigError(f"{flag}: {len(values)} values for {input_dir}'s "
                              f"{len(spec.cardinalities)} categorical features; give one per "
                              f"feature")
    several = [i for i, h in enumerate(spec.hotness) if h != 1]
    if several:
        name, ids = spec.feature_names[several[0]], spec.hotness[several[0]]
        raise ConfigError(f"--input: {input_dir} is not one-hot ({name} has {ids} ids per "
                          f"sample); give the one-hot dataset")
    out_spec = DataSpec(spec.num_dense, list(rows), hotness)
    ours = {folder: name for name, folder in SPLIT_NAMES.items()}
    folders = list(source.fspec.splits)  # as the input has them (NVIDIA's: train and test)
    day_23 = recorded_rule(Path(input_dir), source.fspec)
    labels = source.label_names if len(source.label_names) > 1 else (LABEL,)  # kept as named
    # The tables' scratch in the writer's partial folder: removed before it becomes the dataset,
    # and with it by the next run where this one was killed (beside it, it was left for good).
    with SplitBinaryWriter(output, out_spec, folders, labels) as writer, tempfile.TemporaryDirectory(
            dir=writer.tmp, prefix=".multi_hot_tables-") as scratch:
        if day_23 != UNRECORDED:
            writer.note(RULE_KEY, day_23)
        tables = lookup_tables(rows, hotness, seed, chunk_rows, Path(scratch))
        for folder in folders:
            total = source.num_samples(ours[folder])
            for first in range(0, total, chunk_rows):
                c = source.columns(ours[folder], first, min(chunk_rows, total - first))
                ids = [table[one_hot[:, 0] % len(table)] for table, one_hot in zip(tables, c.ids)]
                writer.write(folder, c.labels, c.dense, ids, c.true_prob)
        counts = dict(writer.counts)
    return counts


def lookup_tables(rows: List[int], hotness: List[int], seed: int, chunk_rows: int,
                  folder: Path) -> List[np.ndarray]:
    """Each feature's [n, h] table, in the reference's order of draws, as read-only memmaps
    (a one-hot feature's table is [n, 1], the ids themselves, and draws nothing)."""
    np.random.seed(seed)
    tables = []
    for j, (n, h) in enumerate(zip(rows, hotness)):
        path = folder / f"table_{j}.bin"
        table = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(n, h))
        for first in range(0, n, chunk_rows):
            last = min(n, first + chunk_rows)
            table[first:last, 0] = np.arange(first, last)
            table[first:last, 1:] = np.random.randint(0, n, size=(last - first, h - 1))
        table.flush()
        del table
        tables.append(np.load(path, mmap_mode="r"))
    return tables
