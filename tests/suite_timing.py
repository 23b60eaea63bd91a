"""Which test file grew: after a full run, the files that took much longer than tests/durations.json
records are counted in one line of the terminal summary, and named with --slower-files (a
developer's question: someone running the suite wants its result). A notice, not a failure
(timings are not tests).

Refresh the table after a deliberate change, with a full run on an otherwise idle machine:
    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests --record-durations
best in a fresh clone, as CI runs it: a working copy's warm mypy cache (.pytest_cache) records
test_cuda_paths.py at 0.3 s against a clone's 8 s, and file_order.py then leaves it for last.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Tuple

TABLE = Path(__file__).with_name("durations.json")
ROOT = TABLE.parents[1]  # node ids are relative to it: tests/test_x.py
REFRESH = "OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests --record-durations"
RATIO, MARGIN_S = 1.5, 5.0

_seconds: Dict[str, float] = defaultdict(float)


def grown(recorded: Dict[str, float], measured: Dict[str, float], ratio: float = RATIO,
          margin_s: float = MARGIN_S) -> List[Tuple[str, float, float]]:
    """(file, recorded s, measured s) of the files that took over `ratio` times their recorded
    time and over `margin_s` more; a file the table lacks counts as recorded at 0 s."""
    return [(name, recorded.get(name, 0.0), took) for name, took in sorted(measured.items())
            if took > ratio * recorded.get(name, 0.0) and took > recorded.get(name, 0.0) + margin_s]


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help=f"after a full run, write each test file's seconds to {TABLE}")
    parser.addoption("--slower-files", action="store_true",
                     help=f"after a full run, name each test file much slower than {TABLE.name} "
                          f"records (default: one line counting them)")


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration  # setup, call and teardown


def _recorded() -> Dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def _full_run(config) -> bool:
    """The whole suite ran: no selection (-k, -m, --lf, --deselect) and every test file of the
    table that still exists ran."""
    option = config.option
    selected = (option.keyword or option.markexpr or getattr(option, "lf", False)
                or getattr(option, "deselect", None))
    files = {name for name in _recorded() if (ROOT / name).exists()}
    return not selected and files <= set(_seconds)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    record = config.getoption("--record-durations")
    if not _full_run(config):
        if record:
            terminalreporter.write_line(f"not a full run: {TABLE.name} left as it was")
        return
    measured = {name: round(took, 1) for name, took in _seconds.items()}
    if record:
        TABLE.write_text(json.dumps(dict(sorted(measured.items())), indent=1) + "\n")
        terminalreporter.write_line(f"per-file seconds written to {TABLE}")
        return
    slower = grown(_recorded(), measured)
    if not slower:
        return
    if not config.getoption("--slower-files"):
        name, before, took = max(slower, key=lambda row: row[2] - row[1])
        terminalreporter.write_line(
            f"timing: {len(slower)} test file{'s' * (len(slower) > 1)} slower than tests/"
            f"{TABLE.name} records (the most: {name} {took:.0f} s, recorded {before:.0f} s); "
            f"--slower-files names them")
        return
    terminalreporter.section(f"test files slower than tests/{TABLE.name} records")
    for name, before, took in slower:
        terminalreporter.write_line(f"{name}: {took:.0f} s (recorded {before:.0f} s)")
    terminalreporter.write_line(f"a deliberate change? refresh the table: {REFRESH}")
