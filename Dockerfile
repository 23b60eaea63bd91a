# dlrm_hybrid on NVIDIA's NGC PyTorch image: the image brings CUDA, NCCL and torch, and keeps
# them: `make install TORCH=system` installs the fbgemm-gpu and torchrec built for the image's
# torch (install/torch_versions.txt: torch 2.11-2.14) into a venv that sees the image's packages.
# An image whose torch the table does not know fails the build in one line naming the known ones.
#   docker build -t dlrm_hybrid .
#   docker run --gpus all --ipc=host dlrm_hybrid launch/single_node.sh configs/demo.yaml
# Entry point: the `dlrm-hybrid` CLI (train | plan | synth | preprocess | eval | export | bench);
# launch/ holds the torchrun wrappers (single_node.sh, multi_node.sh, slurm.sbatch,
# docker_run.sh); benchmarks/gpu_check.sh OUT runs the GPU check.
ARG BASE=nvcr.io/nvidia/pytorch:26.10-py3
FROM ${BASE}

WORKDIR /workspace/dlrm_hybrid
COPY Makefile setup.py requirements.txt ./
COPY install ./install
COPY dlrm_hybrid ./dlrm_hybrid
# FBGEMM=cuda: a build sees no GPU driver, so `auto` would pick the CPU build.
RUN make install TORCH=system FBGEMM=cuda PYTHON=python3 \
 && rm -rf /root/.cache/pip
COPY configs ./configs
COPY launch ./launch
COPY benchmarks ./benchmarks
COPY tests ./tests
COPY pytest.ini ./
ENV PATH=/workspace/dlrm_hybrid/.venv/bin:$PATH \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=4
ENTRYPOINT []
CMD ["dlrm-hybrid", "--help"]
