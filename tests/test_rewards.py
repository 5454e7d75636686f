"""Reward functions: TRL 1.16's calling convention and semantics, the errors that name a function, the timeout,
and the built-ins on hand-worked values."""

import asyncio
import math
import threading

import pytest
import torch

from grpo_async import GRPOConfig
from grpo_async.algo.advantages import combine_rewards
from grpo_async.rewards import (
    RewardTimeoutError,
    format_reward,
    length_penalty,
    math_reward,
    prepare_reward_funcs,
    score_completions,
)
from grpo_async.rewards.builtin import make_format_reward

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]
IDS = [[1], [2, 2], [3, 3, 3]]


def _score(funcs, columns=None, timeout=None, completions=COMPLETIONS):
    funcs, names = prepare_reward_funcs(funcs)
    return score_completions(funcs, names, PROMPTS, completions, IDS, columns or {}, timeout=timeout)


# ------------------------------------------------------------------------------------------- calling convention
def test_calling_convention_and_columns_as_kwargs():
    seen = {}

    def by_length(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, answer=answer, extra=kwargs)
        return [float(len(c)) for c in completions]

    table = _score(by_length, {"answer": ["x", "y", "z"], "level": [1, 2, 3]})
    assert table.shape == (3, 1) and table[:, 0].tolist() == [1.0, 2.0, 3.0]
    assert seen["prompts"] == PROMPTS and seen["ids"] == IDS and seen["answer"] == ["x", "y", "z"]
    assert seen["extra"] == {"level": [1, 2, 3]}


def test_none_is_nan_and_weights_combine_with_nansum_like_trl():
    def first(prompts, completions, **kw):
        return [1.0, None, None]

    def second(prompts, completions, **kw):
        return [2.0, 3.0, None]

    table = _score([first, second])
    assert torch.isnan(table[1, 0]) and torch.isnan(table[2]).all()
    # TRL: (rewards_per_func * weights).nansum(dim=1); a row every function skipped stays NaN (advantage 0)
    rewards = combine_rewards(table, torch.tensor([0.5, 2.0]))
    assert rewards[:2].tolist() == [0.5 * 1 + 2 * 2, 2 * 3.0]
    assert torch.isnan(rewards[2])


def test_duplicate_names_are_made_unique():
    def r(prompts, completions, **kw):
        return [0.0] * len(completions)

    assert prepare_reward_funcs([r, r])[1] == ["r", "r_1"]


@pytest.mark.parametrize(
    "output, message",
    [
        ([1.0, 2.0], "returned 2 values for 3 completions"),
        (None, "returned NoneType for 3 completions"),
        ([1.0, "x", 2.0], "returned 'x' at index 1"),
        ([1.0, 2.0, math.inf], "returned inf at index 2; rewards must be finite"),
        ([-math.inf, 2.0, 1.0], "returned -inf at index 0"),
        ([1.0, math.nan, 1.0], "returned nan at index 1; rewards must be finite (return None"),
    ],
)
def test_bad_outputs_are_errors_naming_the_function(output, message):
    def my_reward(prompts, completions, **kw):
        return output

    with pytest.raises(ValueError, match="'my_reward'") as e:
        _score(my_reward)
    assert message in str(e.value)


def test_a_raising_function_is_named():
    def broken(prompts, completions, **kw):
        raise KeyError("solution")

    with pytest.raises(RuntimeError, match="reward function 'broken' raised KeyError"):
        _score(broken)
    with pytest.raises(RuntimeError, match="reward function 'broken' raised KeyError"):
        _score(broken, timeout=5)  # in a worker thread too


def test_async_functions_run_concurrently():
    """Each async function waits until the other has started: both finish only if they overlap (run one after the
    other, the first would wait for the second forever: the 10 s guard turns that into a failure)."""
    events = {"a": asyncio.Event(), "b": asyncio.Event()}

    async def wait_for_other(me, other):
        events[me].set()
        await asyncio.wait_for(events[other].wait(), 10)

    async def reward_a(prompts, completions, **kw):
        await wait_for_other("a", "b")
        return [1.0] * len(completions)

    async def reward_b(prompts, completions, **kw):
        await wait_for_other("b", "a")
        return [2.0] * len(completions)

    def sync_reward(prompts, completions, **kw):
        return [3.0] * len(completions)

    table = _score([reward_a, sync_reward, reward_b], timeout=30)
    assert table[0].tolist() == [1.0, 3.0, 2.0]


