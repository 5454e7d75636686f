"""Multi-turn environments: token sequences and masks, the prefix check, tools, and training on every backend."""

import threading

import pytest
import torch
from datasets import Dataset
from recording import recorded_trainer
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_async import GRPOTrainer
from grpo_async.algo.logprobs import completion_logps
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.envs import (
    ChatTemplatePrefixError,
    Environment,
    ToolEnv,
    calculator,
    env_turn_ids,
    parse_tool_call,
    run_rollouts,
    template_ids,
)
from grpo_async.envs.tools import ToolCallError
from grpo_async.generation.base import SamplingConfig
from grpo_async.generation.hf import HFBackend
from grpo_async.testing import tiny_config
from grpo_async.trainer_setup import make_environment

USER = [{"role": "user", "content": "Say a"}]


class Echo(Environment):
    """Answers every assistant turn with `ok <n>`; turns are cut at 4 tokens so rollouts are multi-turn even for a
    random model that rarely samples EOS."""

    max_turns = 3
    max_tokens_per_turn = 4

    def initial_state(self, row):
        return {"replies": 0, "letter": row["letter"]}

    def env_response(self, messages, state):
        n = state["replies"] + 1
        return [{"role": "user", "content": f"ok {n}"}], {**state, "replies": n}


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------- pure token logic
def test_env_turn_ids_are_the_template_suffix(tok):
    conversation = USER + [{"role": "assistant", "content": "ab"}]
    sampled = _ids(tok, "ab<|end|>")  # the model stopped on EOS
    ids = env_turn_ids(tok, conversation, [{"role": "user", "content": "ok"}], sampled, turn=1)
    assert tok.decode(ids) == "<|user|>ok<|end|><|assistant|>"
    # the held sequence (prompt + sampled + env ids) is what the template renders for the whole conversation
    held = template_ids(tok, USER, True) + sampled + ids
    assert held == template_ids(tok, conversation + [{"role": "user", "content": "ok"}], True)


def test_env_turn_ids_add_the_end_of_turn_the_model_did_not_sample(tok):
    conversation = USER + [{"role": "assistant", "content": "ab"}]
    ids = env_turn_ids(tok, conversation, [{"role": "user", "content": "ok"}], _ids(tok, "ab"), turn=1)
    assert tok.decode(ids) == "<|end|><|user|>ok<|end|><|assistant|>"


def test_a_newline_the_template_puts_after_eos_is_added(tiny_model_path):
    """Qwen-style templates end a turn with EOS and a newline; the model stops at EOS, so the newline (a template
    token it never sampled) is added with the environment's tokens, and the held sequence is the full rendering."""
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    conversation = USER + [{"role": "assistant", "content": "ab"}]
    sampled = _ids(tok, "ab<|end|>")
    ids = env_turn_ids(tok, conversation, [{"role": "user", "content": "ok"}], sampled, turn=1)
    assert tok.decode(ids) == "\n<|user|>ok<|end|>\n<|assistant|>"
    held = template_ids(tok, USER, True) + sampled + ids
    assert held == template_ids(tok, conversation + [{"role": "user", "content": "ok"}], True)


def test_a_template_that_rewrites_earlier_turns_is_a_clear_error(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    # like templates that drop the reasoning of past assistant turns: an assistant message renders differently once
    # it is no longer the last one
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}<|assistant|>x<|end|>"
        "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    conversation = USER + [{"role": "assistant", "content": "ab"}]
    with pytest.raises(ChatTemplatePrefixError, match=r"turn 2: the chat template is not prefix-consistent") as e:
        env_turn_ids(tok, conversation, [{"role": "user", "content": "ok"}], _ids(tok, "ab<|end|>"), turn=2)
    position = len(template_ids(tok, USER, True))  # the first token of the assistant's content
    message = str(e.value)
    assert f"changes token {position} " in message and "<|assistant|>ab<|end|>' became" in message
    assert "<|assistant|>x<|end|>" in message


