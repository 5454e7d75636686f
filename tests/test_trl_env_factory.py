"""TRL 1.16's constructor arguments ported: the positional order, optional `reward_funcs`, `quantization_config`,
`rollout_func` (the user generates) and `environment_factory` (one environment instance per rollout, its methods as
tools, `get_reward` as a reward source), on the real path: the trainer, its generator thread and a real backend."""

from __future__ import annotations

import inspect

import pytest
import torch
from datasets import Dataset
from support.recorders import recorded

from grpo_async import GRPOTrainer
from grpo_async.algo.logprobs import completion_logps
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.envs import FactoryEnvironment, template_ids
from grpo_async.envs.rollout import run_rollout_func
from grpo_async.generation import register_backend, unregister_backend
from grpo_async.generation.base import Completion, SamplingConfig
from grpo_async.generation.hf import HFBackend
from grpo_async.testing import tiny_config


def _rows(batches, key):
    return [row for b in batches for row in b[key]]


# ---- the constructor ------------------------------------------------------------------------------------------------
def test_constructor_takes_trls_arguments_in_trls_order(tiny_model_path, tmp_path):
    import trl

    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    theirs = list(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    assert ours[: len(theirs)] == theirs and ours[len(theirs) :] == ["environment"]
    args = tiny_config(tmp_path, max_steps=1)
    ds = make_dataset(8)
    # model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks,
    # optimizers, quantization_config, peft_config, tools, rollout_func, environment_factory
    t = GRPOTrainer(tiny_model_path, [letter_reward], args, ds, ds, None, None, None, (None, None), None, None, None)
    assert t.reward_func_names == ["letter_reward"] and t.environment is None and t.eval_dataset is ds


def test_without_a_reward_source_trls_error(tiny_model_path, tmp_path):
    with pytest.raises(
        ValueError, match=r"No reward source provided\. Pass `reward_funcs`, or an `environment_factory`"
    ):
        GRPOTrainer(tiny_model_path, args=tiny_config(tmp_path), train_dataset=make_dataset(8))

    class NoReward:  # an environment that does not own the reward is not a reward source either
        def reset(self, **row):
            return None

    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(tiny_model_path, None, tiny_config(tmp_path), make_dataset(8), environment_factory=NoReward)


def test_quantization_config_as_trl(tiny_model_path, tmp_path, monkeypatch):
    import grpo_async.loading

    seen = {}
    real = grpo_async.loading.load_model

    def load_model(name, **kwargs):
        seen.update(kwargs)
        return real(name, **{k: v for k, v in kwargs.items() if k != "quantization_config"})

    monkeypatch.setattr(grpo_async.loading, "load_model", load_model)
    marker = object()
    GRPOTrainer(tiny_model_path, letter_reward, tiny_config(tmp_path), make_dataset(8), quantization_config=marker)
    assert seen["quantization_config"] is marker  # a name is loaded with it
    with pytest.raises(ValueError, match="both as a trainer argument and in `args.model_init_kwargs`"):
        args = tiny_config(tmp_path, model_init_kwargs={"quantization_config": marker})
        GRPOTrainer(tiny_model_path, letter_reward, args, make_dataset(8), quantization_config=marker)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with pytest.warns(UserWarning, match="already instantiated. The `quantization_config` will be ignored"):
        GRPOTrainer(model, letter_reward, tiny_config(tmp_path), make_dataset(8), quantization_config=marker)


# ---- rollout_func ---------------------------------------------------------------------------------------------------
def test_rollout_func_generates_trains_and_forwards_its_fields(tiny_model_path, tmp_path):
    """TRL's contract: `rollout_func(prompts, trainer)` gets the rows' prompts (G adjacent copies of each, as TRL
    passes a process's rows) and returns one completion per prompt; here it samples with the trainer's own backend
    (which keeps receiving the weights), then appends 2 tokens of its own, masked by `env_mask`. Its prompt ids,
    completion ids and log-probs are what is trained; its extra field reaches the reward function."""
    calls, seen = [], {}

    def rollout_func(prompts, trainer):
        calls.append((list(prompts), trainer, trainer.backend.version))
        tok = trainer.processing_class
        prompt_ids = [tok(p[-1]["content"] + ":")["input_ids"] for p in prompts]  # its own tokenization
        out = trainer.backend.generate(prompt_ids, SamplingConfig(n=1, max_tokens=4))
        extra_ids = tok("!!", add_special_tokens=False)["input_ids"]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [c.completion_ids + extra_ids for c in out],
            "logprobs": [c.logprobs + [0.0, 0.0] for c in out],
            "env_mask": [[1] * len(c.completion_ids) + [0, 0] for c in out],
            "source": [f"rollout {i}" for i in range(len(prompts))],
        }

    def reward(completions, source, letter, **kwargs):
        seen.setdefault("source", []).append(list(source))
        return letter_reward(None, completions, None, letter)

    args = tiny_config(tmp_path, max_steps=2, num_batches_ahead=0, per_device_train_batch_size=4)  # rounds of 8
    t, trained = recorded(tiny_model_path, reward, args, make_dataset(16), rollout_func=rollout_func)
    t.train()
    t.close()
    tok = t.processing_class
    assert len(calls) == 2
    for prompts, trainer, _ in calls:
        assert trainer is t and len(prompts) == 8  # one round: 2 prompts × G = 4, the copies adjacent
        assert all(prompts[i] == prompts[i - i % 4] for i in range(8))
    assert [v for *_, v in calls] == [0, 1]  # the backend received the weights of step 1 before round 2
    assert seen["source"][0] == [f"rollout {i}" for i in range(8)]
    batches = trained.records
    columns = ("prompt_ids", "completion_ids", "completion_mask", "loss_mask", "rollout_logps")
    for p, ids, attend, train, sampler in zip(*(_rows(batches, k) for k in columns), strict=True):
        prompt = tok.decode(p[p != tok.pad_token_id])
        assert prompt.startswith("Say ") and prompt.endswith(":")  # the rollout's prompt ids, not the chat template
        n = int(attend.sum())
        assert tok.decode(ids[n - 2 : n]) == "!!" and train[n - 2 : n].tolist() == [0, 0]  # env_mask: not trained
        assert train[: n - 2].all() and (sampler[: n - 2] < 0).all()  # the sampler's log-probs, kept


