#!/usr/bin/env bash
# The GPU check in one command: gpu tests, bench on the FL15 shape per precision, a 2-GPU NCCL
# run; writes OUT/gpu_check.json and OUT/gpu_check.md. See benchmarks/gpu_check.py.
#   benchmarks/gpu_check.sh OUT [--steps 30] [--settings fp32 bf16 bf16+graphs] [--cpu-rehearsal]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$([ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python)}
exec "$python" "$root/benchmarks/gpu_check.py" "$@"
