#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): every GPU stage a user's run goes through, a table last.
# On a host where fbgemm-gpu and torchrec are installed:   benchmarks/gpu_check.sh OUT [options]
# On the lent GPU machine, which lacks them, in two device calls back to back (the packages are
# packed on the CPU machine first by ../shared/gpu/pack.sh into .gpu/a and .gpu/b):
#   call 1, carrying .gpu/a:   bash benchmarks/gpu_check.sh --unpack      (~40 s with the start)
#   call 2, carrying .gpu/b:   bash benchmarks/gpu_check.sh "$OUT"        (within 10 minutes)
# Both unpack into /tmp/site, which lasts while the machine stays warm (30 s after a call).
#   benchmarks/gpu_check.sh OUT --cpu-rehearsal     the same stages on CPU, to check the script
#   benchmarks/gpu_check.sh --speed OUT [--cpu-rehearsal]   call 2 for the speed table instead
#                                                   (benchmarks/gpu_speed.py)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
site=/tmp/site
if [ "${1:-}" = "--unpack" ]; then
    bash "$root/.gpu/a/unpack.sh"
    nvidia-smi -L
    exit 0
fi
if [ -f "$root/.gpu/b/unpack.sh" ] && nvidia-smi -L >/dev/null 2>&1; then  # the lent machine
    if ! ls "$site"/fbgemm_gpu/*.so >/dev/null 2>&1; then
        echo "gpu_check: $site holds no fbgemm libraries (a fresh machine?): run" \
             "'benchmarks/gpu_check.sh --unpack' carrying .gpu/a first" >&2
        exit 2
    fi
    bash "$root/.gpu/b/unpack.sh"
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
python=${PYTHON:-$([ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python3)}
if [ "${1:-}" = "--speed" ]; then
    shift
    exec "$python" "$root/benchmarks/gpu_speed.py" "$@"
fi
exec "$python" "$root/benchmarks/gpu_check.py" "$@"
