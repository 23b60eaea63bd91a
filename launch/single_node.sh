#!/usr/bin/env bash
# One host, one process per GPU (or NPROC CPU processes with gloo when there is no GPU).
#   launch/single_node.sh configs/demo.yaml --set train.max_steps=100
set -euo pipefail
config=${1:?usage: launch/single_node.sh CONFIG [--set KEY=VALUE ...]}
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
exec "$python" -m dlrm_hybrid.torchrun --standalone --nproc_per_node="$nproc" \
    -m dlrm_hybrid train --config "$config" "$@"
