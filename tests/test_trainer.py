"""End-to-end training on the tiny model (HF generate backend), single process."""

import threading
import time

import pytest
import torch
from datasets import Dataset
from support.recorders import recorded, tensors
from transformers import AutoTokenizer

from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config


def _args(tmp_path, **kw):
    return tiny_config(tmp_path / "out", **kw)


def _record(micro_batch, state, processing_class):
    """Every field (`support.recorders.tensors`), and whether the two masks the trainer handed over share memory."""
    record = tensors(micro_batch, state, processing_class)
    record["masks_share_storage"] = (
        micro_batch.loss_mask.untyped_storage().data_ptr() == micro_batch.completion_mask.untyped_storage().data_ptr()
    )
    return record


def _recorded(*args, **kwargs):
    """A `GRPOTrainer` and the record of every micro-batch it trains (`support.recorders.recorded`)."""
    return recorded(*args, record=_record, **kwargs)


def _changed(before, model):
    return {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_trains_and_logs(tiny_model_path, tmp_path, ahead):
    t, seen = _recorded(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=_args(tmp_path, num_batches_ahead=ahead),
        train_dataset=make_dataset(64),
    )
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    changed = _changed(before, t.model)
    assert len(changed) == len(before), f"unchanged: {set(before) - changed}"
    logs = [h for h in t.state.log_history if "reward" in h]
    assert len(logs) == 3
    for key in (
        "reward",
        "reward_std",
        "rewards/letter_reward/mean",
        "completions/mean_length",
        "clip_ratio/region_mean",
        "timing/generation",
        "timing/train_step",
        "async/pending",
        "async/completed",
        "async/staleness",
    ):
        assert key in logs[-1], key
    # staleness never exceeds num_batches_ahead rounds, and reaches it once the pipeline is primed
    stale = [h["async/staleness_max"] for h in logs]
    assert max(stale) == min(ahead, 2) and all(s <= ahead for s in stale)
    # attention mask and loss mask are separate tensors
    assert not any(b["masks_share_storage"] for b in seen.records)
    assert t.rounds.generator is None  # thread stopped after train()


def test_synchronous_mode_is_on_policy(tiny_model_path, tmp_path):
    t, seen = _recorded(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=_args(tmp_path, num_batches_ahead=0),
        train_dataset=make_dataset(64),
    )
    t.train()
    # each round generated from the weights of the step it is trained at
    assert all(int(b["policy_version"][0]) == i // 2 for i, b in enumerate(seen.records))


def test_round_reuse_old_logps_and_reference(tiny_model_path, tmp_path):
    # μ = 2: rounds are reused, old logps are computed; β > 0: reference logps and KL
    args = _args(tmp_path, num_iterations=2, beta=0.1, max_steps=4, num_batches_ahead=1)
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert "old_logps" in seen.records[0] and "ref_logps" in seen.records[0]
    # generation every GA·μ = 4 micro-steps; epoch order a b | a b
    rounds = [int(b["round_id"][0]) for b in seen.records]
    assert rounds == [0] * 4 + [1] * 4
    rows = [sorted(b["row_index"].tolist()) for b in seen.records[:4]]
    assert rows[0] == rows[2] and rows[1] == rows[3] and rows[0] != rows[1]
    assert sorted(rows[0] + rows[1]) == list(range(16))
    assert any("kl" in h for h in t.state.log_history)


def test_importance_sampling_correction(tiny_model_path, tmp_path):
    # round 0 is sampled and trained with the initial weights: π_old = π_sampler, ratio 1. Round 1 was sampled with
    # the initial weights too but is trained after one optimizer step (num_batches_ahead = 1): ratio ≠ 1. One optimizer
    # step per round: π_old is the training forward's own (`InForwardImportanceSampling`), no separate pass.
    args = _args(tmp_path, num_batches_ahead=1, importance_sampling_mode="token_truncate", max_steps=2)
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert t.objective.importance_sampling is not None
    assert not any("old_logps" in r or "is_weights" in r for r in seen.records)  # the objective weighs the rows
    logs = [h for h in t.state.log_history if "reward" in h]
    assert logs[0]["sampling/logp_diff/max"] < 1e-4 < logs[1]["sampling/logp_diff/max"]
    assert logs[0]["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
    assert logs[1]["sampling/importance_sampling_ratio/max"] <= 3.0  # clipped at importance_sampling_clip_max
    for key in ("mean", "min", "max"):
        assert f"sampling/importance_sampling_ratio/{key}" in logs[1]
    # several optimizer steps per round: π_old moves, so the consumer scores it before training; token level
    args = _args(tmp_path, importance_sampling_mode="token_truncate", max_steps=2, steps_per_generation=4)
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert t.objective.importance_sampling is None
    r0 = seen.records[0]
    m0 = r0["loss_mask"].bool()
    assert r0["is_weights"].shape == r0["loss_mask"].shape
    torch.testing.assert_close(r0["is_weights"][m0], torch.ones(int(m0.sum())), atol=1e-4, rtol=0)
    # sequence level: one weight per completion; off: no weights at all
    args = _args(tmp_path, importance_sampling_mode="sequence_mask", max_steps=1, steps_per_generation=4)
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert seen.records[0]["is_weights"].shape == (8, 1)
    args = _args(tmp_path, importance_sampling_correction=False, max_steps=1)
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert "is_weights" not in seen.records[0] and "old_logps" not in seen.records[0]
    assert t.objective.importance_sampling is None


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_importance_weights_from_the_training_forward_train_as_a_separate_pass(tiny_model_path, tmp_path, mode):
    """π_old taken from the training forward (the default with one optimizer step per round) trains the same weights
    as the consumer's separate no-grad pass over the round (`InForwardImportanceSampling.from_config` returning None
    makes the product take that path) and logs the same `sampling/*` metrics; without importance sampling the weights
    differ far more (round 1, sampled one step behind, has ratios ≠ 1: the weights reach the loss)."""
    from grpo_async.algo.objective import InForwardImportanceSampling

    def run(name, **kw):
        args = _args(tmp_path / name, num_batches_ahead=1, importance_sampling_mode=mode, max_steps=3, **kw)
        t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
        t.train()
        logs = [h for h in t.state.log_history if "reward" in h]
        params = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        return t.objective.importance_sampling, params, logs

    fused, a, logs_a = run("fused")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(InForwardImportanceSampling, "from_config", classmethod(lambda cls, a, never_sampled=(): None))
        separate, b, logs_b = run("separate")
    _, c, _ = run("off", importance_sampling_correction=False)
    assert fused is not None and separate is None
    gap = max((a[n] - b[n]).abs().max().item() for n in a)
    off = max((a[n] - c[n]).abs().max().item() for n in a)
    assert gap < 1e-4 and off > 10 * max(gap, 1e-7), (gap, off)  # float noise of two forward passes
    for la, lb in zip(logs_a, logs_b, strict=True):  # extremes equal; means: of micro-batches vs of the round
        for key in [k for k in lb if k.startswith("sampling/") and "support" not in k]:
            extreme = key.endswith(("/max", "/min"))
            # a mean at float noise (round 0's logp_diff, ~1e-7: π_old and the sampler are the same weights) is
            # compared absolutely: its relative spread between two forward passes depends on the CPU's kernels
            close = pytest.approx(lb[key], abs=1e-4) if extreme else pytest.approx(lb[key], rel=0.05, abs=1e-6)
            assert la[key] == close, key


def test_samples_staler_than_max_staleness_are_not_trained(tiny_model_path, tmp_path, caplog):
    # 2 rounds ahead but max_staleness = 1 (one optimizer step per round here): round r ≥ 2 was sampled with the
    # weights of round r − 2 and is trained at version r → dropped (loss mask zeroed, counted); rounds 0, 1 are not.
    # staleness_policy="drop": the default, "pace", never generates those rounds that early (tests/test_pacing.py)
    args = _args(tmp_path, num_batches_ahead=2, max_staleness=1, max_steps=4, staleness_policy="drop")
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    for b in seen.records:
        stale = int(b["round_id"][0]) - int(b["policy_version"][0]) > 1
        assert (b["loss_mask"].sum() == 0) == stale, (int(b["round_id"][0]), int(b["policy_version"][0]))
    dropped = [h["async/dropped_stale"] for h in t.state.log_history if "async/dropped_stale" in h]
    assert dropped == [0, 0, 16, 16]  # every row of rounds 2 and 3
    assert "older than max_staleness=1 policy versions were not trained" in caplog.text
    # the default bound (num_batches_ahead) never drops anything in the normal pipeline
    args = _args(tmp_path, num_batches_ahead=2)
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert all(h.get("async/dropped_stale", 0) == 0 for h in t.state.log_history)


def test_consecutive_reuse_order(tiny_model_path, tmp_path):
    # seed 000's order: each micro-batch μ = 2 times in a row, a a b b (the default epoch order is a b a b)
    args = _args(tmp_path, num_iterations=2, max_steps=4, reuse_order="consecutive")
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    rows = [sorted(b["row_index"].tolist()) for b in seen.records[:4]]
    assert rows[0] == rows[1] and rows[2] == rows[3] and rows[0] != rows[2]
    assert sorted(rows[0] + rows[2]) == list(range(16))


def test_per_stage_micro_batches(tiny_model_path, tmp_path):
    # round: 8 rows × 2 GA = 16 rows (1 process). rollout 6 would leave a short call (6, 6, 4): refused, naming the
    # sizes that fit; rollout 8 (2 prompts × G per call) → 2 calls; ref 16 → 1 chunk; old 4 → 4 chunks.
    with pytest.raises(ValueError, match="GRPOConfig.rollout_micro_batch_size.*16 rows.*\\[1, 2, 4, 8, 16\\]"):
        _args(tmp_path, rollout_micro_batch_size=6, ref_logps_micro_batch_size=16, old_logps_micro_batch_size=4)
    args = _args(
        tmp_path,
        num_iterations=2,
        beta=0.1,
        max_steps=2,
        rollout_micro_batch_size=8,
        ref_logps_micro_batch_size=16,
        old_logps_micro_batch_size=4,
    )
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    logs = [h for h in t.state.log_history if "reward" in h]
    assert logs[0]["chunks/rollout"] == 2 and logs[0]["chunks/ref_logps"] == 1 and logs[0]["chunks/old_logps"] == 4
    for key in ("timing/ref_logps", "timing/old_logps"):
        assert key in logs[0]
    # chunking changes nothing: the frozen reference's logps of the trained rows, recomputed in one pass, agree
    from grpo_async.algo.logprobs import completion_logps

    for b in seen.records[:2]:
        ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
        am = torch.cat([b["prompt_mask"], b["completion_mask"]], 1)
        with torch.no_grad():
            ref = completion_logps(t.ref_model, ids, am, b["completion_ids"].size(1), args.temperature)
        mask = b["completion_mask"].bool()
        torch.testing.assert_close(b["ref_logps"][mask], ref[mask], atol=1e-5, rtol=0)

    # a rollout size that cuts groups still yields whole groups: 24-row rounds (12 × GA 2), rollout 6 rows with
    # G = 4 → each prompt sent 4 times with n = 1, 24 / 6 = 4 calls; LCM(6, 2, 3) = 6 divides 24
    args = _args(
        tmp_path,
        per_device_train_batch_size=12,
        max_steps=1,
        rollout_micro_batch_size=6,
        ref_logps_micro_batch_size=2,
        old_logps_micro_batch_size=3,
    )
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    t.train()
    assert [h for h in t.state.log_history if "reward" in h][0]["chunks/rollout"] == 4
    group_prompt = {}
    for b in seen.records:
        for row, ids, mask in zip(b["row_index"].tolist(), b["prompt_ids"], b["prompt_mask"], strict=True):
            assert group_prompt.setdefault(row // 4, ids[mask.bool()].tolist()) == ids[mask.bool()].tolist()
    assert len(group_prompt) == 6


def test_conversational_and_peft(tiny_model_path, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from grpo_async.algo.logprobs import completion_logps

    args = _args(tmp_path, beta=0.05, max_steps=2, num_batches_ahead=0)
    t, seen = _recorded(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=make_dataset(64),
        peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    lora_before = {n: p.detach().clone() for n, p in t.model.named_parameters() if "lora_B" in n}
    t.train()
    assert any(not torch.equal(p, dict(t.model.named_parameters())[n]) for n, p in lora_before.items())
    assert t.ref_model is None  # no copy: the adapter-disabled base is the reference
    # the reference logps the loss got are the base model's (never trained), not the adapted policy's
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    last = seen.records[-1]
    ids = torch.cat([last["prompt_ids"], last["completion_ids"]], 1)
    mask = torch.cat([last["prompt_mask"], last["completion_mask"]], 1)
    T, trained = last["completion_ids"].size(1), last["loss_mask"].bool()
    with torch.no_grad():
        base_logps = completion_logps(base, ids, mask, T)
        policy_logps = completion_logps(t.model.eval(), ids, mask, T)
    torch.testing.assert_close(last["ref_logps"][trained], base_logps[trained], atol=1e-5, rtol=0)
    assert (policy_logps - base_logps)[trained].abs().max() > 1e-3  # the adapter moved the policy away from it


def test_generator_error_reaches_the_trainer_within_seconds(tiny_model_path, tmp_path):
    calls = []

    def flaky_reward(prompts, completions, completion_ids, **kw):
        calls.append(1)
        if len(calls) >= 2:
            raise ZeroDivisionError("scoring service down")
        return [0.0] * len(completions)

    t = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=flaky_reward,
        args=_args(tmp_path, max_steps=10),
        train_dataset=make_dataset(64),
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="flaky_reward.*scoring service down"):
        t.train()
    assert time.monotonic() - start < 30
    assert not any(th.name == "grpo-async-generator" for th in threading.enumerate())


def test_bad_input_errors_at_construction(tiny_model_path, tmp_path):
    args = _args(tmp_path)
    with pytest.raises(ValueError, match="needs a 'prompt' column"):
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=args,
            train_dataset=Dataset.from_dict({"question": ["a"] * 8}),
        )
    with pytest.raises(ValueError, match="has 3 prompts but one generation round needs 4"):
        GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(3))
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.pad_token = None
    tok.eos_token = None  # without a pad token the EOS token pads (TRL); without either, nothing can
    with pytest.raises(ValueError, match="neither a pad token nor an EOS token"):
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=args,
            train_dataset=make_dataset(64),
            processing_class=tok,
        )
    # a string is a reward model's id or path (TRL): a name that is neither says so at once, offline
    with pytest.raises(
        OSError, match="reward model 'accuracy' is not a local folder and not in the Hugging Face cache"
    ):
        GRPOTrainer(model=tiny_model_path, reward_funcs="accuracy", args=args, train_dataset=make_dataset(64))
    with pytest.raises(TypeError, match=r"reward_funcs\[0\] is a int"):
        GRPOTrainer(model=tiny_model_path, reward_funcs=3, args=args, train_dataset=make_dataset(64))
    with pytest.raises(ValueError, match="reward_weights has 2 values for 1"):
        GRPOTrainer(
            model=tiny_model_path,
            reward_funcs=letter_reward,
            args=_args(tmp_path, reward_weights=[1.0, 2.0]),
            train_dataset=make_dataset(64),
        )


def test_reward_function_wrong_length_is_named(tiny_model_path, tmp_path):
    def short(prompts, completions, **kw):
        return [1.0]

    t = GRPOTrainer(model=tiny_model_path, reward_funcs=short, args=_args(tmp_path), train_dataset=make_dataset(64))
    with pytest.raises(RuntimeError, match="reward function 'short' returned 1 values for 16 completions"):
        t.train()


def test_evaluate_generates_once_and_leaves_training_alone(tiny_model_path, tmp_path):
    args = _args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, num_batches_ahead=1)
    t, seen = _recorded(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=args,
        train_dataset=make_dataset(64),
        eval_dataset=make_dataset(6, seed=1),
    )
    t.train()
    evals = [h for h in t.state.log_history if "eval_reward" in h]
    assert len(evals) == 2
    for key in ("eval_reward", "eval_reward_std", "eval_rewards/letter_reward", "eval_completions/mean_length"):
        assert key in evals[0]
    # training rounds kept their own weights and bookkeeping: staleness still bounded by num_batches_ahead,
    # and every trained round carries a training policy version (evaluation versions are negative)
    assert all(int(b["policy_version"].min()) >= 0 for b in seen.records)
    assert max(h.get("async/staleness_max", 0) for h in t.state.log_history) <= 1
    m = t.evaluate()
    assert m["eval_completions/mean_length"] > 0


def test_every_stage_runs_only_full_chunks_of_its_own_size(tiny_model_path, tmp_path):
    # 12 rows per process and round; ref 3 → 4 chunks of 3, old 6 → 2 chunks of 6 (main ran ref as 3,3,2,3,1)
    args = _args(
        tmp_path,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=3,
        num_generations=2,
        rollout_micro_batch_size=2,
        ref_logps_micro_batch_size=3,
        old_logps_micro_batch_size=6,
        beta=0.1,
        max_steps=2,
        top_k=5,  # a cut vocabulary: π_old's mass on it needs the consumer's pass (not the training forward's)
    )
    sizes = {"ref": [], "old": []}
    t, seen = _recorded(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))

    def counting(name, scorer):  # observes the rows of each forward pass the consumer asks for
        def score(ids, mask, T, *support):  # the old-logps stage also passes the sampler's kept sets
            sizes[name].append(ids.size(0))
            return scorer(ids, mask, T, *support)

        return score

    t.consumer.old_logps = counting("old", t.consumer.old_logps)
    t.consumer.ref_logps = counting("ref", t.consumer.ref_logps)
    t.train()
    assert sizes == {"ref": [3] * 8, "old": [6] * 4}  # 2 rounds
    logs = [h for h in t.state.log_history if "chunks/ref_logps" in h]
    assert [(h["chunks/ref_logps"], h["chunks/old_logps"], h["chunks/rollout"]) for h in logs] == [(4, 2, 6)] * 2


def test_on_micro_batch_sees_what_compute_loss_trains(tiny_model_path, tmp_path):
    """`GRPOCallback.on_micro_batch` is called with each micro-batch before `compute_loss` trains that very object:
    a user can inspect what is trained without subclassing the trainer."""
    from grpo_async import GRPOCallback

    events = []

    class Watch(GRPOCallback):
        def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
            events.append(("batch", id(micro_batch), state.global_step, len(micro_batch)))

    class Loss(GRPOTrainer):
        def compute_loss(self, model, inputs, *a, **k):
            events.append(("loss", id(inputs), self.state.global_step, len(inputs)))
            return super().compute_loss(model, inputs, *a, **k)

    t = Loss(
        model=tiny_model_path,
        reward_funcs=letter_reward,
        args=_args(tmp_path, max_steps=2),
        train_dataset=make_dataset(64),
        callbacks=[Watch()],
    )
    t.train()
    assert len(events) == 2 * 2 * 2  # 2 steps × GA 2 micro-batches, each seen then trained
    for seen, trained in zip(events[::2], events[1::2], strict=True):
        assert seen[0] == "batch" and trained[0] == "loss" and seen[1:] == trained[1:]