def test_rollout_func_output_is_checked():
    prompts = ["a", "a"]
    ok = {"prompt_ids": [[1], [1]], "completion_ids": [[2, 3], [2]], "logprobs": [[-1.0, -1.0], [-1.0]]}
    completions = run_rollout_func(lambda p: {**ok, "tag": "x"}, prompts, stop_ids={3})
    assert [c.finish_reason for c in completions] == ["stop", "length"]  # TRL: not ending with EOS = truncated
    assert [c.extra["columns"] for c in completions] == [{"tag": "x"}, {"tag": "x"}]  # a non-list: every row
    with pytest.raises(ValueError, match=r"rollout_func must return keys \['logprobs'\] in its output dict\."):
        run_rollout_func(lambda p: {k: v for k, v in ok.items() if k != "logprobs"}, prompts, set())
    with pytest.raises(ValueError, match="returned 1 values for 'completion_ids' but was given 2 prompts"):
        run_rollout_func(lambda p: {**ok, "completion_ids": [[2]]}, prompts, set())
    with pytest.raises(ValueError, match=r"logprobs\[0\] has 1 values for 2 completion_ids\[0\]"):
        run_rollout_func(lambda p: {**ok, "logprobs": [[-1.0], [-1.0]]}, prompts, set())
    with pytest.raises(ValueError, match=r"env_mask\[1\] has 2 values for 1 completion_ids\[1\]"):
        run_rollout_func(lambda p: {**ok, "env_mask": [[1, 0], [1, 1]]}, prompts, set())
    with pytest.raises(ValueError, match=r"logprobs\[1\]\[0\] is None"):
        run_rollout_func(lambda p: {**ok, "logprobs": [[-1.0, -1.0], [None]]}, prompts, set())