def test_tool_env_parses_runs_and_reports_errors():
    release = threading.Event()

    def hangs():
        release.wait(60)

    env = ToolEnv([calculator, hangs], max_turns=3, tool_timeout=0.2)
    assert parse_tool_call("no call") is None
    assert parse_tool_call('x <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>') == (
        "calculator",
        {"expression": "2+3"},
    )
    with pytest.raises(ToolCallError, match="not valid JSON"):
        parse_tool_call("<tool_call>{nope}</tool_call>")

    def respond(content):
        state = env.initial_state({})
        messages = USER + [{"role": "assistant", "content": content}]
        assert not env.is_completed(messages, state)
        new, state = env.env_response(messages, state)
        return new[0]["content"], state

    call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
    assert respond(call % ("calculator", '{"expression": "3 * (4 + 5) / 2"}')) == (
        "13.5",
        {"tool_calls": 1, "tool_errors": 0},
    )
    assert respond(call % ("search", "{}"))[0].startswith("error: unknown tool 'search'")
    assert respond(call % ("calculator", '{"expression": "__import__(1)"}'))[0].startswith(
        "error: calculator raised ValueError: unsupported expression element Call"
    )
    try:
        content, state = respond(call % ("hangs", "{}"))
        assert content == "error: hangs did not return within 0.2 s" and state["tool_errors"] == 1
    finally:
        release.set()
    assert env.is_completed(USER + [{"role": "assistant", "content": "the answer is 13.5"}], {})
    assert "calculator(expression: str)" in env.system_prompt()


def test_environment_protocol_is_checked():
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        Environment(max_turns=0)

    class NoResponse:
        max_turns = 2

    with pytest.raises(TypeError, match=r"lacks \['initial_state', 'is_completed', 'env_response'\]"):
        make_environment(NoResponse(), None)


# ------------------------------------------------------------------------------------------ rollouts (HF backend)
def _rollouts(tiny_model_path, tok, max_completion_length, prompts=2, G=2):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    convs = [[{"role": "user", "content": f"Say {c}"}] for c in "ab"[:prompts]]
    ids = [template_ids(tok, c, True) for c in convs]
    rows = [{"letter": c} for c in "ab"[:prompts] for _ in range(G)]
    results = run_rollouts(
        HFBackend(model, tok), tok, Echo(), convs, ids, rows, SamplingConfig(), G, max_completion_length
    )
    return model, ids, results


