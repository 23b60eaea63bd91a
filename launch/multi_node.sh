#!/usr/bin/env bash
# Several hosts: run this on every host with the same ENDPOINT (host:port of one of them) and
# JOB_ID; torchrun's c10d rendezvous forms the job, ranks are numbered host by host.
#   NNODES=2 ENDPOINT=node0:29500 launch/multi_node.sh configs/criteo_1tb_fl15.yaml --set data.path=/data/criteo
# NPROC: processes per host (default: GPUs found, else 2). MAX_RESTARTS: restarts of the whole
# job after a rank dies (default 3); each restart resumes from the newest checkpoint.
set -euo pipefail
config=${1:?usage: NNODES=N ENDPOINT=host:port launch/multi_node.sh CONFIG [--set KEY=VALUE ...]}
shift
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
nproc=${NPROC:-$([ "${gpus:-0}" -gt 0 ] && echo "$gpus" || echo 2)}
# Restarted workers must not reuse the rendezvous store of the attempt before (pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# torchrun as dlrm_hybrid.torchrun (the config checked once before any rank starts; a failure
# or a signal ends in the ranks' one line and exit code), a module of PYTHON (default:
# this checkout's .venv, else `python` on PATH): in a venv that sees a system
# torch, the `torchrun` on PATH runs the system Python.
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-$([ -x "$root/.venv/bin/python" ] && echo "$root/.venv/bin/python" || echo python)}
exec "$python" -m dlrm_hybrid.torchrun --nnodes="${NNODES:?set NNODES}" --nproc_per_node="$nproc" \
    --rdzv_backend=c10d --rdzv_endpoint="${ENDPOINT:?set ENDPOINT=host:port}" \
    --rdzv_id="${JOB_ID:-dlrm_hybrid}" --max-restarts="${MAX_RESTARTS:-3}" \
    -m dlrm_hybrid train --config "$config" --set checkpoint.resume=auto "$@"