def test_rollout_func_is_not_combined_with_an_environment(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="rollout_func generates the completions itself"):
        GRPOTrainer(
            tiny_model_path, letter_reward, tiny_config(tmp_path), make_dataset(8), tools=[len], rollout_func=print
        )


# ---- environment_factory on the tiny model: reset observations, the pool, get_reward, environments= -----------------
class Greeter:
    """No tools: `reset` answers with an observation of its own, `get_reward` reads the completion count."""

    created = 0

    def __init__(self):
        type(self).created += 1
        self.serial = type(self).created
        self.resets = 0

    def reset(self, letter, **row):
        self.resets += 1
        self.letter = letter
        return f" ({self.serial})"  # each instance's own: the rollouts of one prompt get different prompts

    def get_reward(self) -> float:
        return float(self.serial)


def test_environment_factory_without_tools_on_the_tiny_model(tiny_model_path, tmp_path):
    Greeter.created = 0
    seen = []

    def probe(prompts, environments, env_state, letter, **kwargs):
        seen.append((prompts, environments, [s["observation"] for s in env_state], [e.letter for e in environments]))
        assert letter == seen[-1][-1]  # each instance was reset with its own rollout's row
        return [0.0] * len(prompts)

    args = tiny_config(tmp_path, max_steps=2, num_batches_ahead=0, per_device_train_batch_size=4, reward_weights=[0.5])
    t, trained = recorded(tiny_model_path, probe, args, make_dataset(16), environment_factory=Greeter)
    assert t.reward_func_names == ["probe", "Greeter"] and t.reward_weights.tolist() == [0.5, 1.0]
    t.train()
    t.close()
    assert Greeter.created == 8  # construct once (one per rollout of a round, the probe among them), reset often
    assert len(seen) == 2
    instances = {id(e) for _, envs, *_ in seen for e in envs}
    assert len(instances) == 8 and all(e.resets == 2 for e in seen[0][1])  # the same 8 in both rounds
    tok = t.processing_class
    for prompts, envs, observations, letters in seen:
        for p, e, obs, c in zip(prompts, envs, observations, letters, strict=True):
            assert obs == f" ({e.serial})" and p[-1]["content"] == f"Say {c}{obs}"  # TRL: appended
    # each rollout trained on its own prompt, the reward of its own instance
    prompts = [tok.decode(p[p != tok.pad_token_id]) for p in _rows(trained.records, "prompt_ids")]
    assert len(set(prompts)) > 4 and all(p.endswith(")<|end|><|assistant|>") for p in prompts)
    assert t.state.log_history[0]["rewards/Greeter/mean"] == pytest.approx(4.5)  # serials 1..8


def test_environment_factory_dataset_and_routing_errors_as_trl(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="`max_steps` must be set to a positive value"):
        GRPOTrainer(tiny_model_path, args=tiny_config(tmp_path, max_steps=-1), environment_factory=Greeter)
    with pytest.raises(ValueError, match="A `dict` `environment_factory` .* requires a `train_dataset`"):
        GRPOTrainer(tiny_model_path, args=tiny_config(tmp_path), environment_factory={"g": Greeter})
    ds = make_dataset(8).add_column("environment", ["g", "h"] * 4)
    with pytest.raises(ValueError, match=r"`environment='h'`, which is not among .* Expected one of: \['g'\]"):
        GRPOTrainer(tiny_model_path, args=tiny_config(tmp_path), train_dataset=ds, environment_factory={"g": Greeter})

    class NoReset:
        def get_reward(self):
            return 1.0

    with pytest.raises(ValueError, match="must define a callable `reset`"):
        GRPOTrainer(tiny_model_path, None, tiny_config(tmp_path), make_dataset(8), environment_factory=NoReset)


