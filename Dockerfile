# dlrm_hybrid on NVIDIA's NGC PyTorch image: the image brings CUDA, NCCL and torch; fbgemm-gpu and
# torchrec must match that torch release (DESIGN.md "Version set"), DALI its CUDA major.
#   docker build -t dlrm_hybrid .
#   docker run --gpus all --ipc=host dlrm_hybrid launch/single_node.sh configs/demo.yaml
# Entry point: the `dlrm-hybrid` CLI (train | plan | synth | preprocess | eval | export); launch/
# holds the torchrun wrappers (single_node.sh, multi_node.sh, slurm.sbatch, docker_run.sh).
# BASE must be the NGC release whose torch is the one fbgemm-gpu/torchrec 1.8 are built for
# (torch 2.13); with another, pass the matching FBGEMM_VERSION/TORCHREC_VERSION (fbgemm and
# torchrec minor versions follow torch releases, and a mismatch fails to load).
ARG BASE=nvcr.io/nvidia/pytorch:26.10-py3
FROM ${BASE}

ARG FBGEMM_VERSION=1.8.0
ARG TORCHREC_VERSION=1.8.0
WORKDIR /workspace/dlrm_hybrid
COPY requirements.txt setup.py ./
# torchrec without its declared dependencies (they would replace the image's torch); its own
# needs and ours come from requirements.txt, minus the CPU-only test pins the image does not need.
RUN pip install --no-cache-dir "fbgemm-gpu==${FBGEMM_VERSION}" \
 && pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps "torchrec==${TORCHREC_VERSION}"
COPY dlrm_hybrid ./dlrm_hybrid
COPY configs ./configs
COPY launch ./launch
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python -c "import torchrec, fbgemm_gpu, dlrm_hybrid"
ENV TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=4
ENTRYPOINT []
CMD ["dlrm-hybrid", "--help"]
