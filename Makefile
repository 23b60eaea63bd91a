# `make demo` trains the default config; `make test` runs the tests. Both create or reuse .venv:
# `make demo` (and `make install`) with what a run needs (requirements.txt, and
# requirements-gpu.txt where fbgemm's CUDA build goes in), `make test` (and `make install-dev`)
# with the tests' and benchmarks' tools too (requirements-dev.txt, requirements-gpu.txt).
PYTHON ?= python3
VENV ?= .venv
# VENV= (empty): no venv: install into $(PYTHON) itself, as the Dockerfile does into the NGC
# image's Python (with TORCH=system); the install's state then goes in its prefix's share/.
ifeq ($(VENV),)
  PY := $(PYTHON)
  STATE := $(shell $(PYTHON) -c 'import sys; print(sys.prefix)')/share/dlrm_hybrid
else
  PY := $(VENV)/bin/python
  STATE := $(VENV)
endif
# TORCH: the torch release to install (default 2.13.0), or `system` to keep the torch the
# environment already has (an NGC container, a GPU host): the venv is then created with
# --system-site-packages, or an existing one is used as it is. fbgemm-gpu and torchrec follow
# the torch from install/torch_versions.txt. The choice is remembered in $(STATE)/.torch.
TORCH ?= $(shell cat $(STATE)/.torch 2>/dev/null || echo 2.13.0)
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
STAMP := $(STATE)/.installed-torch-$(TORCH)-fbgemm-$(FBGEMM)-gpus-$(GPUS)
DEV_STAMP := $(STAMP)-dev
INSTALL_INPUTS := requirements.txt requirements-gpu.txt setup.py Makefile install/setup_env.py \
                  install/torch_versions.txt dlrm_hybrid/csrc/cpu_lookup.c dlrm_hybrid/csrc/criteo.c

.PHONY: demo test install install-dev clean

demo: $(STAMP)
	$(PY) -m dlrm_hybrid.torchrun --standalone --nproc_per_node=$(NPROC) -m dlrm_hybrid train --config configs/demo.yaml

test: $(DEV_STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

install: $(STAMP)

install-dev: $(DEV_STAMP)

# The dev install is a run's install and more, so it leaves both stamps: `make demo` after
# `make test` installs nothing.
$(STAMP): $(INSTALL_INPUTS)
$(DEV_STAMP): $(INSTALL_INPUTS) requirements-dev.txt
$(STAMP) $(DEV_STAMP):
	$(if $(VENV),test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV),mkdir -p $(STATE))
	rm -f $(STATE)/.installed-*
	$(PY) install/setup_env.py $(TORCH_ARG) --fbgemm $(FBGEMM)$(if $(filter $(DEV_STAMP),$@), --dev)
	echo $(TORCH) > $(STATE)/.torch
	touch $(sort $(STAMP) $@)

clean:
	rm -rf $(VENV) runs .pytest_cache