def _segments(mask):
    """Runs of equal mask values: [(value, start, end)]."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_rollouts_interleave_model_and_environment_tokens(tiny_model_path, tok):
    model, prompt_ids, results = _rollouts(tiny_model_path, tok, max_completion_length=64)
    for i, r in enumerate(results):
        assert len(r.completion_ids) == len(r.logprobs) == len(r.env_mask) <= 64
        assert r.state["letter"] == "ab"[i // 2]  # per-rollout state from its row
        model_turns = [s for s in _segments(r.env_mask) if s[0] == 1]
        env_turns = [s for s in _segments(r.env_mask) if s[0] == 0]
        assert len(model_turns) == r.turns and len(env_turns) == r.turns - 1 == r.state["replies"]
        for k, (_, a, b) in enumerate(env_turns):
            text = tok.decode(r.completion_ids[a:b])
            assert text.endswith(f"<|user|>ok {k + 1}<|end|><|assistant|>")
            assert all(lp == 0.0 for lp in r.logprobs[a:b])
        for _, a, b in model_turns:
            assert b - a <= Echo.max_tokens_per_turn and all(lp < 0 for lp in r.logprobs[a:b])
        # the messages: assistant and environment turns alternate, the env's as it wrote them
        assert [m["role"] for m in r.messages] == ["assistant", "user"] * (r.turns - 1) + ["assistant"]
        if r.turns == Echo.max_turns:
            assert r.finish_reason == "max_turns"
    assert any(r.turns == 3 for r in results)
    # the sampler conditioned on exactly the sequence the trainer sees: its logprobs of the model's tokens equal the
    # model's log-softmax over prompt + completion (environment tokens included)
    for i, r in enumerate(results):
        seq = torch.tensor([prompt_ids[i // 2] + r.completion_ids])
        logps = completion_logps(model, seq, torch.ones_like(seq), len(r.completion_ids), 1.0)[0]
        model_tokens = torch.tensor(r.env_mask).bool()
        assert torch.allclose(logps[model_tokens], torch.tensor(r.logprobs)[model_tokens], atol=1e-4)


def test_rollouts_stop_at_max_completion_length(tiny_model_path, tok):
    _, _, results = _rollouts(tiny_model_path, tok, max_completion_length=9)
    for r in results:  # 4 sampled + 1..5 template tokens: the env turn is cut at 9 (or the model turn, on EOS)
        assert len(r.completion_ids) <= 9
        if r.finish_reason == "length":
            assert len(r.completion_ids) == 9
    assert any(r.finish_reason == "length" for r in results)


# --------------------------------------------------------------------------------------------------- training
def _args(tmp_path, **kw):
    overrides = {"gradient_accumulation_steps": 1, "max_completion_length": 40, "max_steps": 2, "num_batches_ahead": 0}
    return tiny_config(tmp_path / "out", **{**overrides, **kw})


def _train_multi_turn(tiny_model_path, args, **kw):
    seen_completions = []

    def first_char(prompts, completions, completion_ids, letter, **kw):
        """Varies over random completions (so every group has a non-zero advantage): the code of the first
        character of the first assistant turn; records what it was given."""
        seen_completions.extend(completions)
        assert all(c[0]["role"] == "assistant" for c in completions)
        # each rollout's final environment state, from its own row
        assert [s["letter"] for s in kw["env_state"]] == letter
        assert all(s["replies"] == sum(m["role"] == "user" for m in c) for s, c in zip(kw["env_state"], completions))
        return [ord(c[0]["content"][:1] or " ") / 128 for c in completions]

    t, batches = recorded_trainer(
        model=tiny_model_path,
        reward_funcs=[letter_reward, first_char],
        args=args,
        train_dataset=make_dataset(64),
        environment=Echo(),
        **kw,
    )
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    assert {n for n, p in t.model.named_parameters() if not torch.equal(before[n], p.detach())} == set(before)
    # reward functions got the conversation: assistant turns and the environment's replies
    assert any(len(c) >= 3 and c[1] == {"role": "user", "content": "ok 1"} for c in seen_completions)
    env_turns = 0
    for b in batches:
        trained, exists = b["loss_mask"].bool(), b["completion_mask"].bool()
        assert not (trained & ~exists).any()
        for row, ids in enumerate(b["completion_ids"].tolist()):
            # every run of attended-but-untrained tokens is one of Echo's turns, as the template renders it (the end
            # of the assistant's turn when the model did not sample it, the reply, the next generation prompt)
            last = int(exists[row].nonzero().max())  # the row's last token
            runs, start = [], None  # (start, end) of each run
            for j in range(len(ids) + 1):
                env = j < len(ids) and bool(exists[row, j]) and not bool(trained[row, j])
                if env and start is None:
                    start = j
                elif not env and start is not None:
                    runs.append((start, j))
                    start = None
            turns = [f"{end}<|user|>ok {n}<|end|><|assistant|>" for n in range(1, 4) for end in ("", "<|end|>")]
            for i, j in runs:
                text = t.processing_class.decode(ids[i:j])
                cut = j == last + 1  # a turn reaching the end of the row may be cut by max_completion_length
                assert text in turns or (cut and any(turn.startswith(text) for turn in turns)), text
            env_turns += len(runs)
    assert env_turns > 0
    return t, batches


def test_multi_turn_training_on_hf(tiny_model_path, tmp_path):
    t, batches = _train_multi_turn(tiny_model_path, _args(tmp_path))
    logged = t.state.log_history[0]
    assert 1 < logged["env/turns/mean"] <= logged["env/turns/max"] == Echo.max_turns
    assert 0 < logged["env/env_tokens_frac"] < 1 and 0 < logged["env/max_turns_ratio"] <= 1
    # evaluation runs the same multi-turn rollouts
    seen = []

    def eval_reward(prompts, completions, **kw):
        seen.extend(completions)
        return [1.0] * len(completions)

    t.reward_funcs, t.reward_func_names = [eval_reward], ["eval_reward"]
    t.reward_weights = torch.ones(1)
    metrics = t.evaluate(make_dataset(4))
    assert metrics["eval_reward"] == 1.0 and len(seen) == 4 * t.num_generations
    assert any(m["role"] == "user" and m["content"] == "ok 1" for c in seen for m in c)
    # first round, on-policy: the sampler's logprobs of the model's own tokens equal the trainer's
    b = batches[0]
    init = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    am = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
    with torch.no_grad():
        ref = completion_logps(init, ids, am, b["completion_ids"].size(1), 1.0)
    mask = b["loss_mask"].bool()
    assert mask.any() and (ref - b["rollout_logps"])[mask].abs().max() < 1e-4


def test_mask_env_responses_false_trains_environment_tokens(tiny_model_path, tmp_path):
    t, batches = recorded_trainer(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=_args(tmp_path, mask_env_responses=False, max_steps=1),
        train_dataset=make_dataset(64),
        environment=Echo(),
    )
    t.train()
    assert all(torch.equal(b["loss_mask"], b["completion_mask"]) for b in batches)


def test_environment_arguments_are_checked(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="needs conversational prompts"):
        GRPOTrainer(
            tiny_model_path,
            letter_reward,
            args=_args(tmp_path),
            train_dataset=make_dataset(64, conversational=False),
            environment=Echo(),
        )
    with pytest.raises(ValueError, match="either environment= or tools="):
        GRPOTrainer(
            tiny_model_path,
            letter_reward,
            args=_args(tmp_path),
            train_dataset=make_dataset(64),
            environment=Echo(),
            tools=[calculator],
        )
    t = GRPOTrainer(
        tiny_model_path, letter_reward, args=_args(tmp_path), train_dataset=make_dataset(64), tools=[calculator]
    )
    assert isinstance(t.environment, ToolEnv) and list(t.environment.tools) == ["calculator"]


def test_tool_env_training_runs(tiny_model_path, tmp_path):
    """A random model never writes a valid tool call: one turn per rollout, trained like single-turn."""
    ds = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{i}+{i}"}] for i in range(16)],
            "answer": [str(2 * i) for i in range(16)],
        }
    )
    from grpo_async.rewards import math_reward

    t, batches = recorded_trainer(
        tiny_model_path, math_reward, args=_args(tmp_path, max_steps=1), train_dataset=ds, tools=[calculator]
    )
    t.train()
    assert all(torch.equal(b["loss_mask"], b["completion_mask"]) for b in batches)


# ------------------------------------------------------------------------------------------------------ vLLM
@pytest.mark.vllm
@pytest.mark.slow  # ~35 s: the in-process engine starts
@pytest.mark.parametrize("async_mode", ["rounds", "stream"])
def test_multi_turn_training_on_vllm_in_process(tiny_model_path, tmp_path, async_mode):
    """Stream mode: each prompt group's G rollouts run (model and environment turns) on the engine loop while other
    groups generate; the same checks of turns, masks and the env's state hold."""
    args = _args(tmp_path, generation_backend="vllm", num_batches_ahead=1, async_mode=async_mode)
    t, _ = _train_multi_turn(tiny_model_path, args)
    try:
        assert type(t.backend).__name__ == "VLLMColocateBackend"
        assert t.state.log_history[0]["sampling/logp_diff/max"] < 1e-3
        # the rounds came through the group stream (its metrics), or the round queue (none of them)
        assert ("async/group_latency/p50" in t.state.log_history[0]) == (async_mode == "stream")
    finally:
        t.close()


