"""An engine on every rank (hf `generate`, in-process vLLM) with 2 real training processes: each rank's engine
generates only its own rows, advantages are those of the whole round, each engine follows its rank's model."""

import json
import os
import re
import subprocess

import pytest
import torch
from mp_utils import ACCELERATE_2CPU, HERE, check_disjoint_slices

from grpo_async.algo.advantages import aggregate_advantages
from grpo_async.demo_task import letter_reward

STEPS, R, G = 3, 16, 4  # a round: per_device 4 × 2 processes × steps_per_generation 2 rows, one round per step
L = R // 2


def _launch(model, out, backend):
    cmd = [*ACCELERATE_2CPU, os.path.join(HERE, "engine_per_rank_train.py"), model, out, backend]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def _check(ranks, per_round_count):
    check_disjoint_slices(ranks, mu=1, steps=STEPS, R=R, G=G)  # each row trained once, on its own rank
    for r in ranks:
        # the rank's own engine made exactly its rows of each round (main alone would have made R rows per round)
        assert r["rounds_produced"] == STEPS, r
        assert r["engine_counter"] == STEPS * per_round_count, r
        # after publishing, the engine holds this rank's trained model: same logprobs, same version
        assert r["engine_version"] == r["global_step"] == STEPS
        assert r["logp_gap"] < 1e-3, r["logp_gap"]
    # advantages: the single-process computation over the whole round's rows (scale_rewards="batch": the std of
    # all R rewards), from rewards recomputed here from the trained completions
    rows = {}
    for r in ranks:
        for b in r["seen"]:
            for rnd, row, prompt, text, adv in zip(b["round"], b["row"], b["prompt"], b["completion"], b["advantage"]):
                rows[(rnd, row)] = (re.search(r"Say (\w)", prompt).group(1), text, adv)
    for rnd in {k[0] for k in rows}:
        letters, texts, advantages = zip(*(rows[(rnd, i)] for i in range(R)))
        rewards = torch.tensor(letter_reward(None, list(texts), None, list(letters)))  # [R]
        expected = aggregate_advantages(rewards[:, None], torch.ones(1), G, "batch")  # [R]
        torch.testing.assert_close(torch.tensor(advantages), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
def test_hf_engine_on_every_rank(tiny_model_path, tmp_path):
    ranks = _launch(tiny_model_path, str(tmp_path), "hf")
    _check(ranks, per_round_count=L)  # HF counts completions


@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.slow  # ~90 s: two vLLM engines start, each in a child process of its rank
def test_vllm_colocate_engine_on_every_rank(tiny_model_path, tmp_path):
    ranks = _launch(tiny_model_path, str(tmp_path), "vllm")
    _check(ranks, per_round_count=L // G)  # vLLM counts requests: one per prompt (n = G, seeded)
