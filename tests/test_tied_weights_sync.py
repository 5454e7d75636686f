"""Weight pushes into models whose LM head is tied to the input embedding (SmolLM2, Gemma, Qwen2.5-0.5B, ...).

vLLM ties such a head to `model.embed_tokens` and its loader drops `lm_head.*`, so a layerwise reload that only
loads the embedding leaves the head layer empty: vLLM then warns "ParallelLMHead: Failed to load weights" and puts
the head's old kernel back (issue 20). These tests push a trained model with a clearly changed embedding, the way the
trainer does (`iter_full_params`: the tied head is one parameter, sent once as `model.embed_tokens.weight`), into a
real engine and check both halves: nothing warns that a layer failed to load, and the engine's log-probs after the
push are the trainer model's (the LM head really follows the pushed embedding).
"""

from __future__ import annotations

import logging

import pytest
import torch
from vllm_utils import API_KEY, PROMPTS, assert_matches_hf, hf_logprobs, running_servers

from grpo_async.generation.base import SamplingConfig
from grpo_async.generation.vllm_colocate import VLLMColocateBackend
from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.testing import TinyModelSpec, build_tiny_model
from grpo_async.weight_sync.collect import iter_full_params

pytestmark = pytest.mark.vllm

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED = "Failed to load weights"


@pytest.fixture(scope="module")
def tied_model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tied") / "model", TinyModelSpec(tie_word_embeddings=True))


def trained_model(path: str, seed: int) -> torch.nn.Module:
    """The tied tiny model with every weight shifted by seeded noise, the embedding (= LM head) by a lot more."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one parameter: the trainer sends it once
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        emb = model.model.embed_tokens.weight
        emb.add_(torch.randn(emb.shape, generator=gen) * 0.1)
    return model


class Records(logging.Handler):
    """Collects the messages of one logger (after its own filters, i.e. what vLLM's handler would print)."""

    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def check_follows(backend, model, previous, seed: int) -> None:
    """Sampled log-probs equal `model`'s (within 1e-4) and visibly differ from `previous`'s (the push landed)."""
    out = backend.generate(PROMPTS, SamplingConfig(n=2, max_tokens=8, seed=seed))
    moved = 0.0
    for i, c in enumerate(out):
        assert_matches_hf(model, PROMPTS[i // 2], c.completion_ids, c.logprobs)
        old = hf_logprobs(previous, PROMPTS[i // 2], c.completion_ids)
        moved = max(moved, max(abs(a - b) for a, b in zip(old, c.logprobs)))
    assert moved > 0.05, f"the push changed no log-prob by more than {moved:.2e}: the test would not see a stale head"


def test_colocate_push_loads_tied_lm_head_without_warning(tied_model_path):
    """In-process engine: two pushes, each silent about failed layers and each followed exactly by the sampler."""
    import vllm  # noqa: F401 - vLLM configures its loggers on import; attach after that
    from transformers import AutoModelForCausalLM

    reload_logger = logging.getLogger(RELOAD_LOGGER)
    previous = AutoModelForCausalLM.from_pretrained(tied_model_path, dtype=torch.float32).eval()
    backend = VLLMColocateBackend(tied_model_path, max_model_len=256)
    try:
        for version in (1, 2):
            model = trained_model(tied_model_path, version)
            records = Records()
            reload_logger.addHandler(records)
            try:
                backend.load_weights(iter_full_params(model), version)
            finally:
                reload_logger.removeHandler(records)
            assert not [m for m in records.messages if FAILED in m], records.messages
            check_follows(backend, model, previous, version)
            previous = model
    finally:
        backend.close()


@pytest.mark.slow
def test_server_push_loads_tied_lm_head_without_warning(tied_model_path):
    """`grpo-async serve` (engine in its own process, shared-memory transport): the server's log stays free of
    failed-layer warnings across a push, and its log-probs follow the pushed model."""
    from transformers import AutoModelForCausalLM

    previous = AutoModelForCausalLM.from_pretrained(tied_model_path, dtype=torch.float32).eval()
    with running_servers(tied_model_path, 1) as (server,):
        backend = VLLMServerBackend([server.url], api_key=API_KEY, timeout=120, transport="shm")
        try:
            with open(server.log_path, "rb") as f:
                start = f.seek(0, 2)
            model = trained_model(tied_model_path, 3)
            backend.load_weights(iter_full_params(model), 3)
            check_follows(backend, model, previous, 3)
            with open(server.log_path, errors="replace") as f:
                f.seek(start)
                during = f.read()
            assert "Successfully reset prefix cache" in during or "/ws/update" in during, "server log not captured"
            assert FAILED not in during, [line for line in during.splitlines() if FAILED in line]
        finally:
            backend.close()
