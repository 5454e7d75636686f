"""Reward models in `reward_funcs` (TRL's usage: a model id/path or a `PreTrainedModel`, with
`reward_processing_classes`): scored exactly as TRL 1.16 scores them, and trained on."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.rewards.reward_model import RewardModel
from grpo_async.testing import tiny_config


@pytest.fixture(scope="module")
def reward_model_path(tiny_model_path, tmp_path_factory):
    """A sequence classifier (one label) on the tiny Llama's architecture and tokenizer, seeded, saved locally."""
    config = AutoConfig.from_pretrained(tiny_model_path, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    path = tmp_path_factory.mktemp("rm") / "tiny-reward-model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(path)
    return str(path)


def _trl_scores(model, tokenizer, prompts, completions):
    """TRL 1.16 `GRPOTrainer._calculate_rewards` for an `nn.Module` reward function, step by step."""
    from trl.data_utils import apply_chat_template

    if isinstance(prompts[0], list):
        texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.inference_mode():
        return model(**inputs).logits[:, 0].tolist()


@pytest.mark.parametrize("conversational", [True, False])
def test_scores_equal_trls(reward_model_path, conversational):
    rm = RewardModel.load(reward_model_path)
    if conversational:
        prompts = [[{"role": "user", "content": "Say a"}], [{"role": "user", "content": "Say b"}]] * 2
        completions = [[{"role": "assistant", "content": t}] for t in ("a", "bbbb", "xyz", "b")]
    else:
        prompts, completions = ["Say a:", "Say b:"] * 2, ["a", "bbbb", "xyz", "b"]
    ours = rm(prompts=prompts, completions=completions)
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path, num_labels=1).eval()
    tok = AutoTokenizer.from_pretrained(reward_model_path)
    model.config.pad_token_id = tok.pad_token_id
    assert ours == pytest.approx(_trl_scores(model, tok, prompts, completions), abs=1e-6)
    assert len(set(round(x, 6) for x in ours)) > 1  # the rows really differ: padding did not make them equal
    assert rm.__name__ == "tiny-reward-model"


def test_a_reward_model_path_and_a_model_object_train(tiny_model_path, reward_model_path, tmp_path):
    rm_object = AutoModelForSequenceClassification.from_pretrained(reward_model_path, num_labels=1)
    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=[reward_model_path, rm_object, letter_reward],
        reward_processing_classes=[None, AutoTokenizer.from_pretrained(reward_model_path), None],
        args=tiny_config(tmp_path / "out", max_steps=1),
        train_dataset=make_dataset(64),
    )
    assert t.reward_func_names == ["tiny-reward-model", "tiny-reward-model_1", "letter_reward"]
    t.train()
    logged = t.state.log_history[0]
    # the same model twice (by path and as an object) gives the same scores
    assert logged["rewards/tiny-reward-model/mean"] == pytest.approx(logged["rewards/tiny-reward-model_1/mean"])
    assert logged["rewards/tiny-reward-model/std"] > 0


def test_errors_name_the_problem(tiny_model_path, tmp_path):
    args = tiny_config(tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        GRPOTrainer(tiny_model_path, reward_funcs="./no-such-reward-model", args=args, train_dataset=make_dataset(64))
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries for 1 reward functions"):
        GRPOTrainer(
            tiny_model_path,
            reward_funcs=letter_reward,
            reward_processing_classes=[None, None],
            args=args,
            train_dataset=make_dataset(64),
        )
