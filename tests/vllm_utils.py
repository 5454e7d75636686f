"""Shared helpers for the vLLM test family: servers that always die in teardown, HF references, perturbed weights.

Servers start with `--enforce-eager` (no torch.compile: ~30 s instead of ~60 s on 2 cores), float32 so vLLM's
logprobs match HF's to ~1e-6, and `TWO_PROCESS_ENV` (the worker inside the engine-core process: ~25 s instead of
~37 s to healthy on 2 quiet cores; `grpo-async serve`'s own default, three processes, is what test_cli and
test_readme_commands start).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys

import torch
from support.warm_launch import start_server, start_server_command

from grpo_async.generation.server_process import CPU_ENV, TWO_PROCESS_ENV, ServerProcess, wait_ready
from grpo_async.net import free_port

API_KEY = "test-key"
#: the tiny model's 16 requests of 256 tokens need 4 MiB of KV cache: 64 MiB (`grpo-async serve`'s own floor) instead
#: of the 1 GiB `VLLM_CPU_KVCACHE_SPACE` of `server_process.CPU_ENV`, which a server would spend ~0.5 CPU-s zeroing
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "16"]
SERVER_ARGS += ["--kv-cache-memory-bytes", str(64 * 2**20)]
PROMPTS = [[7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33]]
#: a stock `vllm serve`'s flag for our weight-transfer engine (the `vllm.general_plugins` entry point of `grpo_async`)
ENGINE_FLAG = ["--weight-transfer-config", '{"backend": "grpo_async"}']


def start_stock_server(model: str, *, dev_mode: bool = True, extra_args=()) -> ServerProcess:
    """A plain `vllm serve` on a free loopback port (vLLM's api_server module, not grpo-async serve), started as vLLM
    documents its RL API (`VLLM_SERVER_DEV_MODE=1` unless `dev_mode` is False): its command line and environment, the
    API process forked from the warm interpreter (`warm_launch.start_server_command`: what the server answers is the
    subject here, not how a process starts)."""
    port = free_port()
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--logprobs-mode", "processed_logprobs", *SERVER_ARGS]
    args += list(extra_args)
    env = {**CPU_ENV, **os.environ, **TWO_PROCESS_ENV}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return wait_ready(start_server_command(args, env, port=port, api_key=None), timeout=300)


@contextlib.contextmanager
def running_servers(model: str, count: int = 1, api_key: str | None = API_KEY, extra_args=()):
    """Start `count` servers concurrently (their API processes forked from a warm interpreter:
    `warm_launch.start_server`); yield them; stop every one (process group) on exit."""
    servers: list[ServerProcess] = []
    try:
        for _ in range(count):
            servers.append(
                start_server(model, api_key=api_key, extra_args=SERVER_ARGS + list(extra_args), env=TWO_PROCESS_ENV)
            )
        for s in servers:
            wait_ready(s, timeout=300)
        yield servers
    finally:
        for s in servers:
            s.stop()


def perturbed_state_dict(model_path: str, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model with every weight shifted by seeded noise (so a sync is visible), and its state dict."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def digests(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for k, v in state_dict.items()
    }


@torch.no_grad()
def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> list[float]:
    """HF `log_softmax(logits / T)` of each completion token given the prompt and the tokens before it."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[torch.arange(len(completion)), torch.tensor(completion)].tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def assert_matches_hf(model, prompt, completion, logprobs, temperature=1.0, atol=1e-4):
    ref = hf_logprobs(model, prompt, completion, temperature)
    assert len(ref) == len(logprobs)
    worst = max((abs(a - b) for a, b in zip(ref, logprobs)), default=0.0)
    assert worst < atol, f"sampler logprobs differ from HF by {worst:.2e}: {logprobs} vs {ref}"
