"""Whether two checkouts make the same plans: the `plan` command's printout, plan file (`--out`),
chart (`--plot`) and `--explain` text on a grid of inputs, compared byte for byte (issue 43: a
change made for speed must leave every plan as it was).

    .venv/bin/python benchmarks/plan_identity.py --base /work/main [--quick] [--keep DIR]

The grid: every config in configs/ at 1, 2, 8, 64 and 1,024 ranks (8 per host), greedy (with
--compare) and nvidia; log-uniform cardinality files (10 to 3e7 rows; 26, 500 and 10,000 tables,
1 to 10 ids per lookup) at the same ranks; memory so tight that tables are split by columns;
quotient-remainder tables; no replication, row-wise splits, other optimizers, fp16, other devices;
--explain of large, small, QR-part and unknown tables. Each checkout records every case in a
process of its own (`--record DIR`, this file run with that checkout first on the path); the
inputs are written once, by this checkout. Exit 1, with a unified diff of the first cases that
differ, where any does. About 75 CPU-seconds (--quick: the configs alone, ~12).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RANKS = (1, 2, 8, 64, 1024)
Case = Tuple[str, List[str]]


def write_inputs(folder: Path) -> None:
    """Log-uniform row counts (10 to 3e7) and 1-10 ids per lookup for 26, 500 and 10,000 tables."""
    rng = np.random.default_rng(43)
    for count in (26, 500, 10000):
        rows = (10 ** rng.uniform(1, np.log10(3e7), count)).astype(int)
        (folder / f"rows_{count}.txt").write_text("\n".join(map(str, rows)) + "\n")
        hotness = rng.integers(1, 11, count)
        listed = ",".join(map(str, hotness))
        (folder / f"hotness_{count}.txt").write_text(f"data.hotness=[{listed}]")


def cases(inputs: Path, quick: bool) -> List[Case]:
    found: List[Case] = []
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    for config in configs:
        for ranks in RANKS:
            common = ["--config", str(config), "--world-size", str(ranks), "--gpus-per-node",
                      str(min(ranks, 8))]
            found.append((f"{config.stem}_{ranks}_greedy",
                          common + ["--compare", "--out", "p.json"]))
            found.append((f"{config.stem}_{ranks}_nvidia", common + ["--strategy", "nvidia",
                                                                     "--out", "p.json"]))
    fl15 = str(ROOT / "configs/criteo_1tb_fl15.yaml")
    qr = str(ROOT / "configs/mlperf_dcnv2_qr.yaml")
    for name, table in (("fl15", "t_cat_0"), ("fl15", "t_cat_5"), ("fl15", "t_cat_20"),
                        ("qr", "t_cat_0_q"), ("qr", "t_cat_0_r"), ("qr", "t_cat_1"),
                        ("fl15", "no_such_table")):
        for ranks in (8, 64):
            config = fl15 if name == "fl15" else qr
            found.append((f"explain_{name}_{table}_{ranks}", [
                "--config", config, "--world-size", str(ranks), "--gpus-per-node", "8",
                "--explain", table]))
    found.append(("plot_fl15_16", ["--config", fl15, "--world-size", "16", "--gpus-per-node", "8",
                                   "--out", "p.json", "--plot", "p.png"]))
    if quick:
        return found
    for count in (26, 500, 10000):
        rows = ["--cardinalities", str(inputs / f"rows_{count}.txt")]
        hot = ["--set", (inputs / f"hotness_{count}.txt").read_text()]
        for ranks in RANKS:
            common = ["--config", fl15, *rows, "--world-size", str(ranks), "--gpus-per-node",
                      str(min(ranks, 8))]
            found.append((f"rows{count}_{ranks}_greedy", common + ["--out", "p.json"]))
            found.append((f"rows{count}_{ranks}_nvidia", common + ["--strategy", "nvidia",
                                                                   "--out", "p.json"]))
            if count < 10000 or ranks == 1024:  # one hotness per table: set with the rows
                found.append((f"rows{count}_{ranks}_hot_compare", [
                    "--config", fl15, "--set", "data.cardinalities=[" + ",".join(
                        (inputs / f"rows_{count}.txt").read_text().split()) + "]", *hot,
                    *common[4:], "--compare", "--out", "p.json"]))
    for ranks, memories in ((2, "13GiB 16GiB"), (8, "6.5GiB 7GiB 9GiB"),
                            (16, "5.25GiB 5.5GiB 6GiB")):  # FL15 keeps 4 GiB free: tables split
        for memory in memories.split():
            found.append((f"tight_fl15_{memory}_{ranks}", [
                "--config", fl15, "--world-size", str(ranks), "--gpus-per-node",
                str(min(ranks, 8)), "--gpu-memory", memory, "--compare", "--out", "p.json"]))
    for memory in ("12GiB", "20GiB"):
        for ranks in (64, 1024):
            found.append((f"tight_rows500_{memory}_{ranks}", [
                "--config", fl15, "--cardinalities", str(inputs / "rows_500.txt"), "--world-size",
                str(ranks), "--gpus-per-node", "8", "--gpu-memory", memory, "--compare"]))
    qr_all = ("model.compositional=[{technique: qr, rows_above: 100, collisions: 4, "
              "operation: add}]")
    for ranks in (8, 64, 1024):
        found.append((f"qr_rows500_{ranks}", [
            "--config", fl15, "--cardinalities", str(inputs / "rows_500.txt"), "--set", qr_all,
            "--world-size", str(ranks), "--gpus-per-node", "8", "--compare", "--out", "p.json"]))
    for ranks in (8, 64, 1024):
        for setting in ("parallel.replicate=false", "parallel.split_rowwise=true",
                        "optim.embedding=adagrad", "optim.embedding=sgd", "optim.embedding=adam",
                        "model.embedding_precision=fp16", "parallel.comm_precision=bf16"):
            found.append((f"set_{setting.split('=')[0].split('.')[1]}_{setting.split('=')[1]}"
                          f"_{ranks}", ["--config", fl15, "--cardinalities",
                                        str(inputs / "rows_500.txt"), "--set", setting,
                                        "--world-size", str(ranks), "--gpus-per-node", "8",
                                        "--compare", "--out", "p.json"]))
        for device in ("a100", "cpu_gloo", "h200"):
            found.append((f"device_{device}_{ranks}", [
                "--config", str(ROOT / "configs/mlperf_dcnv2.yaml"), "--device", device,
                "--world-size", str(ranks), "--gpus-per-node", "8", "--compare", "--out",
                "p.json"]))
    return found


def run_case(argv: List[str]) -> str:
    """One `plan` run in this process, as the command runs it: exit code, stdout, stderr, files."""
    from dlrm_hybrid import cli
    from dlrm_hybrid.errors import UserError
    from dlrm_hybrid.parallel import dry_run

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            dry_run.run(cli._parser().parse_args(["plan", *argv]))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
        except SystemExit as e:  # argparse
            code = e.code
    files = ""
    for name in ("p.json", "p.png"):
        if Path(name).exists():
            data = Path(name).read_bytes()
            text = data.decode() if name.endswith(".json") else ""
            files += f"--- {name}: {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}\n"
            files += text
            Path(name).unlink()
    return f"exit {code}\n--- stdout\n{out.getvalue()}--- stderr\n{err.getvalue()}{files}"


def record(folder: Path, inputs: Path, quick: bool) -> None:
    import dlrm_hybrid
    used = Path(dlrm_hybrid.__file__).resolve().parents[1]
    if used != Path(os.environ["PYTHONPATH"]).resolve():
        sys.exit(f"imported {used}'s dlrm_hybrid, not {os.environ['PYTHONPATH']}'s")
    folder.mkdir(parents=True, exist_ok=True)
    for earlier in folder.glob("[0-9][0-9][0-9]_*.txt"):  # a --keep folder's last run: not ours
        earlier.unlink()
    os.chdir(folder)
    for index, (name, argv) in enumerate(cases(inputs, quick)):
        text = f"plan {' '.join(a if len(a) < 200 else a[:40] + '...' for a in argv)}\n"
        (folder / f"{index:03d}_{name}.txt").write_text(text + run_case(argv))


def compare(a: Path, b: Path, shown: int = 3) -> int:
    names = sorted(p.name for p in a.glob("*.txt"))
    differ = [n for n in names if (a / n).read_bytes() != (b / n).read_bytes()]
    for name in differ[:shown]:
        sys.stdout.writelines(list(difflib.unified_diff(
            (a / name).read_text().splitlines(True), (b / name).read_text().splitlines(True),
            f"base/{name}", f"this/{name}", n=1))[:80])
    print(f"{len(names) - len(differ)} of {len(names)} cases identical"
          + (f"; differ: {', '.join(differ)}" if differ else ""))
    return 1 if differ or not names else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the other checkout (its root)")
    parser.add_argument("--quick", action="store_true", help="the configs alone")
    parser.add_argument("--keep", help="record into this folder (default: a temporary one)")
    parser.add_argument("--record", nargs=2, metavar=("OUTDIR", "INPUTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.record:
        return record(Path(args.record[0]), Path(args.record[1]), args.quick)
    if not args.base:
        parser.error("--base CHECKOUT is required")
    with tempfile.TemporaryDirectory() as scratch:
        top = Path(args.keep or scratch).resolve()
        (top / "inputs").mkdir(parents=True, exist_ok=True)
        write_inputs(top / "inputs")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0", CUDA_VISIBLE_DEVICES="")
        runs = [subprocess.Popen([sys.executable, __file__, "--record", str(top / side),
                                  str(top / "inputs")] + (["--quick"] if args.quick else []),
                                 env=dict(env, PYTHONPATH=str(Path(root).resolve())))
                for side, root in (("base", args.base), ("this", ROOT))]
        if any(run.wait() for run in runs):
            sys.exit("a record failed")
        sys.exit(compare(top / "base", top / "this"))


if __name__ == "__main__":
    main()