def test_async_function_errors_are_named():
    async def bad_async(prompts, completions, **kw):
        raise ValueError("boom")

    with pytest.raises(RuntimeError, match="'bad_async' raised ValueError: boom"):
        _score(bad_async)


def test_scoring_works_inside_a_running_event_loop():
    async def r(prompts, completions, **kw):
        return [1.0] * len(completions)

    async def caller():
        return _score(r)

    assert asyncio.run(caller())[:, 0].tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------------- timeout
def test_a_hung_sync_function_times_out_with_its_name():
    release = threading.Event()

    def hangs(prompts, completions, **kw):
        release.wait(60)  # stands for a function that never returns
        return [0.0] * len(completions)

    try:
        with pytest.raises(RewardTimeoutError, match=r"reward function 'hangs' did not return within .*=0.2 s"):
            _score(hangs, timeout=0.2)
    finally:
        release.set()  # let the abandoned worker thread finish


def test_a_hung_async_function_times_out_with_its_name():
    async def sleeps(prompts, completions, **kw):
        await asyncio.sleep(60)

    async def fine(prompts, completions, **kw):
        return [1.0] * len(completions)

    with pytest.raises(RewardTimeoutError, match="'sleeps' did not return within"):
        _score([fine, sleeps], timeout=0.2)


def test_an_async_function_that_blocks_the_loop_is_caught_by_the_outer_deadline():
    release = threading.Event()

    async def blocks(prompts, completions, **kw):
        release.wait(60)  # a blocking call inside async def: asyncio cannot cancel it
        return [0.0] * len(completions)

    try:
        with pytest.raises(RewardTimeoutError, match="'blocks' did not return"):
            _score(blocks, timeout=0.2)
    finally:
        release.set()


def test_reward_timeout_is_validated():
    with pytest.raises(ValueError, match="GRPOConfig.reward_timeout: must be > 0"):
        GRPOConfig(output_dir="/tmp/x", use_cpu=True, reward_timeout=0, report_to=[])
    assert GRPOConfig(output_dir="/tmp/x", use_cpu=True, reward_timeout=None, report_to=[]).reward_timeout is None


# -------------------------------------------------------------------------------------------------- built-ins
def test_math_reward_hand_worked():
    completions = [
        "<think>48/2 = 24, 48 + 24 = 72</think><answer>72</answer>",  # right, in the answer tag
        [{"role": "assistant", "content": r"so it is \boxed{\frac{1}{2}}"}],  # right, conversational, LaTeX
        "The final answer is $0.5$",  # right: 1/2 == 0.5
        "<answer>71</answer>",  # wrong
        "I do not know",  # no answer: wrong
        "<answer>3</answer>",  # gold unparseable: None
    ]
    gold = [
        "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",  # GSM8K: the part after #### is the answer
        r"\frac{1}{2}",
        "1/2",
        "72",
        "5",
        "no number here",
    ]
    assert math_reward(completions=completions, answer=gold) == [1.0, 1.0, 1.0, 0.0, 0.0, None]
    assert math_reward(completions=completions[:1], solution=["72"]) == [1.0]  # TRL's `solution` column
    with pytest.raises(ValueError, match="`solution` or `answer`"):
        math_reward(completions=completions)


