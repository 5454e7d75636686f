"""Issue 43: TRL behaviours a drop-in user meets, on the real trainer (tiny model, hf backend): `generation_kwargs`
that cut the vocabulary, a round whose completions are all truncated with `mask_truncated_completions`, TRL's
`pad_to_multiple_of`, TRL's errors and warnings word for word, and TRL's overridable surface (`get_high_entropy_mask`
on a stand-in, the `_logs` buffer)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.algo.sampling_support import TruncationFilter
from grpo_async.demo_task import make_dataset
from grpo_async.testing import tiny_config

pytestmark = pytest.mark.slow


def _varied(completions, **kwargs):
    """A reward that differs between completions (its group std is never 0): the completion's text length."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) + 0.01 * i for i, c in enumerate(completions)]


def _train(tiny_model_path, out, dataset=None, reward=_varied, **overrides):
    args = tiny_config(out, **{"max_steps": 2, "learning_rate": 0.1, **overrides})
    t = GRPOTrainer(tiny_model_path, reward_funcs=reward, args=args, train_dataset=dataset or make_dataset(64))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    changed = [n for n, p in t.model.named_parameters() if not torch.equal(p, before[n])]
    return t, changed


def test_generation_kwargs_that_cut_the_vocabulary_train_with_unbiased_importance_weights(tiny_model_path, tmp_path):
    """TRL's `generation_kwargs={"do_sample": True, "top_k": ..., "length_penalty": ...}`: the run trains (every
    parameter moves) and the IS ratio stays 1 at the first step (sampler and trainer hold the same weights), because
    the sampler's kept sets are replayed; the servers' fallback filter takes the same override."""
    gk = {"do_sample": True, "top_k": 5, "length_penalty": -0.1}
    t, changed = _train(tiny_model_path, tmp_path, generation_kwargs=gk)
    first = t.state.log_history[0]
    t.close()
    assert len(changed) == len(list(t.model.parameters())), "some parameters did not move"
    assert first["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
    assert first["sampling/support_exact"] == 1.0
    filt = TruncationFilter.from_config(tiny_config(tmp_path, top_k=0, top_p=0.9, generation_kwargs={"top_k": 7}))
    assert (filt.top_k, filt.top_p) == (7, 0.9)
    config = tiny_config(tmp_path, top_p=0.9, generation_kwargs={"top_p": 0.5, "min_p": 0.1})
    filt = TruncationFilter.from_config(config)
    assert (filt.top_k, filt.top_p, filt.min_p) == (0, 0.5, 0.1)


def test_all_completions_truncated_and_masked_trains_nothing_and_does_not_fail(tiny_model_path, tmp_path):
    """TRL's `mask_truncated_completions=True` when no completion ends (EOS forbidden before the length limit): the
    run completes, logs a train loss, and no parameter moves (no token is trained); the same run without the mask
    trains."""
    kw = {"generation_kwargs": {"min_new_tokens": 8}, "max_completion_length": 8}
    t, changed = _train(tiny_model_path, tmp_path / "masked", mask_truncated_completions=True, **kw)
    logs = t.state.log_history
    t.close()
    assert all(h["completions/clipped_ratio"] == 1.0 for h in logs if "loss" in h)
    assert logs[-1]["train_loss"] is not None and changed == []
    t, changed = _train(tiny_model_path, tmp_path / "unmasked", mask_truncated_completions=False, **kw)
    t.close()
    assert changed, "without the mask the same truncated completions must train"


def test_pad_to_multiple_of_pads_the_trained_micro_batches_and_trains_the_same(tiny_model_path, tmp_path):
    """TRL's `pad_to_multiple_of`: every micro-batch the loss sees has prompt and completion widths that are
    multiples of it; the losses equal an unpadded run's (padding is masked)."""
    from recording import recorded_trainer

    runs = {}
    for pad in (None, 16):
        args = tiny_config(tmp_path / str(pad), max_steps=2, pad_to_multiple_of=pad, padding_free=False)
        t, batches = recorded_trainer(tiny_model_path, _varied, args=args, train_dataset=make_dataset(64))
        t.train()
        runs[pad] = ([h["loss"] for h in t.state.log_history if "loss" in h], batches)
        t.close()
    assert all(b["prompt_ids"].size(1) % 16 == 0 and b["completion_ids"].size(1) % 16 == 0 for b in runs[16][1])
    assert any(b["completion_ids"].size(1) % 16 for b in runs[None][1])  # the check can fail: unpadded widths vary
    assert runs[16][0] == pytest.approx(runs[None][0], rel=1e-5, abs=1e-7)
    with pytest.raises(ValueError, match="pad_to_multiple_of: must be an int >= 1"):
        tiny_config(tmp_path, pad_to_multiple_of=0)


def test_trls_errors_and_warnings_word_for_word(tiny_model_path, tmp_path, caplog):
    """No train set and no environment: TRL's ValueError at construction. Every reward None for a completion: TRL's
    warning text. A sequence-level IS ratio with a token-summed loss: TRL's warning (a `UserWarning` from
    `GRPOConfig`, where TRL logs it from the trainer)."""
    with pytest.raises(
        ValueError, match=r"^`train_dataset` is required unless an `environment_factory` is provided\.$"
    ):
        GRPOTrainer(tiny_model_path, reward_funcs=_varied, args=tiny_config(tmp_path))

    def none_reward(completions, **kwargs):
        return [None] * len(completions)

    with caplog.at_level(logging.WARNING):
        t, _ = _train(tiny_model_path, tmp_path / "none", reward=[none_reward, _varied], max_steps=1)
        t.close()
    assert "All reward functions returned None" not in caplog.text  # _varied scores every completion
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        t, _ = _train(tiny_model_path, tmp_path / "none2", reward=none_reward, max_steps=1)
        t.close()
    assert "All reward functions returned None for the following kwargs:\n{'prompt':" in caplog.text
    assert "Please ensure that at least one reward function returns a valid reward." in caplog.text
    with pytest.warns(UserWarning, match="weights each sequence by its completion length"):  # TRL's words, at
        GRPOConfig(**vars_of(tiny_config(tmp_path)), importance_sampling_level="sequence", loss_type="dapo")  # config


def vars_of(config) -> dict:
    return {"output_dir": config.output_dir, "use_cpu": True, "report_to": [], "num_generations": 4}


def test_get_high_entropy_mask_runs_on_a_stand_in_with_an_accelerator_as_in_trl(tiny_model_path, tmp_path):
    """TRL's tests call `GRPOTrainer.get_high_entropy_mask` on a stand-in object that has only an `accelerator`:
    it works there, and gives what the trainer's own gives."""
    entropies = torch.tensor([[0.1, 0.5, 0.9, 2.0], [1.0, 0.2, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    stand_in = SimpleNamespace(accelerator=Accelerator(cpu=True))
    got = GRPOTrainer.get_high_entropy_mask(stand_in, entropies, mask, 0.5)
    t = GRPOTrainer(tiny_model_path, reward_funcs=_varied, args=tiny_config(tmp_path), train_dataset=make_dataset(8))
    assert torch.equal(got, t.get_high_entropy_mask(entropies, mask, 0.5))
    t.close()
    assert got.tolist() == [[False, True, True, False], [True, False, True, False]]  # >= the median, 0.3


def test_logs_buffer_holds_the_newest_rounds_samples_and_log_extra_columns(tiny_model_path, tmp_path):
    """TRL's `_logs`: after training it holds the newest round's prompts, completions, per-function rewards,
    advantages and the columns reward functions logged with `log_extra`."""

    def tagged(completions, log_extra=None, **kwargs):
        log_extra("tag", [f"c{i}" for i in range(len(completions))])
        return _varied(completions)

    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"say {c}"}] for c in "abcdefgh"] * 4})
    t, _ = _train(tiny_model_path, tmp_path, dataset=ds, reward=tagged, max_steps=1)
    logs = t._logs
    t.close()
    n = len(logs["prompt"])
    assert n == 16 and len(logs["completion"]) == n and len(logs["advantages"]) == n
    assert list(logs["rewards"]) == ["tagged"] and len(logs["rewards"]["tagged"]) == n
    assert logs["extra"]["tag"][:2] == ["c0", "c1"]


