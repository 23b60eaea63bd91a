# `make demo` trains the default config; `make test` runs the tests. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# TORCH: the torch release to install (default 2.13.0), or `system` to keep the torch the
# environment already has (an NGC container, a GPU host): the venv is then created with
# --system-site-packages, or an existing one is used as it is. fbgemm-gpu and torchrec follow
# the torch from install/torch_versions.txt. The choice is remembered in $(VENV)/.torch.
TORCH ?= $(shell cat $(VENV)/.torch 2>/dev/null || echo 2.13.0)
ifeq ($(TORCH),system)
  VENV_FLAGS := --system-site-packages
  TORCH_ARG := --keep-torch
else
  TORCH_ARG := --torch $(TORCH)
endif

GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
ifeq ($(GPUS),0)
  NPROC ?= 2
else
  NPROC ?= $(GPUS)
endif
# FBGEMM: auto (the CUDA build where torch has CUDA and the NVIDIA driver is installed), cuda, cpu.
FBGEMM ?= auto
STAMP := $(VENV)/.installed-torch-$(TORCH)-fbgemm-$(FBGEMM)-gpus-$(GPUS)

.PHONY: demo test install clean

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m dlrm_hybrid.torchrun --standalone --nproc_per_node=$(NPROC) -m dlrm_hybrid train --config configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests

install: $(STAMP)

$(STAMP): requirements.txt setup.py Makefile install/setup_env.py install/torch_versions.txt \
          dlrm_hybrid/csrc/cpu_lookup.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	rm -f $(VENV)/.installed-*
	$(PY) install/setup_env.py $(TORCH_ARG) --fbgemm $(FBGEMM)
	echo $(TORCH) > $(VENV)/.torch
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
