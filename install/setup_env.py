"""Install dlrm_hybrid's dependencies into the running Python environment (`make install`).

`--torch VERSION` installs that torch first (the default path: `make` pins 2.13.0);
`--keep-torch` (`make install TORCH=system`) keeps the torch the environment already has, as in
an NGC container or on a GPU host, and refuses to replace it. Either way fbgemm-gpu and torchrec
come from install/torch_versions.txt for that torch's minor release, in the build torch was made
with and the machine has (`fbgemm-gpu`, the CUDA build, where torch has CUDA and the NVIDIA
driver is installed, since it does not load without the driver's libnvidia-ml; else
`fbgemm-gpu-cpu`, which runs under a CUDA torch too), and torchrec goes in with `--no-deps`: it
declares the CUDA fbgemm-gpu, which on a CPU build fails to load and overwrites the CPU files.

What else goes in: requirements.txt (a run's needs) always; requirements-gpu.txt (DALI, 955 MB
of CUDA builds and codecs a CPU run cannot use) with fbgemm's CUDA build; `--dev` (`make test`)
adds requirements-dev.txt (the tests' and benchmarks' tools) and requirements-gpu.txt on CPU too,
since the tests run DALI's CPU pipelines.

It installs into the Python that runs it: a venv's (`make install`), or an image's own Python
(`make install VENV=`, as the Dockerfile does on NGC's image). A DALI that Python already imports
is kept (NGC's images ship one built for their CUDA), not joined by requirements-gpu.txt's. The
install ends with `pip check`: a line it adds that is not in known_unmet fails it.
Only the standard library is used, since nothing else may be installed yet.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
MLPERF_LOGGING = "mlperf-logging==4.1.68"  # train.mlperf_log (MLPerf Training logs)
TABLE = Path(__file__).resolve().parent / "torch_versions.txt"
# The requirement files by purpose (see the module's docstring), in the repository's root.
RUN, GPU, DEV = "requirements.txt", "requirements-gpu.txt", "requirements-dev.txt"
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
UNMET = re.compile(r"(\S+) \S+ requires (\S+), which is not installed\.")  # a `pip check` line
# What the install imports at its end: our package and the modules it uses beside it, among
# them mlperf-logging's, which must load without pandas and scipy.
MODULES = ["dlrm_hybrid", "torchmetrics.functional.classification", "mlperf_logging.mllog",
           "mlperf_logging.compliance_checker.mlp_compliance"]


class Pair(NamedTuple):
    fbgemm: str
    torchrec: str


class InstallError(Exception):
    """A one-line reason the environment cannot be set up, and what to do."""


def read_table(path: Path = TABLE) -> Dict[str, Pair]:
    """torch minor ("2.13") -> the fbgemm and torchrec versions built for it."""
    pairs = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 3 or not re.fullmatch(r"\d+\.\d+", fields[0]):
            raise InstallError(f"{path}:{number}: expected `torch-minor fbgemm torchrec`, "
                               f"got {line.strip()!r}")
        pairs[fields[0]] = Pair(fields[1], fields[2])
    return pairs


def torch_minor(version: str) -> str:
    """"2.11.0+cu130" and NGC's "2.9.0a0+50eac81.nv25.10" -> "2.11", "2.9"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise InstallError(f"cannot read a torch version from {version!r}")
    return f"{match[1]}.{match[2]}"


def pair_for(version: str, table: Dict[str, Pair]) -> Pair:
    minor = torch_minor(version)
    if minor not in table:
        known = ", ".join(sorted(table, key=lambda m: tuple(map(int, m.split(".")))))
        raise InstallError(f"torch {version}: no fbgemm-gpu/torchrec pair is known for torch "
                           f"{minor}; known: {known} ({TABLE.relative_to(ROOT)}). Use one of "
                           f"those torch releases, or add a row after checking the pair loads")
    return table[minor]


def installed_torch(modules: tuple[str, ...] = ()) -> dict:
    """What `import torch` gives in this environment, asked in a fresh interpreter so a failed
    import is reported rather than raised here; then, in the same interpreter (one torch
    import, ~2 s, not two), `modules` are imported: {"failed": the error's last line} where
    one fails."""
    # The collector off, as dlrm_hybrid/startup.py has it for the CLI: its passes over torch's
    # and torchrec's objects find nothing to free (the install's last probe: 5.4 s of CPU with
    # it, 4.1 s without, median of 3, Intel Xeon with AMX, 2 cores).
    probe = ("import gc; gc.disable(); "
             "import json, importlib.metadata, torch; print('torch:', json.dumps({"
             "'version': torch.__version__, 'dist': importlib.metadata.version('torch'), "
             "'cuda': torch.version.cuda, 'hip': getattr(torch.version, 'hip', None), "
             "'file': torch.__file__}), flush=True)")
    if modules:
        probe += f"; import {', '.join(modules)}"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    last = (result.stderr.strip().splitlines() or ["no output"])[-1]
    # its own line, found among whatever the modules may print when they load
    found = next((line[len("torch: "):] for line in result.stdout.splitlines()
                  if line.startswith("torch: {")), None)
    if found is None:
        raise InstallError(f"{sys.executable}: `import torch` fails ({last}); install torch "
                           f"into this environment (or create it with --system-site-packages "
                           f"where torch is installed system-wide), or drop TORCH=system")
    info = json.loads(found)
    return {**info, "failed": last} if result.returncode != 0 else info


