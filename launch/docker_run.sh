#!/usr/bin/env bash
# One host in the NGC-based image (see Dockerfile): every GPU, the dataset and a run folder
# mounted, the same torchrun launch as launch/single_node.sh inside.
#   DATA=/data/criteo RUNS=$PWD/runs launch/docker_run.sh configs/criteo_1tb_fl15.yaml --set data.path=/data
set -euo pipefail
config=${1:?usage: DATA=DIR RUNS=DIR launch/docker_run.sh CONFIG [--set KEY=VALUE ...]}
shift
exec docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
    -v "${DATA:?set DATA to the dataset folder}:/data:ro" -v "${RUNS:-$PWD/runs}:/workspace/runs" \
    "${IMAGE:-dlrm_hybrid:latest}" launch/single_node.sh "$config" \
    --set train.run_dir=/workspace/runs/"$(basename "$config" .yaml)" "$@"
