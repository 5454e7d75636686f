"""Issue 47: what a new user meets in their first hour on their own task: reward functions checked when the trainer
is built (not a round into `train()`), with the message a round would give."""

from __future__ import annotations

import pytest
from datasets import Dataset

from grpo_async import GRPOTrainer
from grpo_async.rewards import score_completions
from grpo_async.testing import tiny_config

DS = {"prompt": ["2 + 3 =", "4 + 1 ="] * 8, "answer": ["5", "5"] * 8}


def wrong(completions, answer):  # the mistake: no **kwargs
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def needs_solution(completions, solution, **kwargs):  # names a column the dataset does not have
    return [0.0] * len(completions)


def right(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


@pytest.mark.parametrize(
    "func, says", [(wrong, "it does not take 'completion_ids', 'log_extra', 'log_metric', 'prompts', 'trainer_state'")]
)
def test_a_reward_with_a_wrong_signature_fails_at_construction_naming_it_and_the_fix(
    tiny_model_path, tmp_path, func, says
):
    with pytest.raises(TypeError) as err:
        GRPOTrainer(
            tiny_model_path, reward_funcs=func, args=tiny_config(tmp_path), train_dataset=Dataset.from_dict(DS)
        )
    message = str(err.value)
    assert message.startswith(f"reward function {func.__name__!r} cannot be called the way the trainer calls it")
    assert says in message and "**kwargs" in message and f"def {func.__name__}(" in message
    # the round, had the check not run, explains its TypeError with the same words
    kwargs = {"answer": ["5"], "trainer_state": None, "log_extra": None, "log_metric": None}
    with pytest.raises(RuntimeError) as at_round:
        score_completions([func], [func.__name__], ["2 + 3 ="], ["5"], [[1]], kwargs)
    assert str(at_round.value).split(". Reward functions")[0] == message.split(". Reward functions")[0]


def test_a_reward_requiring_a_column_the_train_set_lacks_warns_at_construction(tiny_model_path, tmp_path, caplog):
    """It may come from an evaluation set's column (`evaluate(eval_dataset)`): a warning, with the fix, at once."""
    import logging

    with caplog.at_level(logging.WARNING, logger="grpo_async.rewards"):
        t = GRPOTrainer(
            tiny_model_path,
            reward_funcs=needs_solution,
            args=tiny_config(tmp_path),
            train_dataset=Dataset.from_dict(DS),
        )
    t.close()
    assert (
        "reward function 'needs_solution' cannot be called the way the trainer calls it: it requires 'solution'"
        in (caplog.text)
    )


def test_a_reward_with_trls_signature_builds_and_its_columns_are_checked_only_where_known(tiny_model_path, tmp_path):
    GRPOTrainer(
        tiny_model_path, reward_funcs=right, args=tiny_config(tmp_path), train_dataset=Dataset.from_dict(DS)
    ).close()
