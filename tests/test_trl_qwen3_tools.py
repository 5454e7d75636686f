"""TRL's `TestGRPOTrainer` tool and environment tests, ported: the tests that script the model's completions as
hard-coded Qwen3 token ids (`<tool_call>` 151657, `<|im_end|>` 151645, `multiply` 64648, ...) and check TRL's
`tools/call_frequency` / `tools/failure_frequency`, run on our `GRPOTrainer` with the same assertions.

What stands in for the Hub (`tests/support/qwen3.py`, built offline): `trl-internal-testing/tiny-Qwen3MoeForCausalLM`
is a tiny random `Qwen3MoeForCausalLM` with Qwen3's vocabulary, whose tokenizer decodes every id these tests use to
the text TRL's comments give (and encodes that text back to those ids) and has Qwen3's own chat template;
`tiny-Qwen2ForSequenceClassification-2.5` a tiny random reward model; `trl-internal-testing/zen` the Zen of Python
as conversational prompts (two of them, so a run is 6 steps: TRL's default 3 epochs of one prompt per step).

How the scripted completions reach our generation: as in TRL, with `patch.object(trainer.model, "generate", ...)`.
Our hf backend generates on its own copy of the policy (`copy.deepcopy(trainer.model)`), which it makes when
training starts, inside the patch: the copy carries the patched `generate`, so every turn the fake returns goes
through our tool loop (`grpo_async.envs`), masks, rewards and metrics, as TRL's own loop takes it. The fake is
TRL's: it answers a call of 3 rows (the first turn of the round's 3 rollouts) with 3 scripted completions, and any
other call (the turn after the tool results, one row per rollout that called a tool) with `Done!` per row.

TRL 1.16's `tests/test_grpo_trainer.py` is not installed and the one stored in the reference index predates
`environment_factory`: `test_training_with_tools` follows TRL's text; the environment and malformed-call tests are
written from TRL 1.16's trainer code (`trl/trainer/grpo_trainer.py`: `_tool_call_loop`, the environment pool,
`get_reward`, the dataset-less placeholder; `trl/chat_template_utils.py`: `parse_response`) with the same scripted
completions and TRL's metrics. `GRPO_ASYNC_TRL_PARITY=1 pytest tests/test_trl_qwen3_tools.py` runs this file on
TRL's own `GRPOTrainer` instead (`use_cpu`, no bf16; ~10 minutes on a loaded 2-core machine): every assertion
holds there too (checked with TRL 1.16).
"""

from __future__ import annotations

import os
from unittest.mock import patch

import pytest
import torch
from datasets import Dataset
from support.qwen3 import build_qwen3_standin, zen_prompts

PARITY = os.environ.get("GRPO_ASYNC_TRL_PARITY") == "1"  # run on TRL's GRPOTrainer (see the module docstring)
if PARITY:
    from trl import GRPOConfig, GRPOTrainer
else:
    from grpo_async import GRPOConfig, GRPOTrainer

PAD = 151643  # <|endoftext|>
# '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
CALL_3_4 = [151657, 198, 4913, 606, 788, 330, 64648, 497, 330, 16370, 788, 5212, 64, 788, 220, 18, 11, 330, 65, 788]
CALL_3_4 += [220, 19, 11248, 151658, 151645]
# '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "c": 4}}\n</tool_call><|im_end|>' (no parameter "c")
CALL_WRONG_ARG = CALL_3_4[:18] + [66] + CALL_3_4[19:]
# "I don't know any tool<|im_end|>", then padding, as a batch of generate returns it
NO_CALL = [40, 1513, 944, 1414, 894, 5392, 151645] + [PAD] * 18
# 'Done!<|im_end|>'
DONE = [17453, 0, 151645]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    return build_qwen3_standin(tmp_path_factory.mktemp("qwen3") / "standin")


def _args(tmp_path, **overrides) -> GRPOConfig:
    """TRL's arguments in these tests (TRL on a CPU also needs `use_cpu` and no bf16)."""
    cpu = {"use_cpu": True, "bf16": False} if PARITY else {}
    return GRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=0.1,
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=128,
        report_to="none",
        **cpu,
        **overrides,
    )


