"""Where `preprocess criteo`'s time goes per row, one core, numpy (today) against the C kernels
(data/criteo/native.py), on one generated Criteo TSV file (preprocess_speed.py's rows).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/preprocess_stages.py [--megabytes 256] [--gz]

Stages, over 64 MiB chunks cut at newlines: read (the file, from the page cache), decompress
(--gz: the file gzipped at level 1), parse, count (numpy: np.unique per column; C: KeyCounter,
its drain included), map (tables of Criteo 1TB's size, all the generator's values; numpy:
Vocabulary.map's searchsorted; C: IdLookup, its build shown apart), write (tofile of labels,
dense and ids to one file). Prints seconds, ns/row, rows/s per stage and the ratio, and the CPU.
"""

from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tempfile
import time
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from preprocess_speed import VOCABULARIES, generate  # noqa: E402

from dlrm_hybrid.data.criteo import native, parse  # noqa: E402
from dlrm_hybrid.data.criteo.vocabulary import Vocabulary  # noqa: E402

CHUNK = 64 * 2**20


def cpu_name() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in lscpu.splitlines()
                  if line.startswith("Flags")), [])
    wide = sorted({f for f in flags if f in ("avx2", "avx512f", "avx512bw", "amx_tile")})
    return f"{model} ({', '.join(wide) or 'no avx2/avx512/amx'})"


def chunks(data: bytes):
    start = 0
    while start < len(data):
        end = data.rfind(b"\n", start, start + CHUNK) + 1 or len(data)
        yield data[start:end]
        start = end


class Clock:
    def __init__(self) -> None:
        self.seconds = defaultdict(float)

    def time(self, stage: str, fn, *args):
        start = time.perf_counter()
        result = fn(*args)
        self.seconds[stage] += time.perf_counter() - start
        return result


def timed_parts(clock: Clock) -> None:
    """parse.py's numbers and hex decoding timed apart from the rest (the split into fields)."""
    for name, stage in [("_parse_numerical", "parse: numbers"), ("_parse_hex", "parse: hex")]:
        inner = getattr(parse, name)
        setattr(parse, name, lambda *a, inner=inner, stage=stage: clock.time(stage, inner, *a))


def numpy_count(cats: np.ndarray, totals: list) -> None:
    for f in range(cats.shape[1]):
        column = cats[:, f]
        totals.append((f, *np.unique(column[column >= 0], return_counts=True)))


def generator_vocabulary() -> Vocabulary:
    """Every value preprocess_speed.py's rows can hold, most frequent first: tables the size of
    Criteo 1TB's at frequency threshold 15 (~33M values, the largest 8M)."""
    return Vocabulary([((np.arange(v, dtype=np.uint64) * 2654435761 + f * 40503) % 2**32)
                       .astype(np.uint32) for f, v in enumerate(VOCABULARIES)])


def run(path: Path, gz: bool, out: Path) -> tuple:
    clock_np, clock_c = Clock(), Clock()
    raw = Path(str(path) + ".gz") if gz else path
    for clock in (clock_np, clock_c):
        data = clock.time("read", raw.read_bytes)
        if gz:
            data = clock.time("decompress", zlib.decompress, data, 31)
    timed_parts(clock_np)
    counter = native.KeyCounter(16 * 2**20)
    totals: list = []
    parsed = []
    for chunk in chunks(data):
        parsed.append(clock_np.time("parse", parse.parse_lines, chunk))
        clock_np.time("count", numpy_count, parsed[-1].cats, totals)
        got = clock_c.time("parse", native.parse_lines, chunk)
        if not clock_c.time("count", counter.add, got.cats):
            raise SystemExit("raise the KeyCounter's capacity for this file")
    keys, counts = clock_c.time("count", counter.drain)
    rows = sum(len(c.labels) for c in parsed)
    vocabulary = generator_vocabulary()
    values, ids = zip(*vocabulary.lookup_tables())
    lookup = clock_c.time("map: build tables", native.IdLookup, list(values), list(ids))
    for chunk in parsed:
        a = clock_np.time("map", vocabulary.map, chunk.cats)
        b = clock_c.time("map", lookup.map, chunk.cats)
        assert np.array_equal(a, b)
        for clock, ids_ in ((clock_np, a), (clock_c, b)):
            with open(out, "wb") as f:
                for array in (chunk.labels, chunk.dense, ids_):
                    clock.time("write", array.tofile, f)
    drain = drain_against_numpy(keys)
    return rows, clock_np.seconds, clock_c.seconds, lookup.nbytes, len(keys), drain


