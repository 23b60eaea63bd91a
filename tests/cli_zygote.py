"""The CLI zygote: `python -m dlrm_hybrid ARGS` for the tests without the interpreter's start-up.

A fresh `python -m dlrm_hybrid train ...` spends ~3 s importing torch, torchrec and fbgemm before
it does anything, a 2-rank torchrun launch ~4-5 s. The zygote is one process that imports them
once and then forks, per run, a process that runs the CLI as `python -m dlrm_hybrid` would: the
run's own working directory and environment (os.environ replaced), stdout and stderr to the
caller's files, the exit code the interpreter would give (SystemExit's code; 1 after an uncaught
exception's traceback). A run of N ranks forks N processes with the environment torchrun gives
its workers (each forms its own gloo group, as under torchrun); they share stdout and stderr, and
when one fails the others are stopped (SIGTERM, SIGKILL after STOP_GRACE_S) and the job's code is
the failed rank's (torchrun's own is 1; a rank killed by signal N gives -N, as subprocess says).

Fork-safe by construction: the zygote only imports, never runs a torch op, and holds one thread
(asserted before every fork), so that OpenMP, oneDNN and gloo start in the forked run as they do
in a fresh interpreter. What differs from one, and so must run fresh (the caller routes it): an
environment that the imported libraries read when loaded (FRESH_ENV_PREFIXES).

Processes: zygote -> rank(s), forked per request, each a session leader like torchrun's workers;
the zygote waits for every run's ranks in its one loop (a job process between them cost a fork
and an exit of the whole zygote, 0.03 s of CPU per run). Protocol, one SOCK_SEQPACKET
connection per run: the request is a JSON message {argv, env, cwd, nproc, script,
sigint_default} carrying the stdout and stderr descriptors (SCM_RIGHTS); once the ranks are
forked, {"pids": [...]}; then the answer
{"returncode": n} or {"error": text}. The caller closing the connection stops the run (its
timeout). The zygote ends when its stdin closes (the test session ended or died).

usage: python tests/cli_zygote.py LISTENING_SOCKET_FD   (Zygote below starts it)
"""

from __future__ import annotations

import atexit
import importlib
import json
import locale
import os
import random
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
# What train, eval, export, predict and bench import (torch, torchrec and fbgemm among them);
# what retrieve, recommend and the two-tower runs import (faiss; numpy.ma: a profile of the
# suite found them imported anew in 25 and 43 forked runs).
PRELOAD = ("torch", "torchrec", "fbgemm_gpu", "torch.utils.tensorboard", "dlrm_hybrid.cli",
           "dlrm_hybrid.parallel.host_memory", "dlrm_hybrid.parallel.process_group",
           "dlrm_hybrid.train.loop",
           "dlrm_hybrid.train.inference", "dlrm_hybrid.serve.export", "dlrm_hybrid.serve.predict",
           "dlrm_hybrid.bench.run", "dlrm_hybrid.retrieval.index", "numpy.ma")
# Read by the interpreter or by libraries when they load (libgomp: OMP_NUM_THREADS; ATen: its
# CPU capability; oneDNN: its ISA limit; the dynamic loader; Python itself): a run whose value
# differs from the zygote's cannot be a fork of it.
FRESH_ENV_PREFIXES = ("PYTHON", "LD_", "OMP_", "GOMP_", "KMP_", "MKL_", "ONEDNN_", "DNNL_",
                      "ATEN_", "TORCH_CPP_", "MALLOC_")
STOP_GRACE_S = 5.0
MESSAGE_BYTES = 1 << 20


def needs_fresh(env: Dict[str, str], zygote_env: Dict[str, str]) -> bool:
    """Whether a run in `env` must start a fresh interpreter rather than fork the zygote."""
    return any(key.startswith(FRESH_ENV_PREFIXES) and env.get(key) != zygote_env.get(key)
               for key in set(env) | set(zygote_env))