def nvidia_driver() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def fbgemm_package(torch_info: dict, build: str) -> str:
    """`build`: cuda, cpu, or auto (cuda where torch has CUDA and the driver is here). A docker
    build sees no driver, so the Dockerfile asks for cuda."""
    if torch_info["hip"]:
        raise InstallError(f"torch {torch_info['version']} is a ROCm build; PyPI has fbgemm-gpu "
                           f"for CUDA and CPU only")
    if build == "auto":
        build = "cuda" if torch_info["cuda"] and nvidia_driver() else "cpu"
    if build == "cuda" and not torch_info["cuda"]:
        raise InstallError(f"FBGEMM=cuda, but torch {torch_info['version']} is a CPU build; "
                           f"use FBGEMM=auto or a CUDA torch")
    return "fbgemm-gpu" if build == "cuda" else "fbgemm-gpu-cpu"


def sees_system_packages() -> bool:
    """A venv created with --system-site-packages (or no venv at all)."""
    config = Path(sys.prefix) / "pyvenv.cfg"
    return not config.exists() or re.search(r"include-system-site-packages\s*=\s*true",
                                             config.read_text(), re.IGNORECASE) is not None


def installed(distribution: str) -> bool:
    probe = f"import importlib.metadata as m; m.version({distribution!r})"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def remove_other_build(fbgemm: str) -> None:
    """The two fbgemm builds own the same files (fbgemm_gpu/): one installed over the other
    leaves both registered and either's files. Switching removes both, then installs one."""
    other = "fbgemm-gpu-cpu" if fbgemm == "fbgemm-gpu" else "fbgemm-gpu"
    if installed(other):
        print(f"setup_env: removing {other} (switching to {fbgemm})", flush=True)
        if subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "-y", other,
                           fbgemm]).returncode != 0:
            raise InstallError(f"`pip uninstall {other} {fbgemm}` failed (its output is above)")


def importable_dali() -> str | None:
    """The DALI this Python already imports ("2.4.0 at PATH"), or None: an NGC image ships one
    built for its CUDA, and requirements-gpu.txt's, another distribution of the same files, would
    overwrite it."""
    probe = "import nvidia.dali as d; print(d.__version__, 'at', d.__file__)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return result.stdout.strip().splitlines()[-1] if result.returncode == 0 else None


def requirement_files(fbgemm: str, dev: bool) -> list[str]:
    """The requirement files this install takes: a run's everywhere, the GPU's with the CUDA
    build (where DALI's GPU pipelines can run) or for the tests, the tests' tools with `dev`."""
    return [RUN] + ([GPU] if fbgemm == "fbgemm-gpu" or dev else []) + ([DEV] if dev else [])


def requirements(files: list[str], keep_dali: bool) -> str:
    """The files' lines together, less any nvidia-dali line where a DALI is kept."""
    lines = [line + "\n" for name in files for line in (ROOT / name).read_text().splitlines()]
    return "".join(line for line in lines if not (keep_dali and line.startswith("nvidia-dali")))


def known_unmet(fbgemm: str) -> set[tuple[str, str]]:
    """`pip check`'s (distribution, missing requirement) pairs this install leaves on purpose."""
    known = {("mlperf-logging", "pandas"), ("mlperf-logging", "scipy")}  # --no-deps, see install
    if fbgemm == "fbgemm-gpu-cpu":  # torchrec declares the CUDA build; this one stands in for it
        known.add(("torchrec", "fbgemm-gpu"))
    return known


def pip_check() -> set[str]:
    """`pip check`'s complaints about this environment, one per line (none when it passes)."""
    result = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    return set(result.stdout.strip().splitlines()) if result.returncode != 0 else set()


def unexpected(lines: set[str], fbgemm: str) -> list[str]:
    """The `pip check` lines that are not known_unmet(fbgemm)."""
    def pair(line: str) -> tuple[str, ...] | None:
        match = UNMET.fullmatch(line)
        return match and tuple(re.sub(r"[-_.]+", "-", name).lower() for name in match.groups())
    return sorted(line for line in lines if pair(line) not in known_unmet(fbgemm))


def check_requirements(before: set[str], fbgemm: str) -> None:
    """Fails on a `pip check` line the install added that is not a known one; lines that were
    there before it (an image's own packages) are shown and left alone."""
    after = pip_check()
    wrong = unexpected(after, fbgemm)
    added = [line for line in wrong if line not in before]
    for line in wrong:
        if line in before:
            print(f"setup_env: pip check, there before this install, left as is: {line}")
    if added:
        print(*added, sep="\n", file=sys.stderr, flush=True)
        more = f" (and {len(added) - 1} more, above)" if len(added) > 1 else ""
        raise InstallError(f"`pip check` after the install: {added[0].rstrip('.')}{more}; make "
                           f"the pins in requirements*.txt and install/torch_versions.txt agree "
                           f"with it")
    for line in sorted(after - set(wrong)):
        print(f"setup_env: pip check, known (install/setup_env.py known_unmet): {line}")
    print("setup_env: pip check: nothing else", flush=True)


