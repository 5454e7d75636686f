"""Smoke test of `bench/vs_trl.py --model smollm2`'s pieces, without training or an engine: the preset, the seeded
2-digit addition prompts (with the real chat template, within the bench's max_prompt_length), the reward on known
completions, and the per-phase breakdown adding up to the step."""

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


@pytest.mark.parametrize("name", ["trl", "ours_async_colocate"])
def test_breakdown_adds_up_to_the_step(name):
    trl = {"weight_sync": 0.1, "generate": 2.0, "old_logps": 1.0, "generate_and_score": 3.5}
    trl.update(train_forward=1.5, training_step=8.0, lm_head_rows=2592.0, lm_head_scored=1024.0)
    ours = {"timing/weight_sync": 0.1, "timing/rollout": 2.0, "timing/generation": 2.2, "timing/wait_generation": 0.3}
    ours.update({"timing/old_logps": 1.0, "timing/train_step": 5.0, "train_forward": 1.5})
    phases = [trl if name == "trl" else ours]
    out = vs_trl.breakdown(name, 9.0, phases)
    assert list(out) == list(vs_trl.PHASES)
    counted = [k for k in out if name == "trl" or k not in vs_trl.PRODUCER]
    assert sum(out[k] for k in counted) == pytest.approx(9.0)
    assert all(v >= 0 for v in out.values())
    rows = vs_trl.lm_head_rows(phases)
    assert (rows is None) == (name != "trl") and (rows is None or rows["ratio"] == pytest.approx(2.53125))