class ScriptedGenerate:
    """TRL's `fake_generate`: a call of `len(first_turn)` rows gets `first_turn` (padded to one width), any other
    call `Done!` per row. Keeps the text of every call's inputs (`prompts`) and the calls' row counts (`rows`)."""

    def __init__(self, tokenizer, first_turn: list[list[int]]):
        width = max(map(len, first_turn))
        self.first_turn = [row + [PAD] * (width - len(row)) for row in first_turn]
        self.tokenizer = tokenizer
        self.rows: list[int] = []
        self.prompts: list[str] = []

    def __deepcopy__(self, memo):  # the hf backend's copy of the model keeps this very fake (and its records)
        return self

    def __call__(self, input_ids, **kwargs):
        self.rows.append(input_ids.shape[0])
        self.prompts += self.tokenizer.batch_decode(input_ids, skip_special_tokens=False)
        rows = self.first_turn if input_ids.shape[0] == len(self.first_turn) else [DONE] * len(input_ids)
        return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=-1)


def _train(trainer, first_turn) -> ScriptedGenerate:
    """Train under the scripted `generate`; assert TRL's closing checks (a train loss, every parameter moved)."""
    previous_trainable_params = {n: param.clone() for n, param in trainer.model.named_parameters()}
    fake = ScriptedGenerate(trainer.processing_class, first_turn)
    with patch.object(trainer.model, "generate", side_effect=fake):
        trainer.train()
    assert trainer.state.log_history[-1]["train_loss"] is not None
    for n, param in previous_trainable_params.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."
    return fake


def _close(trainer) -> None:
    if not PARITY:
        trainer.close()


# ---- the stand-in and the tool loop's pieces (fast) -----------------------------------------------------------------
def test_the_standin_tokenizer_has_the_ids_trl_hard_codes(standin):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(standin["policy"])
    assert len(tok) == 151669 and (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 151645, PAD)
    assert (
        tok.decode(CALL_3_4)
        == '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    )
    assert tok.decode(CALL_WRONG_ARG).startswith('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "c": 4}}')
    assert tok.decode(NO_CALL, skip_special_tokens=True) == "I don't know any tool"
    assert tok.decode(DONE) == "Done!<|im_end|>"
    # the text encodes back to the same ids (as Qwen3's tokenizer does), and <tool_call> is not a special token
    assert tok(tok.decode(CALL_3_4))["input_ids"] == CALL_3_4
    assert tok.decode(CALL_3_4, skip_special_tokens=True).startswith("<tool_call>")


def test_qwen3_template_tool_turn_is_what_follows_the_assistants_end_of_turn(standin):
    """Qwen3's template writes an empty `<think></think>` into the last assistant turn only: once a tool message
    follows, that turn renders without it, so the conversation without the tool message is not a prefix of the one
    with it. The environment's tokens are then what follows the assistant's `<|im_end|>` (TRL's tool suffix)."""
    from transformers import AutoTokenizer

    from grpo_async.envs import env_turn_ids, template_ids

    tok = AutoTokenizer.from_pretrained(standin["policy"])
    prompt = [{"role": "user", "content": "What is 3 times 4?"}]
    conversation = prompt + [{"role": "assistant", "content": tok.decode(CALL_3_4, skip_special_tokens=True)}]
    tool = [{"role": "tool", "name": "multiply", "content": "12"}]
    before = template_ids(tok, conversation, False, tools=[multiply])
    after = template_ids(tok, conversation + tool, True, tools=[multiply])
    assert after[: len(before)] != before  # the template is not prefix-consistent here
    ids = env_turn_ids(tok, conversation, tool, CALL_3_4, turn=1, tools=[multiply])
    expected = "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == expected
    held = template_ids(tok, prompt, True, tools=[multiply]) + CALL_3_4 + ids  # what the next turn continues
    assert held == after  # the same tokens as the template's rendering of the whole conversation


def test_trl_reads_malformed_tool_calls_as_plain_text():
    from grpo_async.envs.factory import trl_tool_calls, trl_tool_turn

    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
    assert trl_tool_calls(call + call) == [("multiply", {"a": 3, "b": 4})] * 2
    assert trl_tool_calls('<tool_call>{"name": "multiply"}</tool_call>') == [("multiply", {})]
    assert trl_tool_calls('<tool_call>{"name": "multiply", "arguments": null}</tool_call>') == [("multiply", {})]
    for bad in ('{"name": "multiply", "arguments": {"a": 3}', '{"arguments": {"a": 3}}', '["multiply"]', "{}"):
        assert trl_tool_calls(f"<tool_call>{bad}</tool_call>") == []
        assert trl_tool_calls(call + f"<tool_call>{bad}</tool_call>") == []  # TRL parses the turn as a whole
    state = {"tool_calls": 0, "tool_errors": 0}
    text = (
        call + '<tool_call>{"name": "multiply", "arguments": {"c": 1}}</tool_call><tool_call>{"name": "x"}</tool_call>'
    )
    messages, state = trl_tool_turn(text, {"multiply": multiply}, None, state)
    assert [m["content"] for m in messages] == [
        "12",
        "{'error': \"multiply() got an unexpected keyword argument 'c'\"}",
        "{'error': 'Tool x not found.'}",
    ]
    assert state == {"tool_calls": 3, "tool_errors": 2}


# ---- tools= ---------------------------------------------------------------------------------------------------------
def test_training_with_tools(standin, tmp_path):
    """TRL's `test_training_with_tools`: 3 completions per round, 2 of them call `multiply` (one with a wrong
    argument name, which fails), one answers in text; after the tool results each caller writes `Done!`."""
    dataset = zen_prompts(2)
    trainer = GRPOTrainer(
        model=standin["policy"],
        reward_funcs=standin["reward"],
        args=_args(tmp_path),
        train_dataset=dataset,
        tools=[multiply],
    )
    fake = _train(trainer, [CALL_3_4, CALL_WRONG_ARG, NO_CALL])
    _close(trainer)

    assert trainer.state.log_history[-1]["tools/call_frequency"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] is not None
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    # beyond TRL's assertions: each round is one call of 3 rows, then one of the 2 that called the tool, and the
    # second call continues each of them after its tool's answer (the product, or TRL's error text)
    assert fake.rows == [3, 2] * 6
    assert "<tool_response>\n12\n</tool_response>" in fake.prompts[3]
    assert "'error': \"multiply() got an unexpected keyword argument 'c'\"" in fake.prompts[4]
    assert '"name": "multiply"' in fake.prompts[0]  # the tool's schema, rendered by Qwen3's chat template


def test_train_with_malformed_tool_calls(standin, tmp_path):
    """Malformed tool calls: TRL reads a `<tool_call>` whose JSON does not parse, or that names no tool, as plain
    text (its `parse_response` falls back to the decoded text): not a call, and the rollout ends; a call without
    `arguments` is a call with none, which fails here. Nothing crashes and the run trains."""
    # '<tool_call>\n{"name": "multiply"}\n</tool_call><|im_end|>'
    no_arguments = CALL_3_4[:7] + [1, 92, 198, 151658, 151645]
    # '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}\n</tool_call><|im_end|>' (a brace short)
    bad_json = CALL_3_4[:22] + [92, 198, 151658, 151645]
    # '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
    no_name = CALL_3_4[:3] + CALL_3_4[9:]
    trainer = GRPOTrainer(
        model=standin["policy"],
        reward_funcs=standin["reward"],
        args=_args(tmp_path),
        train_dataset=zen_prompts(2),
        tools=[multiply],
    )
    texts = [trainer.processing_class.decode(ids) for ids in (no_arguments, bad_json, no_name)]
    assert texts == [
        '<tool_call>\n{"name": "multiply"}\n</tool_call><|im_end|>',
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}\n</tool_call><|im_end|>',
        '<tool_call>\n{"arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
    ]
    fake = _train(trainer, [no_arguments, bad_json, no_name])
    _close(trainer)

    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(1 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1.0)
    assert fake.rows == [3, 1] * 6  # only the call without arguments is answered and continued
    assert "missing 2 required positional arguments" in fake.prompts[3]


