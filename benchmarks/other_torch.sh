#!/usr/bin/env bash
# The suite on another torch, installed the way a user or a container has it: a fresh venv with
# `pip install torch==VERSION` in it, then `make install-dev TORCH=system VENV=that venv` (which
# must leave that torch's files untouched: checked), then the test suite under it. Prints the
# times.
#   benchmarks/other_torch.sh 2.14.1 [VENV_DIR]      (default /tmp/dlrm_hybrid-torch-VERSION)
# PyPI's Linux torch wheels are CUDA builds (~3 GB with their CUDA libraries); they run on CPU,
# and `make install` pairs them with fbgemm-gpu-cpu where no NVIDIA driver is installed.
set -euo pipefail
version=${1:?usage: benchmarks/other_torch.sh TORCH_VERSION [VENV_DIR]}
env=${2:-/tmp/dlrm_hybrid-torch-$version}
root=$(cd "$(dirname "$0")/.." && pwd)
fingerprint='import torch, os; lib = os.path.join(os.path.dirname(torch.__file__), "lib");
print(torch.__version__, torch.__file__, *(os.stat(os.path.join(lib, f)).st_mtime_ns
      for f in sorted(os.listdir(lib)) if f.endswith(".so")))'

SECONDS=0
[ -x "$env/bin/python" ] || python3 -m venv "$env"
"$env/bin/python" -m pip install --quiet --disable-pip-version-check "torch==$version"
torch_s=$SECONDS
before=$("$env/bin/python" -c "$fingerprint")
make -C "$root" install-dev TORCH=system VENV="$env"  # the suite needs the dev set
install_s=$((SECONDS - torch_s))
after=$("$env/bin/python" -c "$fingerprint")
if [ "$before" != "$after" ]; then
    echo "other_torch: make install-dev TORCH=system changed torch ${before%% *} -> ${after%% *}" >&2
    exit 1
fi
cd "$root"
"$env/bin/python" -m pytest -q tests -p no:cacheprovider
suite_s=$((SECONDS - torch_s - install_s))
echo "other_torch: torch ${after%% *}: pip install torch ${torch_s} s, make install-dev TORCH=system" \
     "${install_s} s (torch kept), suite ${suite_s} s"
