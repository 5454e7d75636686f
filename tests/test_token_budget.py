"""Token-budget micro-batches (`GRPOConfig.token_budget`, `grpo_async.algo.token_budget`): hand-worked slicing, the
error naming `token_budget`, the trainer's loss and gradients over budget slices equal to the micro-batch in one pass
(every loss type, ≤ 1e-6), the logps stages chunked by tokens, and a short run logging the same losses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_async.algo.logprobs import LogpsScorer
from grpo_async.algo.loss import LOSS_TYPES, LossSettings
from grpo_async.algo.objective import SingleProcess
from grpo_async.algo.packing import packed_positions
from grpo_async.algo.token_budget import budget_slices
from grpo_async.pipeline.consumer import ConsumerSettings, RoundConsumer
from grpo_async.pipeline.types import MicroBatch, Round


def test_budget_slices_hand_worked():
    # 120 + 90 = 210 ≤ 256, + 200 > 256 → cut; 200 alone; 60 + 60 + 30 = 150
    assert budget_slices([120, 90, 200, 60, 60, 30], 256) == [slice(0, 2), slice(2, 3), slice(3, 6)]
    assert budget_slices([5, 5, 5], 10) == [slice(0, 2), slice(2, 3)]
    assert budget_slices([], 10) == []


def test_budget_slices_count_the_filler_of_the_packed_bins():
    # [10, 6, 6, 6] holds 28 real tokens but packs into bins of 10: [10] [6] [6] [6], 40 positions > 28
    assert packed_positions([10, 6, 6, 6]) == 40
    assert budget_slices([10, 6, 6, 6], 28) == [slice(0, 2), slice(2, 4)]  # [10] [6]: 20; [6] [6]: 12
    # [6, 6, 9] packs as [9] [6] [6] = 27 ≤ 28; with a 4 it needs a fourth bin of 9 (36); the last four 4 × 4 = 16
    lengths = [10, 6, 6, 6, 9, 4, 4, 4, 4]
    assert budget_slices(lengths, 28) == [slice(0, 2), slice(2, 5), slice(5, 9)]
    assert all(packed_positions(lengths[s]) <= 28 for s in budget_slices(lengths, 28))


def test_a_row_longer_than_the_budget_names_token_budget():
    with pytest.raises(ValueError, match=r"token_budget=100: row 1 holds 150 tokens .* at least 150"):
        budget_slices([50, 150, 20], 100)


def _micro_batch(vocab: int, B: int = 8, P: int = 10, T: int = 12, seed: int = 0) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(3, P + 1, (B,), generator=g)
    c_len = torch.randint(1, T + 1, (B,), generator=g)
    prompt_mask = (torch.arange(P) >= P - p_len[:, None]).long()  # [B, P] left-padded
    completion_mask = (torch.arange(T) < c_len[:, None]).long()  # [B, T] right-padded
    loss_mask = completion_mask.clone()
    loss_mask[0, :2] = 0  # e.g. environment tokens: attended, not trained
    logps = -torch.rand(B, T, generator=g) * 3
    return MicroBatch(
        prompt_ids=torch.randint(3, vocab, (B, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(3, vocab, (B, T), generator=g) * completion_mask,
        completion_mask=completion_mask,
        loss_mask=loss_mask,
        rollout_logps=logps,
        advantages=torch.randn(B, generator=g),
        policy_version=torch.zeros(B, dtype=torch.long),
        round_id=torch.zeros(B, dtype=torch.long),
        row_index=torch.arange(B),
        old_logps=logps + 0.05 * torch.randn(B, T, generator=g),
        ref_logps=logps + 0.1 * torch.randn(B, T, generator=g),
        num_items_in_batch=float(loss_mask.sum()) * 2,  # the round: this micro-batch and another like it
    )


@pytest.fixture(scope="module")
def trainer(tiny_model_path, tmp_path_factory):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    out = tmp_path_factory.mktemp("budget")
    args = tiny_config(out, beta=0.04, entropy_coef=0.01, max_completion_length=12, shuffle_dataset=False)
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(16))
    t.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # as the HF training loop sets it
    yield t
    t.close()


def _loss_and_grads(trainer, batch: MicroBatch, budget: int | None):
    """`trainer.compute_loss` (which backpropagates every slice but the last) then the backward pass the HF Trainer
    runs on what it returns: the loss value and the accumulated gradients."""
    model = trainer.model
    model.zero_grad()
    trainer.args.token_budget = budget
    try:
        loss = trainer.compute_loss(model, batch)
        trainer.accelerator.backward(loss)
    finally:
        trainer.args.token_budget = None
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_budget_slices_give_the_row_based_loss_and_gradients(trainer, loss_type):
    trainer.objective.settings = dataclasses.replace(LossSettings.from_config(trainer.args), loss_type=loss_type)
    batch = _micro_batch(trainer.model.config.vocab_size)
    tokens = (batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)).tolist()
    budget = max(tokens) + 2  # a few rows per slice
    assert len(budget_slices(tokens, budget)) >= 3
    whole, grads_whole = _loss_and_grads(trainer, batch, None)
    sliced, grads_sliced = _loss_and_grads(trainer, batch, budget)
    assert abs(whole - sliced) <= 1e-6
    assert grads_whole.keys() == grads_sliced.keys() and grads_whole
    for name, grad in grads_whole.items():
        assert (grad - grads_sliced[name]).abs().max().item() <= 1e-6, name


def _rows_of_lengths(vocab: int, lengths: list[int], prompt: int = 3, seed: int = 0) -> MicroBatch:
    """Rows of `lengths` real tokens each (`prompt` of them the prompt; distinct prompts: nothing to share)."""
    base = _micro_batch(vocab, B=len(lengths), P=prompt, T=max(lengths) - prompt, seed=seed)
    completion_mask = (torch.arange(max(lengths) - prompt) < torch.tensor(lengths)[:, None] - prompt).long()
    prompt_mask = torch.ones(len(lengths), prompt, dtype=torch.long)
    return dataclasses.replace(
        base,
        prompt_ids=torch.arange(len(lengths))[:, None] * prompt + torch.arange(3, 3 + prompt),  # [B, P] distinct
        prompt_mask=prompt_mask,
        completion_ids=base.completion_ids.clamp(min=3) * completion_mask,
        completion_mask=completion_mask,
        loss_mask=completion_mask.clone(),
        num_items_in_batch=float(completion_mask.sum()),
    )


def _consumer(settings_budget, scorer, logged, steps_per_generation=1, old_size=9, ref_size=9):
    """A `RoundConsumer` scoring both logps stages with `scorer`, logging into `logged` (metric → values)."""
    settings = ConsumerSettings(
        steps_per_generation=steps_per_generation,
        old_logps_micro_batch_size=old_size,
        ref_logps_micro_batch_size=ref_size,
        staleness_limit=None,
        importance_sampling_correction=False,
        importance_sampling_mode="token_truncate",
        importance_sampling_clip_min=None,
        importance_sampling_clip_max=None,
        seed=0,
        token_budget=settings_budget,
    )
    log = lambda k, v: logged.setdefault(k, []).append(v)  # noqa: E731
    old = lambda ids, mask, T, support: (scorer(ids, mask, T), None)  # noqa: E731 - no kept sets: nothing was cut
    return RoundConsumer(settings, collectives=SingleProcess(), old_logps=old, ref_logps=scorer, log=log)


def test_every_forward_pass_holds_at_most_the_budget_positions(trainer):
    """The trainer's training slices and the consumer's logps passes, measured at the model's input: every packed
    `[K, W]` holds at most `token_budget` positions, filler included. Rows of 10, 6, 6, 6 real tokens (28, the
    budget) used to run as one pass of 4 bins of 10 = 40 positions."""
    lengths, budget = [10, 6, 6, 6, 9, 4, 4, 4, 4], 28
    batch = _rows_of_lengths(trainer.model.config.vocab_size, lengths)
    assert (batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)).tolist() == lengths
    _loss_and_grads(trainer, batch, None)  # first calls probe the model once (packed isolation, prefix sharing)
    passes = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        whole, grads_whole = _loss_and_grads(trainer, batch, None)
        assert passes == [packed_positions(lengths)] == [60]  # one pass: [10] [9] [6 4] [6 4] [6 4] [4]
        passes.clear()
        sliced, grads_sliced = _loss_and_grads(trainer, batch, budget)
        assert passes == [20, 27, 16]  # [10] [6]; [9] [6] [6]; [4] [4] [4] [4]
        passes.clear()
        scorer = LogpsScorer(
            lambda: trainer.model, temperature=1.0, padding_free=True, device="cpu", max_positions=budget
        )
        logged = {}
        raw = dataclasses.replace(batch, old_logps=None, ref_logps=None)  # what the consumer scores
        _consumer(budget, scorer, logged)(Round(round_id=0, policy_version=0, batch=raw), step=0)
        assert logged["chunks/old_logps"] == [3.0] == logged["chunks/ref_logps"]
        assert passes == [20, 27, 16] * 2  # old logps, then ref logps
    finally:
        hook.remove()
    assert abs(whole - sliced) <= 1e-6
    for name, grad in grads_whole.items():
        assert (grad - grads_sliced[name]).abs().max().item() <= 1e-6, name


def test_the_logps_stages_run_in_token_budget_chunks(trainer):
    batch = _micro_batch(trainer.model.config.vocab_size, B=8, seed=3)
    scorer = LogpsScorer(lambda: trainer.model, temperature=1.0, padding_free=True, device="cpu")
    tokens = (batch.prompt_mask.sum(1) + batch.completion_mask.sum(1)).tolist()
    budget = 2 * max(tokens)

    def consume(token_budget):
        logged = {}
        consumer = _consumer(token_budget, scorer, logged, steps_per_generation=2, old_size=8, ref_size=1)
        raw = MicroBatch(**{**vars(batch), "old_logps": None, "ref_logps": None})
        parts = consumer(Round(round_id=0, policy_version=0, batch=raw), step=0)
        order = torch.cat([p.row_index for p in parts]).argsort()
        T = batch.completion_ids.size(1)
        old = torch.cat([torch.nn.functional.pad(p.old_logps, (0, T - p.old_logps.size(1))) for p in parts])[order]
        return old, logged

    rows_based, logged_rows = consume(None)
    budgeted, logged_budget = consume(budget)
    assert logged_rows["chunks/old_logps"] == [1.0] and logged_rows["chunks/ref_logps"] == [8.0]
    expected = float(len(budget_slices(tokens, budget)))
    assert logged_budget["chunks/old_logps"] == [expected] == logged_budget["chunks/ref_logps"] and 1 < expected < 8
    mask = batch.completion_mask.bool()
    assert (rows_based - budgeted)[mask].abs().max().item() <= 1e-5


def test_a_run_with_a_token_budget_logs_the_row_based_losses(tiny_model_path, tmp_path):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    def run(out, budget):
        args = tiny_config(out, max_steps=2, seeded_generation=True, shuffle_dataset=False, token_budget=budget)
        t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
        try:
            t.train()
        finally:
            t.close()
        return [h["loss"] for h in t.state.log_history if "loss" in h]

    rows_based = run(tmp_path / "rows", None)
    budgeted = run(tmp_path / "budget", 64)  # a micro-batch of 8 rows of up to ~25 tokens: 3 to 4 slices
    assert len(rows_based) == 2
    for a, b in zip(rows_based, budgeted, strict=True):
        assert abs(a - b) <= 1e-5, (rows_based, budgeted)