class Zygote:
    """The test session's side: starts the zygote and sends it runs."""

    def __init__(self, env: Dict[str, str]):
        self.env = dict(env)
        self._address = f"\0dlrm_hybrid-cli-zygote-{os.getpid()}-{os.urandom(4).hex()}"
        self._log = tempfile.TemporaryFile()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
            listener.bind(self._address)
            listener.listen(16)  # runs sent before the zygote is ready wait here
            self._process = subprocess.Popen(
                [sys.executable, __file__, str(listener.fileno())], cwd=ROOT, env=self.env,
                stdin=subprocess.PIPE, stdout=self._log, stderr=subprocess.STDOUT,
                pass_fds=[listener.fileno()])

    def run(self, argv: List[str], env: Dict[str, str], cwd: Path, nproc: int, timeout: float,
            cmd: List[str], script: str = "", raw: bool = False) -> subprocess.CompletedProcess:
        """`cmd` (`python -m dlrm_hybrid ARGV`, or `python SCRIPT ARGV`; under torchrun for
        nproc > 0) as subprocess.run with capture_output=True, text=True would give it (`raw`:
        without text mode's universal newlines), forked from the zygote."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            conn = self._send(argv, env, cwd, nproc, script, out.fileno(), err.fileno())
            with conn:
                conn.settimeout(timeout)
                try:
                    returncode = self._answer(conn, argv)
                except socket.timeout:
                    conn.close()  # the job stops its ranks
                    raise subprocess.TimeoutExpired(cmd, timeout, _text(out),
                                                    _text(err)) from None
            return subprocess.CompletedProcess(cmd, returncode, _text(out, raw), _text(err, raw))

    def start(self, argv: List[str], env: Dict[str, str], cwd: Path, cmd: List[str],
              script: str = "", raw: bool = False) -> "ZygoteProcess":
        """`cmd` (one process) as subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True,
        start_new_session=True) starts it from a shell with SIGINT's default action (a terminal),
        forked from the zygote: its pid leads its own process group, its output comes through
        the pipes as it is written (`raw`: decoded without universal newlines)."""
        (out_read, out_write), (err_read, err_write) = os.pipe(), os.pipe()
        try:
            conn = self._send(argv, env, cwd, 0, script, out_write, err_write,
                              sigint_default=True)
        finally:
            os.close(out_write)
            os.close(err_write)
        pids = json.loads(conn.recv(MESSAGE_BYTES) or b'{"pids": []}').get("pids")
        if not pids:
            raise RuntimeError(f"the CLI zygote could not start {argv}: {self.log_tail()}")
        return ZygoteProcess(self, conn, cmd, pids[0], out_read, err_read, raw)

    def _send(self, argv, env, cwd, nproc, script, out: int, err: int,
              sigint_default: bool = False) -> socket.socket:
        """A connection to the zygote that has sent it the run's request."""
        request = json.dumps({"argv": argv, "env": env, "cwd": str(cwd), "nproc": nproc,
                              "script": script, "sigint_default": sigint_default})
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.connect(self._address)
        except OSError as e:
            conn.close()
            raise RuntimeError(f"the CLI zygote is gone ({e}): {self.log_tail()}") from None
        socket.send_fds(conn, [request.encode()], [out, err])
        return conn

    def _answer(self, conn: socket.socket, argv: List[str]) -> int:
        """The run's exit code, past the message naming its ranks."""
        while True:
            answer = conn.recv(MESSAGE_BYTES)
            if not answer:
                raise RuntimeError(f"the CLI zygote ended a run without an answer: "
                                   f"{self.log_tail()}")
            reply = json.loads(answer)
            if "error" in reply:
                raise RuntimeError(f"the CLI zygote could not run {argv}: {reply['error']}")
            if "returncode" in reply:
                return reply["returncode"]

    def log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


