"""The test infrastructure itself: runs forked from the CLI zygote (tests/cli_zygote.py) are the
runs a fresh interpreter and torchrun give, and the per-file timing notice (suite_timing.py).
That a 2-rank training run forked from it has torchrun's losses is checked where torchrun runs
anyway: test_checkpoint.py's killed rank, whose first attempt is torchrun's."""

import os
import subprocess
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from cli_zygote import STOP_GRACE_S, needs_fresh
from conftest import ROOT, failure, run_cli
from suite_timing import grown


def test_a_failing_rank_ends_the_zygote_job_with_its_code(request):
    """Every rank meets the config error; rank 0 says it at once and exits 2, the other waits
    before it would repeat it, and is stopped then, as torchrun stops it. On a loaded host rank
    0 may reach the error more than that wait after rank 1 (as under torchrun): then rank 1's
    line follows rank 0's."""
    if request.config.getoption("--fresh-cli"):
        pytest.skip("about the zygote; --fresh-cli runs torchrun")
    result = run_cli(["train", "--config", "configs/demo.yaml", "--set", "model.embedding_dim=7"],
                     nproc=2)
    assert result.returncode == 2
    error = ("model.embedding_dim: 7 is not a multiple of 4, which fbgemm's embedding tables "
             "need (CPU and GPU); use 4 or 8")
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"error: {error}" and lines[1:] in ([], [f"error (rank 1): {error}"])


def test_a_run_works_in_its_own_folder(tmp_path):
    result = run_cli(["plan", "--config", str(ROOT / "configs/demo.yaml"), "--out", "plan.json"],
                     cwd=tmp_path)
    assert result.returncode == 0, failure(result)
    assert (tmp_path / "plan.json").exists()


EXITS = {  # a run's last statement: how a forked run must end as the interpreter ends it
    "returns": "pass",
    "exits with a message": "sys.exit('stopped: no data')",
    "exits with a code": "sys.exit(3)",
    "raises": "raise ValueError('bad row')",
}


@pytest.mark.parametrize("ending", EXITS)
def test_a_forked_run_ends_as_the_interpreter_ends_it(tmp_path, ending):
    """Exit code, output left in the buffers, a non-daemon thread still running, atexit
    functions: the same from the zygote (which leaves without tearing the modules down) as from
    a fresh interpreter."""
    script = tmp_path / "job.py"
    script.write_text("import atexit, sys, threading, time\n"
                      "atexit.register(print, 'atexit')\n"
                      "threading.Thread(target=lambda: (time.sleep(0.5), print('thread'))).start()\n"
                      "print('unflushed', end='')\n"
                      f"{EXITS[ending]}\n")
    forked, fresh = (run_cli([], script=script, fresh=f) for f in (False, True))
    assert forked.stdout == fresh.stdout == "unflushedthread\natexit\n"
    assert forked.returncode == fresh.returncode == {"returns": 0, "exits with a code": 3}.get(
        ending, 1)
    assert forked.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
    if ending == "raises":
        assert fresh.stderr.splitlines()[-1] == "ValueError: bad row"


def test_runs_overlap_and_a_run_its_caller_stops_waiting_for_is_stopped(tmp_path, request):
    """The zygote waits for several runs at once: a short run ends while a 2-rank run sleeps;
    when that run's caller gives up (its timeout), both its ranks are stopped."""
    if request.config.getoption("--fresh-cli"):
        pytest.skip("about the zygote")
    pids = tmp_path / "pids"
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(f"import os, time\nwith open({str(pids)!r}, 'a') as f:\n"
                       f"    f.write(f'{{os.getpid()}}\\n')\ntime.sleep(120)\n")
    quick = tmp_path / "quick.py"
    quick.write_text("print('quick')\n")
    assert run_cli([], script=quick).stdout == "quick\n"  # the zygote started: no import below
    with ThreadPoolExecutor(1) as pool:
        sleeping = pool.submit(run_cli, [], nproc=2, timeout=4, script=sleeper)
        while len(pids.read_text().split() if pids.exists() else []) < 2:
            time.sleep(0.05)
        assert run_cli([], script=quick).stdout == "quick\n"
        assert not sleeping.done()
        with pytest.raises(subprocess.TimeoutExpired):
            sleeping.result()
    ranks = [int(pid) for pid in pids.read_text().split()]
    deadline = time.monotonic() + STOP_GRACE_S + 10
    while any(os.path.exists(f"/proc/{pid}") for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in ranks if os.path.exists(f"/proc/{pid}")]


def test_runs_whose_environment_libraries_read_when_loaded_start_fresh():
    zygote = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    assert not needs_fresh({**zygote, "WORLD_SIZE": "2", "PATH": "/usr/bin"}, zygote)
    assert needs_fresh({**zygote, "OMP_NUM_THREADS": "2"}, zygote)
    assert needs_fresh({**zygote, "ATEN_CPU_CAPABILITY": "avx2"}, zygote)
    assert needs_fresh({**zygote, "PYTHONPATH": "/elsewhere"}, zygote)
    assert needs_fresh({"PATH": "/bin"}, zygote)  # OMP_NUM_THREADS unset: the library default


def test_the_timing_notice_names_files_well_over_their_recorded_time():
    recorded = {"tests/a.py": 10.0, "tests/b.py": 20.0, "tests/c.py": 2.0}
    measured = {"tests/a.py": 16.0, "tests/b.py": 29.0, "tests/c.py": 6.0, "tests/new.py": 5.5}
    assert grown(recorded, measured) == [("tests/a.py", 10.0, 16.0), ("tests/new.py", 0.0, 5.5)]


@pytest.mark.parametrize("listed", [False, True])
def test_the_timing_notice_is_one_line_unless_the_files_are_asked_for(monkeypatch, listed):
    """A full run with 26 files over their time: `make test` ends in one line counting them;
    --slower-files names each (a developer's question, not the user's)."""
    import suite_timing

    recorded = {f"tests/test_{i:02}.py": 10.0 for i in range(26)}
    monkeypatch.setattr(suite_timing, "_recorded", lambda: recorded)
    monkeypatch.setattr(suite_timing, "_full_run", lambda config: True)
    monkeypatch.setattr(suite_timing, "_seconds", defaultdict(float, {  # this test's own reports
        name: 20.0 + i for i, name in enumerate(recorded)}))  # (the live plugin) add to it
    said = []
    reporter = SimpleNamespace(write_line=said.append, section=lambda title: said.append(title))
    options = {"--record-durations": False, "--slower-files": listed}
    suite_timing.pytest_terminal_summary(reporter, 0, SimpleNamespace(getoption=options.get))
    if listed:
        assert len(said) == 28 and said[1] == "tests/test_00.py: 20 s (recorded 10 s)"
    else:
        assert said == ["timing: 26 test files slower than tests/durations.json records (the "
                        "most: tests/test_25.py 45 s, recorded 10 s); --slower-files names them"]
