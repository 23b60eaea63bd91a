"""Code that only runs on CUDA, checked on CPU under whichever torch/torchrec/fbgemm release is
installed (install/torch_versions.txt): every module imports, and the modules with CUDA-only
branches type-check against that release's torch (a renamed or removed torch.cuda API fails
here, not on the first GPU run)."""

import importlib
import pkgutil
import subprocess
import sys

import dlrm_hybrid
from conftest import ROOT

# The modules with branches that run only on a CUDA device: graph capture, autocast and the
# loss scaler, NCCL setup, pinned memory and DALI's GPU pipeline, GPU timing and memory peaks.
CUDA_PATHS = ["dlrm_hybrid/train/cuda_graphs.py", "dlrm_hybrid/train/precision.py",
              "dlrm_hybrid/train/step.py", "dlrm_hybrid/data/dali_loader.py",
              "dlrm_hybrid/data/loader.py", "dlrm_hybrid/parallel/process_group.py",
              "dlrm_hybrid/bench/roofline.py", "dlrm_hybrid/bench/run.py",
              "dlrm_hybrid/bench/step_split.py", "dlrm_hybrid/compat.py"]


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(dlrm_hybrid.__path__, "dlrm_hybrid.")
             if m.name not in ("dlrm_hybrid._cpu_lookup", "dlrm_hybrid._criteo")]  # C, via ctypes
    assert "dlrm_hybrid.train.cuda_graphs" in names and len(names) > 30
    for name in names:
        importlib.import_module(name)
    importlib.import_module("nvidia.dali.fn")  # what the DALI loader imports when it starts


def test_cuda_only_modules_type_check_against_the_installed_torch(tmp_path, request):
    """mypy keeps its cache in pytest's (.pytest_cache/d/mypy): torch's own modules, most of
    the work (10 s of CPU on a cold cache, as in a fresh clone, with the torch packages
    tests/mypy_cuda_paths.ini leaves out; under 1 s on a warm one), are checked again only
    when the installed torch changes, and ours whenever they change (mypy's incremental mode
    compares each file's hash and the options); `make clean` or `-p no:cacheprovider` starts
    cold."""
    cache = getattr(request.config, "cache", None)
    cache = cache.mkdir("mypy") if cache is not None else tmp_path
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file",
                          str(ROOT / "tests/mypy_cuda_paths.ini"), f"--cache-dir={cache}",
                          *CUDA_PATHS],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