@pytest.mark.vllm
@pytest.mark.slow  # the session's server, used by the vllm_server and openai backends in turn
def test_multi_turn_training_against_a_server_and_openai(tiny_model_path, tiny_server, tmp_path):
    from vllm_utils import API_KEY

    url = tiny_server.url  # the session's server (tests/conftest.py): the first run publishes its version 0 first
    t, _ = _train_multi_turn(
        tiny_model_path,
        _args(tmp_path, generation_backend="vllm_server", vllm_server_urls=[url], vllm_api_key=API_KEY),
    )
    assert t.state.log_history[0]["sampling/logp_diff/max"] < 1e-3
    t.close()
    # the OpenAI-compatible backend with the default config: generation only (the sampler never receives
    # weights, so nothing is pushed and no sample is dropped as stale), multi-turn rounds still train
    t, _ = _train_multi_turn(
        tiny_model_path,
        _args(tmp_path, generation_backend="openai", openai_base_url=url + "/v1", vllm_api_key=API_KEY),
    )
    logs = [h for h in t.state.log_history if "reward" in h]
    assert len(logs) == t.state.global_step >= 2
    assert all(h["async/dropped_stale"] == 0 for h in logs)
    assert all(h["env/turns/mean"] >= 1 for h in logs)
    assert "timing/weight_sync" not in str(t.state.log_history)  # nothing was pushed
    assert t.backend.version is None and t.publisher.published is None
    t.close()
