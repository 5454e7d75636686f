"""`HFBackend`'s shared prompt prefill: a call's n rows per prompt share one prefill of their prompt (its KV cache
computed once and repeated, `HFBackend._prompt_cache`), and give the completions and log-probabilities the full
per-row prefill gives. The model is the tiny random Llama (`tiny_model_path`), its forward calls observed by a hook."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_async.generation.base import SamplingConfig
from grpo_async.generation.hf import HFBackend


def _prompts(tok) -> list[list[int]]:
    """Two prompts of different lengths: the shorter one is left-padded in the call."""
    return [tok("Say A")["input_ids"], tok("Say hello there, then B, then C")["input_ids"]]


def _forward_inputs(backend: HFBackend) -> list[tuple[int, int]]:
    """`(rows, tokens)` of every forward call of the backend's copy, appended as they happen."""
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        calls.append(tuple(ids.shape))

    backend.model.register_forward_pre_hook(hook, with_kwargs=True)
    return calls


def _unshared(backend: HFBackend) -> HFBackend:
    """The same backend with every row prefilling its prompt itself (what `generate` does without the cache)."""
    backend._shares_prompt_prefill = lambda *a: False
    return backend


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(n=4, max_tokens=8, seed=11),  # seeded sampling (the trainer's)
        SamplingConfig(n=3, max_tokens=8, temperature=0.0),  # greedy
        SamplingConfig(n=4, max_tokens=8, seed=3, top_k=5, top_p=0.9),  # filters: the kept sets too
    ],
    ids=["seeded", "greedy", "top-k-top-p"],
)
@torch.no_grad()
def test_shared_prefill_gives_the_completions_of_the_full_prefill(tiny, sampling):
    model, tok = tiny
    shared = HFBackend(model, tok)
    calls = _forward_inputs(shared)
    got = shared.generate(_prompts(tok), sampling)
    want = _unshared(HFBackend(model, tok)).generate(_prompts(tok), sampling)
    P = max(len(p) for p in _prompts(tok))
    rows = 2 * sampling.n
    # the prompts' prefill ran once per prompt (2 rows, all but the last token), then only 1 token per row at a time
    assert calls[0] == (2, P - 1), calls[:3]
    assert all(c == (rows, 1) for c in calls[1:]), calls
    assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert [c.sampling_mask for c in got] == [c.sampling_mask for c in want]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_every_row_prefills_where_the_prefill_cannot_be_shared(tiny):
    """One sample per prompt, beam search (beams are reordered), or a one-token prompt: `generate`'s own prefill."""
    model, tok = tiny
    backend = HFBackend(model, tok)
    calls = _forward_inputs(backend)
    prompts = _prompts(tok)
    P = max(len(p) for p in prompts)
    backend.generate(prompts, SamplingConfig(n=1, max_tokens=3, seed=0))
    assert calls[0] == (2, P)
    calls.clear()
    backend.generate(prompts, SamplingConfig(n=2, max_tokens=3, extra={"num_beams": 2, "do_sample": False}))
    assert calls[0] == (8, P)  # 2 prompts × 2 rows × 2 beams, every prompt token
    calls.clear()
    backend.generate([prompts[0][:1]], SamplingConfig(n=3, max_tokens=3, seed=0))
    assert calls[0] == (3, 1)


@torch.no_grad()
def test_a_cache_of_other_than_key_value_layers_is_not_shared(tiny):
    """A model whose `DynamicCache(config)` holds linear-attention (recurrent state) layers cannot have its prompt's
    cache repeated row by row: `_prompt_cache` gives None (`generate` prefills every row), and a key/value cache
    otherwise. The tiny Llama's config is given `layer_types` for the first call only."""
    model, tok = tiny
    backend = HFBackend(model, tok)
    ids, mask = torch.tensor([_prompts(tok)[0]]), torch.ones(1, len(_prompts(tok)[0]), dtype=torch.long)
    config = backend.model.config  # the backend's private copy's
    before = getattr(config, "layer_types", None)
    config.layer_types = ["linear_attention"] * config.num_hidden_layers
    try:
        assert backend._prompt_cache(ids, mask, 3, "cpu") is None
    finally:
        config.layer_types = before
    cache = backend._prompt_cache(ids, mask, 3, "cpu")
    assert cache.get_seq_length() == ids.shape[1] - 1 and cache.layers[0].keys.shape[0] == 3
