"""`make install`: the torch -> fbgemm/torchrec table, and TORCH=system keeping the torch an
environment already has (as in an NGC container or on a GPU host)."""

import _ctypes
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest
import torch

from conftest import ROOT

spec = importlib.util.spec_from_file_location("setup_env", ROOT / "install/setup_env.py")
setup_env = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup_env)


def test_the_table_knows_each_supported_torch_and_reads_any_version_string():
    table = setup_env.read_table()
    assert set(table) >= {"2.11", "2.12", "2.13", "2.14"}
    assert table["2.13"] == ("1.8.0", "1.8.0")  # the default install's verified pair
    for version, minor in [("2.11.0+cu130", "2.11"), ("2.13.0", "2.13"),
                           ("2.9.0a0+50eac811a6.nv25.10", "2.9")]:  # NGC's spelling
        assert setup_env.torch_minor(version) == minor
    with pytest.raises(setup_env.InstallError, match="FBGEMM=cuda, but torch 2.13.0 is a CPU"):
        setup_env.fbgemm_package({"version": "2.13.0", "cuda": None, "hip": None}, "cuda")


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


def test_torch_system_keeps_the_torch_the_environment_has(tmp_path):
    """An existing environment that already sees a torch (here: this suite's packages, on its
    path the way a system site-packages is) goes through `make install TORCH=system` with that
    torch untouched: nothing named torch lands in it, and the package imports from it."""
    env = tmp_path / "env"
    venv.create(env, with_pip=False)  # pip, torch and the rest come from the path entry below
    site = Path(subprocess.check_output(
        [str(env / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        text=True).strip())
    (site / "preinstalled.pth").write_text(sysconfig.get_path("purelib") + "\n")
    checkout = tmp_path / "checkout"  # a copy, so the editable install builds its own extension
    checkout.mkdir()
    for name in ("Makefile", "setup.py", "requirements.txt"):
        shutil.copy(ROOT / name, checkout / name)
    for folder in ("install", "dlrm_hybrid"):
        shutil.copytree(ROOT / folder, checkout / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    run = subprocess.run(["make", "install", "TORCH=system", f"VENV={env}"], cwd=checkout,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"setup_env: torch {torch.__version__} ({torch.__file__})" in run.stdout
    assert not list(site.glob("torch*")), "torch was installed into the environment"
    assert (env / ".torch").read_text().strip() == "system"  # later `make test` stays on it
    where = subprocess.run([str(env / "bin/python"), "-c",
                            "import torch, dlrm_hybrid; print(torch.__file__, dlrm_hybrid.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path)
    assert where.stdout.split() == [torch.__file__, str(checkout / "dlrm_hybrid/__init__.py")], \
        where.stderr[-2000:]
