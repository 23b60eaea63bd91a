# dlrm_hybrid on NVIDIA's NGC PyTorch image, which brings CUDA, NCCL, torch and DALI, all kept:
# `make install-dev TORCH=system VENV=` installs into the image's own Python the fbgemm-gpu and
# torchrec built for its torch (install/torch_versions.txt: torch 2.11-2.14) and this package,
# and keeps the image's DALI. An image whose torch the table does not know fails the build in
# one line naming the known ones.
#   docker build -t dlrm_hybrid .    (another release: --build-arg FROM_IMAGE_NAME=nvcr.io/...)
#   docker run --gpus all --ipc=host dlrm_hybrid launch/single_node.sh configs/demo.yaml
#   docker run --gpus all --ipc=host dlrm_hybrid dlrm-hybrid plan --config configs/demo.yaml
# NGC's entry point stays (/opt/nvidia/nvidia_entrypoint.sh: the image's notices, then the
# command given, or a shell). launch/ holds the torchrun wrappers (single_node.sh,
# multi_node.sh, slurm.sbatch, docker_run.sh); benchmarks/gpu_check.sh OUT runs the GPU check.
ARG FROM_IMAGE_NAME=nvcr.io/nvidia/pytorch:26.10-py3
FROM ${FROM_IMAGE_NAME}

WORKDIR /workspace/dlrm_hybrid
COPY Makefile setup.py requirements.txt requirements-gpu.txt requirements-dev.txt ./
COPY install ./install
COPY dlrm_hybrid ./dlrm_hybrid
# FBGEMM=cuda: a build sees no GPU driver, so `auto` would pick the CPU build (and leave out
# requirements-gpu.txt; here the image's DALI stands for it). install-dev: the image carries the
# tests, and the GPU check (benchmarks/gpu_check.sh) runs the `gpu` ones.
RUN make install-dev TORCH=system VENV= FBGEMM=cuda PYTHON=python3 \
 && rm -rf /root/.cache/pip
COPY configs ./configs
COPY launch ./launch
COPY benchmarks ./benchmarks
COPY tests ./tests
COPY pytest.ini ./
# Restarted workers must not reuse the rendezvous store of the attempt before (launch/ sets it
# too; this covers a torchrun started by hand).
ENV TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
