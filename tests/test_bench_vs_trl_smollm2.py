"""Smoke test of `bench/vs_trl.py --model smollm2`'s pieces, without training or an engine: the preset, the seeded
2-digit addition prompts (with the real chat template, within the bench's max_prompt_length), the reward on known
completions, and the per-phase breakdown of a step (hand-worked)."""

import os
import re
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import _runs  # noqa: E402
import vs_trl  # noqa: E402


def spec():
    p = vs_trl.MODELS["smollm2"]
    return {"prompts": p["prompts"], "G": p["G"], "T": p["T"], "steps": p["steps"], **p["spec"]}


def test_addition_prompts_are_seeded_chats_that_fit(smollm2_path):
    from transformers import AutoTokenizer

    ds, again = _runs.dataset(spec()), _runs.dataset(spec())
    assert ds[:8] == again[:8]  # seeded: TRL and ours train on the same prompts
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for row in ds.select(range(8)):
        (msg,) = row["prompt"]
        a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", msg["content"]).groups())
        assert msg["role"] == "user" and row["answer"] == str(a + b) and 10 <= a <= 99 and 10 <= b <= 99
        ids = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert len(ids) <= spec()["max_prompt_length"]  # ours never truncates what TRL keeps whole


def test_sum_reward_on_known_completions():
    reward = _runs.reward(spec())
    completions = [
        [{"role": "assistant", "content": "27 + 82 = \\boxed{109}"}],
        [{"role": "assistant", "content": "\\boxed{108}"}],
        [{"role": "assistant", "content": "The sum is 109."}],
        [{"role": "assistant", "content": "no idea"}],
    ]
    out = reward(prompts=[None] * 4, completions=completions, completion_ids=[[]] * 4, answer=["109"] * 4)
    assert out == [1.0, 0.0, 1.0, 0.0]
    assert _runs.reward({}).__name__ == "letter_reward"  # the tiny default keeps its task


def _three(phase: dict, key: str, low: float, high: float) -> list[dict]:
    """`phase` three times, `key` at `low`, as given and `high`: the median is the one given."""
    return [{**phase, key: low}, phase, {**phase, key: high}]


def test_trl_breakdown_hand_values():
    # TRL's step (sequential), seconds: training_step 8.0 = generate_and_score 3.5 + forward 1.5 + backward 3.0;
    # generate_and_score 3.5 = weight sync 0.1 + generate 2.0 + old logps 1.0 + rewards/padding 0.4
    trl = {"weight_sync": 0.1, "generate": 2.0, "old_logps": 1.0, "generate_and_score": 3.5}
    trl.update(train_forward=1.5, training_step=8.0, lm_head_rows=2592.0, lm_head_scored=1024.0)
    out = vs_trl.breakdown("trl", 9.0, _three(trl, "generate", 0.5, 7.0))  # median generate: 2.0
    assert list(out) == list(vs_trl.PHASES)
    assert out == pytest.approx(
        {
            "weight sync": 0.1,
            "generate (vLLM)": 2.0,
            "rewards + padding": 0.4,  # 3.5 − 2.0 − 0.1 − 1.0
            "wait for generation": 0.0,  # sequential: TRL never waits for a background round
            "old logps": 1.0,
            "train forward (logps + loss)": 1.5,
            "train backward + rest": 3.0,  # 8.0 − 3.5 − 1.5
            "other (optimizer, logging)": 1.0,  # 9.0 − 8.0 (every phase counted, generation included)
        }
    )
    # TRL's fused LM head projects 2592 positions for 1024 scored completion tokens: 2592 / 1024 = 2.53125
    assert vs_trl.lm_head_rows([trl]) == {"projected": 2592.0, "scored": 1024.0, "ratio": 2.53125}


def test_ours_breakdown_hand_values():
    # ours (async): the round (rollout 2.0 + rewards 0.2 = generation 2.2) ran in the background; the trainer
    # waited 0.3 s for it and computed 5.0 s = weight sync 0.1 + old logps 1.0 + forward 1.5 + backward 2.4
    ours = {"timing/weight_sync": 0.1, "timing/rollout": 2.0, "timing/generation": 2.2, "timing/wait_generation": 0.3}
    ours.update({"timing/old_logps": 1.0, "timing/train_step": 5.0, "train_forward": 1.5})
    out = vs_trl.breakdown("ours_async_colocate", 9.0, _three(ours, "timing/train_step", 4.0, 6.5))
    assert list(out) == list(vs_trl.PHASES)
    assert out == pytest.approx(
        {
            "weight sync": 0.1,
            "generate (vLLM)": 2.0,
            "rewards + padding": 0.2,  # 2.2 − 2.0
            "wait for generation": 0.3,
            "old logps": 1.0,
            "train forward (logps + loss)": 1.5,
            "train backward + rest": 2.4,  # 5.0 − 0.1 − 1.0 − 1.5
            # 9.0 − (0.1 + 0.3 + 1.0 + 1.5 + 2.4): the producer's 2.0 + 0.2 ran beside the step, not counted in it
            "other (optimizer, logging)": 3.7,
        }
    )
    assert vs_trl.lm_head_rows([ours]) is None  # ours does not record it