def drain_against_numpy(keys: np.ndarray) -> tuple:
    """Seconds of KeyCounter.drain (gather + radix sort) and of numpy's argsort + take of the
    same pairs, for the keys of this file."""
    rng = np.random.default_rng(0)
    shuffled = rng.permutation(keys)
    cats = np.full((len(keys) // 26 + 1) * 26, -1, np.int64)
    cats[:len(keys)] = (shuffled >> 5).astype(np.int64)  # one key per cell: features shift
    counter = native.KeyCounter(len(cats))
    counter.add(cats.reshape(-1, 26))
    start = time.perf_counter()
    counter.drain()
    c_seconds = time.perf_counter() - start
    counts = np.ones(len(shuffled), np.uint64)
    start = time.perf_counter()
    order = np.argsort(shuffled)
    shuffled[order], counts[order]
    return len(keys), c_seconds, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=256)
    parser.add_argument("--gz", action="store_true", help="also time gzip decompression")
    parser.add_argument("--tmpdir", default=None)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("the C library is not built: .venv/bin/python setup.py build_ext --inplace")
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        path = Path(tmp) / "day_0"
        generate(path, args.megabytes / 1000)
        if args.gz:
            with open(path, "rb") as f, gzip.open(str(path) + ".gz", "wb", compresslevel=1) as g:
                g.write(f.read())
        rows, numpy_s, c_s, table_bytes, keys, drain = run(path, args.gz, Path(tmp) / "out")
        size = path.stat().st_size
    print(f"{cpu_name()}; one core; {size / 2**20:.0f} MiB, {rows:,} rows, {keys:,} distinct "
          f"keys; ID tables {table_bytes / 2**20:.0f} MiB")
    print(f"| {'stage':<18} | {'numpy s':>8} | {'ns/row':>7} | {'rows/s':>10} | {'native s':>8} "
          f"| {'ns/row':>7} | {'rows/s':>10} | {'ratio':>6} |")
    print("|" + "|".join("-" * w for w in (20, 10, 9, 12, 10, 9, 12, 8)) + "|")
    stages = [s for s in ("read", "decompress", "parse", "parse: numbers", "parse: hex", "count",
                          "map: build tables", "map", "write") if s in numpy_s or s in c_s]
    for stage in stages + ["total"]:
        a = sum(numpy_s[s] for s in stages if ":" not in s) if stage == "total" else numpy_s.get(stage)
        b = sum(c_s[s] for s in stages if s in c_s) if stage == "total" else c_s.get(stage)
        cells = []
        for seconds in (a, b):
            cells += ([f"{seconds:8.3f}", f"{seconds / rows * 1e9:7.0f}",
                       f"{rows / seconds if seconds else 0:10,.0f}"] if seconds is not None
                      else [f"{'':8}", f"{'':7}", f"{'':10}"])
        ratio = f"{a / b:6.1f}" if a and b else f"{'':6}"
        print(f"| {stage:<18} | " + " | ".join(cells) + f" | {ratio} |")
    n, c_drain, np_drain = drain
    print(f"drain of {n:,} keys: radix sort in C {c_drain:.3f} s, numpy argsort + take "
          f"{np_drain:.3f} s ({np_drain / c_drain:.1f}x)")


if __name__ == "__main__":
    main()
