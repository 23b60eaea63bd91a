"""How long a command takes from the shell to its answer, where the answer needs no torch:
`--help`, a planner dry run of Criteo 1TB on 8 ranks, and config/checkpoint mistakes (one line,
exit 2), against `python -c "import torch"` and `import torchrec` measured in the same run (what
every command paid before torch was imported only where needed).

    .venv/bin/python benchmarks/start_time.py [--repeat 5]

Prints the median wall seconds of `--repeat` runs of each command in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "dlrm_hybrid"]
COMMANDS = [
    ("dlrm-hybrid --help", [*CLI, "--help"], 0),
    ("plan criteo_1tb_fl15 --world-size 8",
     [*CLI, "plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "8"], 0),
    ("train with a bad --set", [*CLI, "train", "--config", "configs/demo.yaml", "--set",
                                "model.embedding_dim=abc"], 2),
    ("train, batch not divisible by 8 ranks", [
        sys.executable, "-m", "dlrm_hybrid.torchrun", "--standalone", "--nproc_per_node=8", "-m",
        "dlrm_hybrid", "train", "--config", "configs/demo.yaml", "--set",
        "data.global_batch_size=1001"], 2),
    ("eval of a missing checkpoint", [*CLI, "eval", "--checkpoint", "no/step_1"], 2),
    ("export of a missing checkpoint", [*CLI, "export", "--checkpoint", "no/step_1", "--out",
                                        "/tmp/never.pt"], 2),
    ("reference: python -c 'import torch'", [sys.executable, "-c", "import torch"], 0),
    ("reference: python -c 'import torchrec'", [sys.executable, "-c", "import torchrec"], 0),
]


def median_seconds(command, expected_code: int, repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds.append(time.perf_counter() - start)
        if result.returncode != expected_code:
            sys.exit(f"{' '.join(command)}: exit {result.returncode}, expected {expected_code}: "
                     f"{result.stderr.strip()[-300:]}")
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per command; the median counts")
    args = parser.parse_args()
    print(f"median wall seconds of {args.repeat} runs, fresh interpreter each")
    for label, command, code in COMMANDS:
        print(f"{label:<42} {median_seconds(command, code, args.repeat):6.2f}")


if __name__ == "__main__":
    main()
