# `make demo` trains the default config; `make test` runs the tests. Both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
TORCH_VERSION := 2.13.0
FBGEMM_VERSION := 1.8.0
TORCHREC_VERSION := 1.8.0

GPUS := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
ifeq ($(GPUS),0)
  FBGEMM := fbgemm-gpu-cpu==$(FBGEMM_VERSION)
  NPROC ?= 2
else
  FBGEMM := fbgemm-gpu==$(FBGEMM_VERSION)
  NPROC ?= $(GPUS)
endif
# One stamp per fbgemm build: moving the checkout to a GPU host reinstalls the right one.
STAMP := $(VENV)/.installed-$(subst ==,-,$(FBGEMM))

.PHONY: demo test install clean

demo: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) -m dlrm_hybrid train --config configs/demo.yaml

test: $(STAMP)
	$(PY) -m pytest -q tests

install: $(STAMP)

# torchrec goes in last, with --no-deps: it declares the CUDA fbgemm-gpu, which on a CPU machine
# fails to load and overwrites the CPU build (DESIGN.md, "Version set"); requirements.txt has
# the rest of its needs.
$(STAMP): requirements.txt setup.py Makefile dlrm_hybrid/csrc/cpu_lookup.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	rm -f $(VENV)/.installed-*
	$(PIP) torch==$(TORCH_VERSION) $(FBGEMM) -r requirements.txt
	$(PIP) --no-deps torchrec==$(TORCHREC_VERSION)
	$(PIP) --no-deps --no-build-isolation -e .
	$(PY) -c "import torchrec, fbgemm_gpu, dlrm_hybrid"
	touch $@

clean:
	rm -rf $(VENV) runs .pytest_cache