class ZygoteProcess:
    """What a test reads of a subprocess.Popen, for a run Zygote.start forked: pid, stdout and
    stderr (text, universal newlines), poll, wait, communicate, send_signal, terminate, kill
    (the last two to its process group, as it leads one)."""

    def __init__(self, zygote: Zygote, conn: socket.socket, args: List[str], pid: int,
                 out: int, err: int, raw: bool = False):
        self.args, self.pid, self.returncode = args, pid, None
        self._zygote, self._conn, self._readers = zygote, conn, None
        encoding, newline = locale.getpreferredencoding(False), "" if raw else None
        self.stdout, self.stderr = (open(fd, encoding=encoding, newline=newline)
                                    for fd in (out, err))

    def poll(self) -> Optional[int]:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                self.returncode = self._zygote._answer(self._conn, self.args)
            except socket.timeout:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._conn.close()
        return self.returncode

    def communicate(self, timeout: Optional[float] = None):
        """The rest of stdout and stderr once the run ends, as Popen's."""
        if self._readers is None:
            self._readers = [_Reader(f) for f in (self.stdout, self.stderr)]
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.01, deadline - time.monotonic()))
        return self._readers[0].text, self._readers[1].text

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self._signal_group(signal.SIGTERM)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:  # ended
            pass


class _Reader(threading.Thread):
    """A pipe read to its end (and closed) beside the caller."""

    def __init__(self, file):
        super().__init__(daemon=True)
        self.file, self.text = file, ""
        self.start()

    def run(self) -> None:
        with self.file:
            self.text = self.file.read()


def _text(file, raw: bool = False) -> str:
    """What subprocess's text mode gives: the locale's decoding, universal newlines (`raw`:
    the decoding alone)."""
    file.seek(0)
    data = file.read().decode(locale.getpreferredencoding(False))
    return data if raw else data.replace("\r\n", "\n").replace("\r", "\n")


# --- the zygote process ----------------------------------------------------------------------

def _assert_one_thread() -> None:
    """Forking a process with other threads copies their locks in whatever state they are."""
    threads = len(os.listdir("/proc/self/task"))
    assert threads == 1, f"the CLI zygote has {threads} threads; it must fork with one"


def serve(listener_fd: int) -> Optional[dict]:
    """The zygote's loop. Returns None when the session ends; in a forked rank, returns the
    run's request (the rank then runs it from the top level, outside this loop)."""
    sys.path[0] = str(ROOT)  # `python -m` from the checkout: the package from there
    from dlrm_hybrid.startup import collector_paused

    with collector_paused():  # and frozen: no run writes to their pages to collect them
        for module in PRELOAD:
            importlib.import_module(module)
    listener = socket.socket(fileno=listener_fd)
    jobs: List[_Job] = []
    while True:
        waiting = [listener, 0, *[fd for job in jobs for fd in job.waits_on()]]
        deadline = min((job.deadline for job in jobs if job.deadline is not None), default=None)
        timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        ready = select.select(waiting, [], [], timeout)[0]
        if 0 in ready:  # stdin closed: the session is over
            return None
        for job in jobs:
            job.step(ready)
        jobs = [job for job in jobs if not job.done()]
        if listener in ready:
            conn, _ = listener.accept()
            request = _start_job(conn, jobs)
            if request is not None:  # this process is one of its ranks now
                listener.close()
                return request