# ---- environment_factory --------------------------------------------------------------------------------------------
class MultiplyEnv:
    """An environment whose one tool multiplies, and remembers the products it computed."""

    def reset(self, **kwargs):
        self.products = []

    def multiply(self, a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        self.products.append(a * b)
        return a * b


class NotebookEnv:
    """Another environment, whose one tool is not `multiply`."""

    def reset(self, **kwargs):
        self.notes = []

    def write(self, text: str) -> str:
        """
        Writes a note.

        Args:
            text: The note.

        Returns:
            The note.
        """
        self.notes.append(text)
        return text


def test_train_with_environment_factory(standin, tmp_path):
    """`environment_factory`: one `MultiplyEnv` per rollout, its `multiply` the tool; the reward function reads the
    rollouts' environments. Same scripted turns as `test_training_with_tools`, so TRL's tool metrics are the same."""
    seen = []

    def reward_func(environments, **kwargs):
        seen.append([list(env.products) for env in environments])
        return [float(sum(env.products)) for env in environments]

    trainer = GRPOTrainer(
        model=standin["policy"],
        reward_funcs=reward_func,
        args=_args(tmp_path),
        train_dataset=zen_prompts(2),
        environment_factory=MultiplyEnv,
    )
    _train(trainer, [CALL_3_4, CALL_WRONG_ARG, NO_CALL])
    _close(trainer)

    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert trainer.state.log_history[-1]["rewards/reward_func/mean"] == pytest.approx(4.0)  # (12 + 0 + 0) / 3
    assert seen == [[[12], [], []]] * 6  # each rollout's own instance, reset between rounds


def test_train_with_environment_factory_multiple_environments(standin, tmp_path):
    """A dict of factories routed by the dataset's `environment` column: a `multiply` row's rollouts get a
    `MultiplyEnv` and its tool, a `notebook` row's a `NotebookEnv`, where `multiply` is not a tool (both calls fail:
    `Tool multiply not found.`). Over the run's 6 rounds, 3 of each: failure frequency (1/2 + 2/2) / 2."""
    kinds = []

    def reward_func(environments, environment, **kwargs):
        kinds.append([(type(env).__name__, name) for env, name in zip(environments, environment, strict=True)])
        return [float(len(getattr(env, "products", []))) for env in environments]

    dataset = Dataset.from_dict({"prompt": zen_prompts(2)["prompt"], "environment": ["multiply", "notebook"]})
    trainer = GRPOTrainer(
        model=standin["policy"],
        reward_funcs=reward_func,
        args=_args(tmp_path),
        train_dataset=dataset,
        environment_factory={"multiply": MultiplyEnv, "notebook": NotebookEnv},
    )
    fake = _train(trainer, [CALL_3_4, CALL_WRONG_ARG, NO_CALL])
    _close(trainer)

    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(3 / 4)
    expected = {"multiply": "MultiplyEnv", "notebook": "NotebookEnv"}
    assert all(cls == expected[name] for round_kinds in kinds for cls, name in round_kinds)
    assert sorted(round_kinds[0][1] for round_kinds in kinds) == ["multiply"] * 3 + ["notebook"] * 3
    for prompts in (p for p in _calls(fake) if len(p) == 3):  # each first turn shows its environment's tool only
        shown = {('"name": "multiply"' in p, '"name": "write"' in p) for p in prompts}
        assert shown in ({(True, False)}, {(False, True)})


def _calls(fake: ScriptedGenerate) -> list[list[str]]:
    """`fake.prompts` grouped by call."""
    out, at = [], 0
    for rows in fake.rows:
        out.append(fake.prompts[at : at + rows])
        at += rows
    return out


class ScoredMultiplyEnv(MultiplyEnv):
    """`MultiplyEnv` that owns its reward: 1 when the rollout computed 3 x 4, else 0."""

    def get_reward(self) -> float:
        return 1.0 if self.products == [12] else 0.0


def test_train_with_environment_factory_environment_owned_reward(standin, tmp_path):
    """An environment with `get_reward` is a reward source of its own (weight 1, logged under its class name), so
    `reward_funcs` may be omitted: per round the rollout that computed 12 scores 1, the other two 0."""
    trainer = GRPOTrainer(
        model=standin["policy"],
        args=_args(tmp_path),
        train_dataset=zen_prompts(2),
        environment_factory=ScoredMultiplyEnv,
    )
    _train(trainer, [CALL_3_4, CALL_WRONG_ARG, NO_CALL])
    _close(trainer)

    assert trainer.reward_func_names == ["ScoredMultiplyEnv"]
    assert trainer.state.log_history[-1]["rewards/ScoredMultiplyEnv/mean"] == pytest.approx(1 / 3)
    assert trainer.state.log_history[-1]["reward"] == pytest.approx(1 / 3)
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)


class TaskEnv(ScoredMultiplyEnv):
    """An environment that owns the data: `reset` returns the task, which becomes the prompt."""

    def reset(self, **kwargs):
        super().reset()
        return "What is 3 times 4? Use the multiply tool."


def test_train_with_environment_factory_environment_owned_data(standin, tmp_path):
    """No `train_dataset`: the environment owns the data (`reset()` returns the prompt, appended to an empty user
    message) and `max_steps` sets the length; `get_reward` scores it."""
    trainer = GRPOTrainer(
        model=standin["policy"],
        args=_args(tmp_path, max_steps=3),
        environment_factory=TaskEnv,
    )
    fake = _train(trainer, [CALL_3_4, CALL_WRONG_ARG, NO_CALL])
    _close(trainer)

    assert trainer.state.global_step == 3
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert trainer.state.log_history[-1]["rewards/TaskEnv/mean"] == pytest.approx(1 / 3)
    assert fake.rows == [3, 2] * 3
    user_turn = "<|im_start|>user\nWhat is 3 times 4? Use the multiply tool.<|im_end|>\n<|im_start|>assistant\n"
    assert all(p.endswith(user_turn) for p in _calls(fake)[0])