def test_generate_is_trls_rollout_dispatch_and_an_override_generates_every_round(tiny_model_path, tmp_path):
    """TRL's `_generate(prompts)`: called directly it returns TRL's 8-tuple from the trainer's backend; a subclass
    that overrides it (here: TRL's habit of calling super and adding an extra field) generates every training round,
    and its extra field reaches the reward functions as a column."""
    seen_columns = []

    def reward(completions, origin=None, **kwargs):
        seen_columns.append(origin)
        return _varied(completions)

    class Overridden(GRPOTrainer):
        calls = 0

        def _generate(self, prompts):
            Overridden.calls += 1
            prompt_ids, ids, tool_mask, completions, logprobs, extra, images, tool_images = super()._generate(prompts)
            return prompt_ids, ids, tool_mask, completions, logprobs, {"origin": ["mine"] * len(ids)}, images, None

    args = tiny_config(tmp_path, max_steps=2)
    t = Overridden(tiny_model_path, reward_funcs=reward, args=args, train_dataset=make_dataset(64))
    prompts = [[{"role": "user", "content": "hi"}]] * 3
    prompt_ids, ids, tool_mask, completions, logprobs, extra, images, tool_images = GRPOTrainer._generate(t, prompts)
    assert len(prompt_ids) == len(ids) == len(completions) == len(logprobs) == 3 and tool_mask is None
    assert all(len(lp) == len(c) for lp, c in zip(logprobs, ids)) and completions[0][0]["role"] == "assistant"
    t.train()
    t.close()
    rounds = t.state.global_step * args.gradient_accumulation_steps // args.steps_per_generation
    assert Overridden.calls == rounds >= 1
    assert seen_columns and all(c == ["mine"] * len(c) for c in seen_columns)