class Owner:
    """Owns the data: `reset` writes the prompt (TRL: no train_dataset needed, `max_steps` sets the length)."""

    def reset(self, **row):
        assert "environment" not in row  # a routing column is not passed on, as in TRL
        self.row = row
        return "Say a"

    def get_reward(self) -> float:
        return 2.0


def test_environment_factory_without_a_train_dataset(tiny_model_path, tmp_path):
    seen = []

    def prompts_seen(prompts, **kwargs):
        seen.extend(prompts)
        return [0.0] * len(prompts)

    args = tiny_config(tmp_path, max_steps=1, per_device_train_batch_size=4)
    t = GRPOTrainer(tiny_model_path, prompts_seen, args, environment_factory=Owner)
    assert len(t.train_dataset) == 2  # TRL's placeholder: one round of empty user prompts
    t.train()
    t.close()
    assert seen == [[{"role": "user", "content": "Say a"}]] * 8
    assert t.state.log_history[0]["rewards/Owner/mean"] == 2.0


def test_a_dict_of_factories_routes_each_row_by_its_environment_column(tiny_model_path, tmp_path):
    seen = []

    def kinds(environments, environment, **kwargs):
        seen.append([(type(e).__name__, name) for e, name in zip(environments, environment, strict=True)])
        return [0.0] * len(environments)

    ds = make_dataset(8).add_column("environment", ["greet", "own"] * 4)
    args = tiny_config(tmp_path, max_steps=1, per_device_train_batch_size=4, shuffle_dataset=False)
    t = GRPOTrainer(tiny_model_path, kinds, args, ds, environment_factory={"greet": Greeter, "own": Owner})
    assert t.reward_func_names == ["kinds", "Greeter", "Owner"]
    t.train()
    t.close()
    assert [k for k, _ in seen[0]] == ["Greeter"] * 4 + ["Owner"] * 4
    assert all(k == {"greet": "Greeter", "own": "Owner"}[name] for k, name in seen[0])
    log = t.state.log_history[0]  # each environment's reward scores its own rollouts only (None elsewhere)
    assert log["rewards/Owner/mean"] == 2.0 and log["rewards/Greeter/mean"] >= 1.0


# ---- environment_factory on SmolLM2: a real tool call, its reward from get_reward -----------------------------------
class Counter:
    def reset(self, **row) -> str:
        self.count = 0
        return " The counter starts at 0."

    def increment(self, step: int) -> str:
        """Add `step` to the counter and return its new value.

        Args:
            step: how much to add.
        """
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count == 3)


CALL = '<tool_call>{"name": "increment", "arguments": {"step": 3}}</tool_call>'


class ScriptedCaller:
    """A sampler whose first assistant turn is `CALL` (a 135M model does not write one on demand; the scripted tokens
    carry the model's own log-probs of them); after the tool answered, the model itself finishes the rollout."""

    def __init__(self, model, tokenizer):
        self.hf, self.tok, self.version = HFBackend(model, tokenizer), tokenizer, 0
        self.call_ids = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.first_prompts = []

    def generate(self, prompt_ids, sampling):
        out = []
        for p in prompt_ids:
            if "<|im_start|>tool" in self.tok.decode(p):
                out.extend(self.hf.generate([p], sampling))
                continue
            self.first_prompts.append(self.tok.decode(p))
            full = torch.tensor([p + self.call_ids])
            logps = completion_logps(self.hf.model, full, torch.ones_like(full), len(self.call_ids), 1.0)
            out.extend(Completion(list(self.call_ids), logps[0].tolist(), "stop") for _ in range(sampling.n))
        return out

    def load_weights(self, groups, version):
        self.hf.load_weights(groups, version)
        self.version = version

    def close(self):
        self.hf.close()