def pip(*args: str) -> None:
    result = subprocess.run([*PIP, *args])
    if result.returncode != 0:
        raise InstallError(f"`pip install {' '.join(args)}` failed (its output is above)")


def install(torch_version: str | None, build: str, table: Dict[str, Pair],
            dev: bool = False) -> dict:
    before = pip_check()
    if torch_version is not None:
        pair_for(torch_version, table)  # an unknown release fails before anything is installed
        pip(f"torch=={torch_version}")
    torch_info = installed_torch()
    pair = pair_for(torch_info["version"], table)
    fbgemm = fbgemm_package(torch_info, build)
    print(f"setup_env: torch {torch_info['version']} ({torch_info['file']}), "
          f"{fbgemm}=={pair.fbgemm}, torchrec=={pair.torchrec}", flush=True)
    if torch_version is None and not sees_system_packages() and \
            torch_info["file"].startswith(sys.prefix + "/"):
        print(f"setup_env: keeping the torch inside {sys.prefix}, which does not see the system "
              f"site-packages; for the system's torch, remove it first (make clean)", flush=True)
    remove_other_build(fbgemm)
    files = requirement_files(fbgemm, dev)
    dali = importable_dali() if GPU in files else None
    if dali:
        print(f"setup_env: keeping the DALI this Python has (nvidia.dali {dali}); "
              f"{GPU}'s nvidia-dali is not installed", flush=True)
    elif GPU not in files:
        print(f"setup_env: {GPU} (DALI, data.loader=dali) is left out: a CPU run does not use "
              f"it; `make test` and the CUDA build (FBGEMM=cuda) install it", flush=True)
    print(f"setup_env: installing {', '.join(files)}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        # Whatever a requirement declares, the torch found stays: pip fails instead of replacing
        # it. The distribution's version, not torch.__version__: PyPI's CUDA wheels say "2.11.0"
        # in their metadata and "2.11.0+cu130" at run time.
        constraints, wanted = Path(folder, "constraints.txt"), Path(folder, "requirements.txt")
        constraints.write_text(f"torch=={torch_info['dist']}\n")
        wanted.write_text(requirements(files, keep_dali=dali is not None))
        pip("-c", str(constraints), f"{fbgemm}=={pair.fbgemm}", "-r", str(wanted))
    # torchrec: see the module's docstring. mllog and the compliance checker need only pyyaml
    # (MODULES imports them below); the pandas and scipy mlperf-logging declares serve its result
    # summarizer and RCP checker, which this program does not use (160 MB installed). `pip
    # check` names them: known_unmet.
    pip("--no-deps", f"torchrec=={pair.torchrec}", MLPERF_LOGGING)
    # PEP 660 straight away: without --use-pep517 pip runs `setup.py develop`, which setuptools
    # >= 80 hands to a nested pip that builds in an isolated environment, fetching setuptools
    # from the index (3.5 s more here, and a network need, for the same editable install).
    # pip >= 25.3 always takes this path (it removed `setup.py develop`).
    pip("--no-deps", "--no-build-isolation", "--use-pep517", "-e", str(ROOT))
    modules = ("fbgemm_gpu", "torchrec", *MODULES)
    if fbgemm == "fbgemm-gpu" and not nvidia_driver():
        # A docker build has no driver, and the CUDA build needs it to load.
        print("setup_env: no NVIDIA driver here, so fbgemm_gpu and torchrec are not imported "
              "now; they load where the GPUs are", flush=True)
        modules = tuple(MODULES)
    after = installed_torch(modules)
    if (after["version"], after["file"]) != (torch_info["version"], torch_info["file"]):
        raise InstallError(f"torch changed during the install: {torch_info['version']} at "
                           f"{torch_info['file']} became {after['version']} at {after['file']}")
    if "failed" in after:
        raise InstallError(f"installed, but `import {', '.join(modules)}` fails under torch "
                           f"{after['version']}: {after['failed']}")
    check_requirements(before, fbgemm)
    return after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--torch", metavar="VERSION", help="install this torch release first")
    which.add_argument("--keep-torch", action="store_true",
                       help="keep the torch this environment has (never reinstalled)")
    parser.add_argument("--fbgemm", choices=["auto", "cuda", "cpu"], default="auto",
                        help="fbgemm-gpu build (auto: CUDA where torch and the driver have it)")
    parser.add_argument("--dev", action="store_true",
                        help=f"also {DEV} and {GPU}: what the tests and benchmarks use")
    args = parser.parse_args(argv)
    try:
        install(args.torch, args.fbgemm, read_table(), args.dev)
    except InstallError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