def test_math_reward_does_not_pay_for_restating_the_question():
    """math-verify evaluates any expression it finds: "27 + 82" equals 109. SmolLM2 trained on 2-digit addition found
    that within 20 steps (answers "27 + 82 = \\boxed{}"): only an answer segment or an anchored answer counts."""
    hacks = ["27 + 82 = \\boxed{}", "27 + 82 = \\boxed", "27+82", "To add 27 and 82: 27 + 82 = ", "27 + 82 = 109"]
    assert math_reward(completions=hacks, answer=["109"] * len(hacks)) == [0.0] * len(hacks)
    right = [
        "\\boxed{109}",
        "so \\boxed{27+82}",
        "<answer>109</answer>",
        "#### 109",
        "The final answer is $109$",
        "109",
    ]
    assert math_reward(completions=right, answer=["109"] * len(right)) == [1.0] * len(right)


def test_format_reward_hand_worked():
    assert format_reward(
        completions=[
            "<think>a</think><answer>b</answer>",
            " <think>a\nb</think>\n<answer>c</answer>\n",
            "<answer>b</answer>",
            "<think>a</think><answer>b</answer> extra",
            [{"role": "assistant", "content": "<think>x</think><answer>y</answer>"}],
        ]
    ) == [1.0, 1.0, 0.0, 0.0, 1.0]
    boxed = make_format_reward(r".*\\boxed\{.+\}", reward=0.5, name="boxed")
    assert boxed.__name__ == "boxed"
    assert boxed(completions=[r"x \boxed{3}", "3"]) == [0.5, 0.0]


def test_length_penalty_hand_worked():
    penalty = length_penalty(target_length=4, scale=2.0)
    # 3 and 4 tokens: within the target; 6 tokens: 2 over a target of 4 → -2 · 2/4 = -1; 8 → -2
    assert penalty(completion_ids=[[0] * 3, [0] * 4, [0] * 6, [0] * 8]) == [0.0, 0.0, -1.0, -2.0]
    with pytest.raises(ValueError, match="target_length must be an int > 0"):
        length_penalty(0)


def test_builtins_through_the_scorer_with_weights():
    completions = ["<think>t</think><answer>2</answer>", "<answer>3</answer>", "2"]
    funcs, names = prepare_reward_funcs([math_reward, format_reward])
    assert names == ["math_reward", "format_reward"]
    table = score_completions(funcs, names, PROMPTS, completions, IDS, {"answer": ["2", "2", "2"]}, timeout=30)
    assert table.tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]
    assert combine_rewards(table, torch.tensor([1.0, 0.5])).tolist() == [1.5, 0.0, 1.0]


def test_a_hung_reward_function_stops_training_with_its_name(tiny_model_path, tmp_path):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import make_dataset

    release = threading.Event()

    def hung_reward(prompts, completions, **kw):
        release.wait(60)
        return [0.0] * len(completions)

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=4,
        max_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        reward_timeout=0.5,
    )
    trainer = GRPOTrainer(tiny_model_path, hung_reward, args=args, train_dataset=make_dataset(16))
    try:
        with pytest.raises(
            Exception, match=r"reward function 'hung_reward' did not return within .*reward_timeout=0.5"
        ):
            trainer.train()
    finally:
        release.set()


def test_demo_ends_cleanly_scores_exactly_one_eos_at_the_end_and_no_other_special_token():
    """Character tokenizer: ids 0-6 are special (<pad>=0, <|end|>=3), 'b' = 8. The old check (more ids than
    characters) paid for a <pad> anywhere; the reward must pay only for text then one EOS."""
    from grpo_async.demo_task import ends_cleanly
    from grpo_async.testing import build_tokenizer

    tok = build_tokenizer()
    b, end, pad = tok.convert_tokens_to_ids("b"), tok.eos_token_id, tok.pad_token_id
    cases = {
        "clean": ([b, b, end], 0.1),
        "pad inside": ([b, pad, b, end], 0.0),
        "pad, no eos": ([b, pad, b], 0.0),
        "two eos": ([b, end, end], 0.0),
        "eos only": ([end], 0.0),
        "clipped": ([b] * 16, 0.0),
    }
    ids = [c[0] for c in cases.values()]
    texts = [tok.decode(i, skip_special_tokens=True) for i in ids]
    assert ends_cleanly(["Say b"] * len(ids), texts, ids) == [c[1] for c in cases.values()]
