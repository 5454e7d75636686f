"""An engine on every rank (hf `generate`, in-process vLLM) with 2 real training processes: each rank's engine
generates only its own rows, advantages are those of the whole round, each engine follows its rank's model."""

import json
import os
import re

import pytest
import torch
from mp_utils import HERE, check_disjoint_slices
from support.warm_launch import run_2cpu

from grpo_async import GRPOTrainer
from grpo_async.algo.advantages import aggregate_advantages
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.pipeline.join import JoinSettings, RoundJoiner
from grpo_async.pipeline.types import RoundRequest
from grpo_async.testing import tiny_config

STEPS, R, G = 3, 16, 4  # a round: per_device 4 × 2 processes × steps_per_generation 2 rows, one round per step
L = R // 2


def _launch(model, out, backend):
    proc = run_2cpu(os.path.join(HERE, "engine_per_rank_train.py"), [model, out, backend], timeout=420)
    assert proc.returncode == 0, proc.stdout[-8000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def _check(ranks, per_round_count):
    check_disjoint_slices(ranks, mu=1, steps=STEPS, R=R, G=G)  # each row trained once, on its own rank
    for r in ranks:
        # the rank's own engine made exactly its rows of each round (main alone would have made R rows per round)
        assert r["rounds_scored"] == STEPS, r
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
def test_hf_engine_on_every_rank_runs_a_multi_turn_environment(tiny_model_path, tmp_path):
    """An environment on every rank: each rank's engine runs the model and environment turns of its own rows only
    (rows trained once, on their rank), the environment's replies are in the trained completions, each rollout's
    final state reached the reward function with its own conversation (`replies_match`, in the child)."""
    ranks = _launch(tiny_model_path, str(tmp_path), "hf_env")
    check_disjoint_slices(ranks, mu=1, steps=STEPS, R=R, G=G)
    for r in ranks:
        assert r["rounds_scored"] == STEPS, r
        assert r["engine_counter"] >= STEPS * L  # at least one turn per row, on this rank's engine only
        assert r["engine_version"] == r["global_step"] == STEPS and r["logp_gap"] < 1e-3
        assert r["env_turns"] and all(t > 1 for t in r["env_turns"])  # multi-turn: the environment answered
        texts = [c for b in r["seen"] for c in b["completion"]]
        assert any("ok 1" in t for t in texts), texts[:4]


@pytest.mark.multiprocess
@pytest.mark.vllm
@pytest.mark.slow  # two vLLM engines start, each inside its rank's process
def test_vllm_colocate_engine_on_every_rank(tiny_model_path, tmp_path):
    """Each rank's engine runs inside the rank's process (vLLM's `external_launcher`, as TRL's colocate mode): no
    engine-core or worker process."""
    ranks = _launch(tiny_model_path, str(tmp_path), "vllm")
    _check(ranks, per_round_count=L // G)  # vLLM counts requests: one per prompt (n = G, seeded)
    assert [r["engine_processes"] for r in ranks] == [[], []]


@pytest.mark.multiprocess
@pytest.mark.vllm
def test_vllm_colocate_evaluate_before_train_without_weight_sync(tiny_model_path, tmp_path):
    """`evaluate()` first, with nothing published (`weight_sync_transport="none"`): every rank's engine starts there,
    at the same point, before the main process generates the eval completions alone (an engine started by the main
    process alone would wait in collectives rank 1 never enters); then training generates on every rank."""
    ranks = _launch(tiny_model_path, str(tmp_path), "vllm_eval")
    check_disjoint_slices(ranks, mu=1, steps=STEPS, R=R, G=G)
    for r in ranks:
        assert "eval_reward" in r["evaluated"] and "eval_loss" in r["evaluated"], r["evaluated"]
        assert r["engine_counter"] >= STEPS * L // G and r["engine_processes"] == []


@pytest.mark.multiprocess
@pytest.mark.vllm
def test_vllm_colocate_on_the_main_process_alone_runs_its_engine_in_a_child_process(tiny_model_path, tmp_path):
    """Groups of 16 that a rank's 8 rows would split: the main process generates every row, and its engine core runs
    in a child process (an in-process start-up would wait in collectives of the trainer's group that rank 1 never
    enters); each row is trained once, the engine follows the main process's model."""
    ranks = _launch(tiny_model_path, str(tmp_path), "vllm_main")
    check_disjoint_slices(ranks, mu=1, steps=STEPS, R=R, G=16)
    main, other = ranks
    assert any("EngineCore" in c for c in main["engine_processes"]), main["engine_processes"]
    assert other["engine_processes"] == [] and other["engine_counter"] is None and other["logp_gap"] is None
    assert main["engine_version"] == main["global_step"] == STEPS and main["logp_gap"] < 1e-3


def token_sum(completion_ids, **kwargs):
    """A reward that varies within every group of the random tiny model's completions."""
    return [float(sum(c) % 5) for c in completion_ids]


def test_joined_parts_equal_the_round_one_process_makes(tiny_model_path, tmp_path):
    """Two parts generated as two ranks would (rows [0, 8) and [8, 16), `first_row` 0 and 8), joined, equal the
    round one process generates from all 16 rows: same tokens (each row's seed is its round row's), same padding,
    advantages over the whole round (`scale_rewards="batch"`: neither part alone gives them), same reward metrics."""
    args = tiny_config(tmp_path, scale_rewards="batch", max_completion_length=6, temperature=1.5)
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=token_sum, args=args, train_dataset=make_dataset(8))
    producer = t.producer
    rows = [r for r in make_dataset(4, seed=3) for _ in range(G)]  # [16]: 4 prompts × G
    whole = producer(RoundRequest(7, rows))
    parts = [producer(RoundRequest(7, rows[:L], first_row=0)), producer(RoundRequest(7, rows[L:], first_row=L))]
    s = producer.s
    join = RoundJoiner(
        JoinSettings(G, s.scale_rewards, s.multi_objective_aggregation, t.processing_class.pad_token_id),
        reward_weights=lambda: producer.reward_weights,
        reward_names=lambda: producer.reward_names,
    )
    joined = join(parts)
    assert len(joined.batch) == R and joined.round_id == 7
    for name, want in whole.batch.tensors().items():
        got = getattr(joined.batch, name)
        if want.is_floating_point():
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)
        else:
            assert torch.equal(got, want), name
    assert joined.batch.num_items_in_batch == whole.batch.num_items_in_batch
    assert not torch.allclose(parts[0].batch.advantages, whole.batch.advantages[:L])  # the test can fail
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length"):
        assert joined.metrics[key] == pytest.approx(whole.metrics[key], abs=1e-6), key
    assert joined.samples["completion"] == whole.samples["completion"]
    t.close()
