#!/usr/bin/env bash
# The checks only a CUDA GPU can run, as one script for a lent GPU machine (torch + CUDA, transformers, accelerate,
# peft; no vLLM, no internet). Run from the repository root: `bash bench/gpu_checks.sh OUT_DIR`.
# Wheels it needs that such a machine lacks (trl, datasets and their pure-Python deps) are installed from
# `.gpuwheels/` when present (`pip download --no-deps --python-version 3.12 --only-binary=:all: -d .gpuwheels
# trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19` on a machine with a package registry).
# Writes OUT_DIR/{env,pytest,overlap}.txt and the overlap bench's json/png; results go to bench/RESULTS.md by hand.
set -u
OUT=${1:-bench/out/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".gpuwheels/*.whl" >/dev/null; then $PY -m pip install -q --no-deps --no-index .gpuwheels/*.whl; fi
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
{
    date -u
    git log -1 --format='commit %H' 2>/dev/null || echo "commit: (no git here)"
    nvidia-smi -L
    $PY -c "import torch, transformers, accelerate, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'peft', peft.__version__)"
    $PY -c "import vllm" 2>/dev/null && echo "vllm: installed" || echo "vllm: not installed (its gpu tests skip)"
} 2>&1 | tee "$OUT/env.txt"
# the gpu-marked tests: the trainer's publish path on a CUDA model, MFU on a known GPU, a bf16 run, shared prompts
timeout 300 $PY -m pytest -v -m gpu -rs --continue-on-collection-errors \
    tests/test_gpu.py tests/test_publisher.py tests/test_perf_metrics.py tests/test_weight_sync.py 2>&1 \
    | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Error" | tail -40 | tee "$OUT/pytest.txt"
# overlap of generation (transformers' generate on the engine's copy) and training on one GPU, both phases ≥ 0.3 s
timeout 300 $PY bench/overlap.py --device cuda --repeats 2 --layers 12 --hidden 1536 --T 96 --prompts 16 --out "$OUT/overlap.json" --plot "$OUT/overlap.png" 2>&1 \
    | grep -v "it/s\]" | tail -25 | tee "$OUT/overlap.txt"