class _Job:
    """One run's ranks, waited for as torchrun waits for its workers: all succeed, or the first
    to fail ends the job (the others get SIGTERM, SIGKILL after STOP_GRACE_S). The connection
    becoming readable means the caller gave up (its timeout): the ranks are stopped so too."""

    def __init__(self, conn: socket.socket, pids: List[int]):
        self.conn, self.pids, self.code = conn, pids, 0
        self.running = {os.pidfd_open(pid): pid for pid in pids}
        self.deadline: Optional[float] = None  # while stopping: when SIGKILL follows

    def waits_on(self) -> list:
        """The ranks' pidfds, and while nothing stops them the connection."""
        return [*([self.conn] if self.deadline is None else []), *self.running]

    def step(self, ready: list) -> None:
        if self.conn in ready and self.deadline is None:
            self._stop(-signal.SIGKILL)
        for fd in [fd for fd in self.running if fd in ready]:
            code = os.waitstatus_to_exitcode(os.waitpid(self.running.pop(fd), 0)[1])
            os.close(fd)
            if code and self.deadline is None:
                self._stop(code)
        if self.running and self.deadline is not None and time.monotonic() >= self.deadline:
            self._signal(signal.SIGKILL)
            self.deadline = time.monotonic() + 60
        if not self.running:
            self._finish()

    def _stop(self, code: int) -> None:
        self.code = code
        self._signal(signal.SIGTERM)
        self.deadline = time.monotonic() + STOP_GRACE_S

    def done(self) -> bool:
        return not self.running

    def _signal(self, signum: int) -> None:
        for pid in self.running.values():
            try:
                os.killpg(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def _finish(self) -> None:
        for pid in self.pids:  # what a rank left behind in its group
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.conn.send(json.dumps({"returncode": self.code}).encode())
        except OSError:  # the caller is gone
            pass
        self.conn.close()


def _start_job(conn: socket.socket, jobs: List[_Job]) -> Optional[dict]:
    """Fork the run's rank(s) and add their job to `jobs`. Returns the request only in a rank,
    which has closed what the zygote holds for the other runs."""
    fds: List[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, MESSAGE_BYTES, 2)
        request = json.loads(message)
        nproc = request["nproc"]
        envs = [request["env"]] if not nproc else _rank_envs(request["env"], nproc)
        pids = []
        for env in envs:
            _assert_one_thread()
            pid = os.fork()
            if pid == 0:
                _become_rank(env, request["cwd"], *fds, request.get("sigint_default", False),
                             [conn, *[fd for job in jobs for fd in (job.conn, *job.running)]])
                return request
            pids.append(pid)
        conn.send(json.dumps({"pids": pids}).encode())
        jobs.append(_Job(conn, pids))
    except Exception:
        try:
            conn.send(json.dumps({"error": traceback.format_exc()}).encode())
        except OSError:
            pass
        conn.close()
    for fd in fds:
        os.close(fd)
    return None


def _rank_envs(env: Dict[str, str], nproc: int) -> List[Dict[str, str]]:
    """What torchrun --standalone --nproc_per_node=nproc gives each worker (less its agent's
    store and error files, which only torchrun's agent reads)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = {"WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "ROLE_WORLD_SIZE": nproc,
           "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1, "ROLE_NAME": "default",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
           "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": f"zygote-{os.getpid()}",
           "TORCH_NCCL_ASYNC_ERROR_HANDLING": 1}
    return [{**env, **{k: str(v) for k, v in job.items()},
             "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)} for r in range(nproc)]


def _become_rank(env: Dict[str, str], cwd: str, out: int, err: int,
                 sigint_default: bool, zygote_fds: list) -> None:
    """Turn this fork into the fresh process the run would have been (`sigint_default`: one
    started with SIGINT's default action, where Python installs its KeyboardInterrupt), less
    the zygote's connections and pidfds for other runs (`zygote_fds`) it was forked holding."""
    try:
        for held in zygote_fds:
            held.close() if isinstance(held, socket.socket) else os.close(held)
        os.setsid()  # its own process group, stopped as one, like torchrun's workers
        if sigint_default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (devnull, out, err):
            os.close(fd)
        sys.path[0] = os.getcwd()  # as `python -m` sets it
        random.seed()  # a fresh interpreter seeds these from the OS, not from the zygote
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _main() -> None:
    request = serve(int(sys.argv[1]))
    if request is None:  # the session is over; nothing to flush or tear down
        os._exit(0)
    script = request.get("script")
    try:
        if script:  # a rank: exactly what `python SCRIPT ARGV` runs
            sys.argv = [script, *request["argv"]]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        else:  # a rank: exactly what `python -m dlrm_hybrid ARGV` runs
            sys.argv = [sys.argv[0], *request["argv"]]
            runpy.run_module("dlrm_hybrid", run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    else:
        code = 0
    _leave(code)


def _exit_code(code: object) -> int:
    """The exit status `sys.exit(code)` gives: None 0, an int itself, anything else printed, 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    """End a rank as the interpreter would (its non-daemon threads joined, the atexit functions
    run, the output flushed), less the teardown of every module: in a fork that touches each
    page shared with the zygote, which took 1.5 s of CPU per run (4 s after a `plan`), more
    than the imports it saves. Objects still alive are not finalized, as Python allows."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream, as at interpreter exit
            pass
    os._exit(code)


if __name__ == "__main__":
    _main()