@pytest.mark.slow
def test_environment_factory_runs_a_real_tool_call_on_smollm2(smollm2_2_layers, tmp_path):
    """SmolLM2's tokenizer and chat template (its first 2 layers: the subject is the environment's tools, turns,
    masks and reward, not the model's numerics)."""
    samplers = []

    def factory(args, model, tokenizer, model_path):
        samplers.append(ScriptedCaller(model, tokenizer))
        return samplers[-1]

    register_backend("scripted_counter", factory)
    try:
        ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count to 3."}]] * 2})
        args = tiny_config(
            tmp_path / "out",
            generation_backend="scripted_counter",
            per_device_train_batch_size=2,  # one prompt, G = 2 rollouts
            num_generations=2,
            gradient_accumulation_steps=1,
            num_batches_ahead=0,
            max_completion_length=48,
            max_steps=1,
            learning_rate=1e-6,
            temperature=1.0,
        )
        t, trained = recorded(
            smollm2_2_layers, None, args, train_dataset=ds, environment_factory=Counter
        )  # reward_funcs=None
        assert t.reward_func_names == ["Counter"] and not t.environment.template_tools  # SmolLM2 ignores tools=
        t.train()
        t.close()
    finally:
        unregister_backend("scripted_counter")
    tok = t.processing_class
    first = samplers[0].first_prompts
    assert len(first) == 1  # the prompt once (n = G): its rollouts' prompts are identical
    for prompt in first:  # the tools in the system message (SmolLM2's template ignores tools=), the observation
        assert "<|im_start|>system\nYou can call these tools:\n- increment(step: int) -> str: Add `step`" in prompt
        assert "<|im_start|>user\nCount to 3. The counter starts at 0.<|im_end|>" in prompt
    assert t.state.log_history[0]["rewards/Counter/mean"] == 1.0  # get_reward: the tool really ran, count == 3
    assert t.state.log_history[0]["reward"] == 1.0
    columns = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "loss_mask")
    for p, p_mask, ids, attend, train in zip(*(_rows(trained.records, k) for k in columns), strict=True):
        assert tok.decode(p[p_mask == 1]) == first[0]  # trained on the prompt it was generated from
        env_tokens = ids[(attend == 1) & (train == 0)]
        assert "<|im_start|>tool\n3<|im_end|>" in tok.decode(env_tokens)  # the tool's answer: attended, not trained
        assert tok.decode(ids[train == 1]).startswith(CALL + "<|im_end|>")


def test_a_chat_template_that_renders_tools_gets_them_as_tools(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t['function']['name'] }}: "
        "{{ t['function']['description'] }}{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def double(x: int) -> int:
        """Double a number.

        Args:
            x: the number.
        """
        return 2 * x

    env = FactoryEnvironment(Counter, tools=[double], tokenizer=tok)
    assert env.template_tools
    state = env.initial_state({"prompt": [{"role": "user", "content": "Go."}]})
    messages = env.prompt_messages([{"role": "user", "content": "Go."}], state)
    assert messages == [{"role": "user", "content": "Go. The counter starts at 0."}]  # no tools text of ours
    text = tok.decode(template_ids(tok, messages, True, **env.chat_template_kwargs(state)))
    assert text.startswith(  # a standalone tool first, then the environment's methods, as TRL lists them
        "<|im_start|>system\nTools: double: Double a number.increment: Add `step` to the counter and return its new"
    )
    # the tools run on the rollout's own instance; every call of the turn runs, errors as TRL words them
    nope, twice = CALL.replace("increment", "nope"), '<tool_call>{"name": "double", "arguments": {"x": 4}}</tool_call>'
    reply, state = env.env_response([{"role": "assistant", "content": CALL + nope + twice}], state)
    assert reply == [
        {"role": "tool", "name": "increment", "content": "3"},
        {"role": "tool", "name": "nope", "content": "{'error': 'Tool nope not found.'}"},
        {"role": "tool", "name": "double", "content": "8"},
    ]
    assert state["environment"].count == 3 and state["tool_calls"] == 3 and state["tool_errors"] == 1
    env.release([state])
    assert env.initial_state({})["environment"] is not None
