"""Unbiased importance sampling under truncated sampling (top-k / top-p / min-p): the sampler's kept sets are
recorded (hf, in-process vLLM), travel with the rows, and the IS ratio compares the sampler with π_old renormalised
over them (`algo/sampling_support.py`, `pipeline/consumer.py`); the mismatch metrics `sampling/kl`,
`sampling/masked_fraction`, `sampling/logp_diff/*`.

The end-to-end runs train with learning rate 0 in float32, so the sampler and the trainer hold the same weights: the
ratio must be 1 with the replay and is the kept mass without it (the test that can fail)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_async import GRPOTrainer
from grpo_async.algo.logprobs import score_tokens
from grpo_async.algo.sampling_support import (
    NO_TOKEN,
    TruncationFilter,
    encode_support,
    log_kept_mass,
    pad_kept_sets,
)
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.generation.sampling_mask import SamplingMaskMismatch, SamplingMaskRecorder
from grpo_async.pipeline.checkpointing import load_rounds, save_rounds
from grpo_async.pipeline.join import cat_batches
from grpo_async.pipeline.rows import process_slice
from grpo_async.pipeline.types import MicroBatch, Round
from grpo_async.testing import push_state_dict, tiny_config

IS_MEAN = "sampling/importance_sampling_ratio/mean"


# ---------------------------------------------------------------------------------------------- the math
def test_log_kept_mass_worked_example():
    # π = [0.5, 0.3, 0.15, 0.05]; top_p = 0.8 keeps {0, 1}: mass 0.8, listed as kept ids or as the cut ids
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(3, 1)  # [3, 4]
    support = torch.tensor([[0, 1, NO_TOKEN], [-(2 + 2), -(3 + 2), NO_TOKEN], [NO_TOKEN] * 3])  # kept, cut, none
    torch.testing.assert_close(log_kept_mass(logits, support), torch.tensor([math.log(0.8), math.log(0.8), 0.0]))
    torch.testing.assert_close(log_kept_mass(logits, TruncationFilter(top_p=0.8)), torch.full((3,), math.log(0.8)))
    torch.testing.assert_close(log_kept_mass(logits, TruncationFilter(top_k=3)), torch.full((3,), math.log(0.95)))
    # min_p = 0.2: keep p ≥ 0.2 · 0.5 = 0.1 → {0, 1, 2}
    torch.testing.assert_close(log_kept_mass(logits, TruncationFilter(min_p=0.2)), torch.full((3,), math.log(0.95)))
    assert log_kept_mass(logits, TruncationFilter()).eq(0).all()


def test_encode_support_lists_the_shorter_side():
    kept = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert encode_support(kept) == [[0, 1], [-(4 + 2)], None]
    # both encodings give the same mass
    logits = torch.randn(2, 5)
    enc = pad_kept_sets([encode_support(kept[:2])], 2)[0]  # [2, K]
    ref = torch.stack([torch.logsumexp(logits[i][kept[i]], 0) - torch.logsumexp(logits[i], 0) for i in range(2)])
    torch.testing.assert_close(log_kept_mass(logits, enc), ref)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "k, p, banned",
    [(5, None, ()), (None, 0.8, ()), (7, 0.6, ()), (None, 0.95, ()), (None, 0.8, (3, 250)), (None, None, (7,))],
)
def test_truncation_filter_keeps_what_vllm_keeps(k, p, banned):
    """The trainer-side filter (servers' fallback) against vLLM's own top-k / top-p on the same logits; `banned`
    (a VLM's image placeholders, every request's `bad_words`) is cut first, as vLLM's bad-words processor does before
    the sampler's filters."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0)) * 3  # [16, V]
    kt = None if k is None else torch.full((16,), k, dtype=torch.long)
    pt = None if p is None else torch.full((16,), p)
    processed = logits.clone()
    processed[:, list(banned)] = -torch.inf  # vLLM's bad words: before temperature, min-p, top-k, top-p
    vllm_kept = torch.isfinite(apply_top_k_top_p(processed, kt, pt))  # [16, V]
    ours = TruncationFilter(top_k=k or 0, top_p=1.0 if p is None else p, banned=banned)
    assert torch.equal(ours.kept(logits), vllm_kept)
    assert ours.cuts == bool(k or p or banned) and ours.samples_a_cut == bool(k or p)


def test_score_tokens_mass_is_the_same_on_every_path(tiny_model_path):
    """π's log-mass on the kept sets from the padded forward, the packed one and by hand from full logits."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    V, T, g = model.config.vocab_size, 3, torch.Generator().manual_seed(1)
    ids = torch.randint(4, V, (3, 5), generator=g)  # [3, P+T], P = 2
    mask = torch.ones_like(ids)
    mask[0, 0] = 0  # a left-padded prompt
    mask[2, -1] = 0  # a shorter completion
    rows = [[[1, 5, 7], None, [-(3 + 2)]], [None, None, None], [[4, 9], [2, 3, 8, 11], None]]
    support = pad_kept_sets(rows, T)  # [3, T, K]
    with torch.no_grad():
        padded = score_tokens(model, ids, mask, T, temperature=0.7, support=support)
        packed = score_tokens(model, ids, mask, T, temperature=0.7, padding_free=True, support=support)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -T - 1 : -1] / 0.7
    expected = torch.zeros(3, T)
    for i, row in enumerate(rows):
        for t, s in enumerate(row):
            if s is not None and mask[i, -T + t]:
                keep = torch.zeros(V, dtype=torch.bool)
                if s[0] >= 0:
                    keep[s] = True
                else:
                    keep[:] = True
                    keep[[-j - 2 for j in s]] = False
                expected[i, t] = torch.logsumexp(logits[i, t][keep], 0) - torch.logsumexp(logits[i, t], 0)
    real = mask[:, -T:].bool()
    torch.testing.assert_close(padded.log_kept_mass[real], expected[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed.log_kept_mass[real], expected[real], atol=1e-5, rtol=1e-5)
    assert (padded.log_kept_mass[1] == 0).all()  # no cut recorded: the whole vocabulary


# ---------------------------------------------------------------------------------------------- the rows
def _rows(R: int, T: int, masks: list | None) -> MicroBatch:
    return MicroBatch(
        prompt_ids=torch.ones(R, 2, dtype=torch.long),
        prompt_mask=torch.ones(R, 2, dtype=torch.long),
        completion_ids=torch.ones(R, T, dtype=torch.long),
        completion_mask=torch.ones(R, T, dtype=torch.long),
        loss_mask=torch.ones(R, T, dtype=torch.long),
        rollout_logps=torch.zeros(R, T),
        advantages=torch.zeros(R),
        policy_version=torch.zeros(R, dtype=torch.long),
        round_id=torch.zeros(R, dtype=torch.long),
        row_index=torch.arange(R),
        sampling_mask=None if masks is None else pad_kept_sets(masks, T),
        support_known=torch.ones(R, dtype=torch.bool),
    )


def test_kept_sets_travel_with_their_rows(tmp_path):
    """Slicing per process, joining parts with and without cuts (stream rounds), trimming, and a checkpoint's
    in-flight rounds keep each row's sets at its own positions."""
    a = _rows(4, 3, [[[1, 2], None, None], None, [None, [5], None], [[7, 8, 9], None, [3]]])
    b = _rows(2, 2, None)  # a part whose sampler cut nothing
    joined = cat_batches([a, b], pad_token_id=0)
    assert joined.sampling_mask.shape == (6, 3, 3)
    assert joined.sampling_mask[3, 0].tolist() == [7, 8, 9] and joined.sampling_mask[2, 1].tolist() == [5, -1, -1]
    assert (joined.sampling_mask[4:] == NO_TOKEN).all() and joined.support_known.all()
    rank1 = joined.select(process_slice(6, 2, 1))  # rows 3, 4, 5
    assert rank1.sampling_mask[0, 0].tolist() == [7, 8, 9]
    trimmed = joined.select(torch.tensor([2, 4])).trim()  # the widest set left is 1 id
    assert trimmed.sampling_mask.shape == (2, 3, 1) and trimmed.sampling_mask[0, 1].tolist() == [5]
    assert joined.select(torch.tensor([4, 5])).trim().sampling_mask is None  # no cut left: nothing to carry
    described = save_rounds(str(tmp_path), [Round(7, 0, joined)])
    (back,) = load_rounds(str(tmp_path), described)
    assert torch.equal(back.batch.sampling_mask, joined.sampling_mask)
    assert torch.equal(back.batch.support_known, joined.support_known)


def test_recorder_refuses_a_record_that_is_not_the_completion():
    """The vLLM sampler hook's record is checked token by token against the completion it is taken for."""
    rec = SamplingMaskRecorder()
    processed = torch.tensor([[0.0, -1.0, -torch.inf], [0.0, -1.0, -2.0]])  # [2 requests, V = 3]
    rec._record(["3-ab12", "0_4-cd34"], torch.tensor([1, 2]), processed)
    rec._record(["3-ab12", "0_4-cd34"], torch.tensor([0, 2]), processed)
    assert rec.take("3", [1, 0]) == [[-(2 + 2)], [-(2 + 2)]]  # token 2 cut (fewer ids than the kept 0, 1)
    with pytest.raises(SamplingMaskMismatch, match="recorded tokens"):
        rec.take("4", [2, 1], index=0)
    assert rec.take("5", [1]) is None  # nothing recorded: unknown, not an error
    assert rec.pending() == 0


# ---------------------------------------------------------------------------------------------- end to end
def _train(path, tmp_path, backend: str, **overrides) -> tuple[GRPOTrainer, list[dict]]:
    args = tiny_config(
        tmp_path / "out",
        learning_rate=0.0,  # sampler and trainer hold the same weights: any IS bias is the cut's
        max_steps=2,
        generation_backend=backend,
        **({"vllm_max_model_length": 128} if backend == "vllm" else {}),
        **overrides,
    )
    t = GRPOTrainer(model=path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    try:
        t.train()
    finally:
        t.close()
    return t, [h for h in t.state.log_history if IS_MEAN in h]


@pytest.mark.parametrize("cut", [{"top_p": 0.8}, {"top_k": 5}, {"min_p": 0.3}])
def test_hf_ratio_is_one_under_truncated_sampling(tiny_model_path, tmp_path, cut):
    _, logs = _train(tiny_model_path, tmp_path / "replay", "hf", **cut)
    assert logs and all(abs(h[IS_MEAN] - 1.0) <= 0.01 for h in logs), [h[IS_MEAN] for h in logs]
    assert all(h["sampling/support_exact"] == 1.0 for h in logs)
    if "min_p" in cut:
        return
    _, biased = _train(tiny_model_path, tmp_path / "plain", "hf", importance_sampling_support_replay=False, **cut)
    assert all(h[IS_MEAN] < 0.6 for h in biased), [h[IS_MEAN] for h in biased]  # the kept mass, ~0.8 per token


@pytest.mark.vllm
@pytest.mark.parametrize(
    "mode, cut", [("rounds", {"top_p": 0.8}), ("rounds", {"top_k": 5, "min_p": 0.1}), ("stream", {"top_p": 0.8})]
)
def test_vllm_ratio_is_one_under_truncated_sampling(tiny_model_path, tmp_path, mode, cut):
    """The in-process engine: its sampler's kept sets (recorded by the hook) reach the IS ratio, in rounds mode and
    through the engine loop of stream mode with in-flight weight loads."""
    stream = {"async_mode": "stream", "weight_sync_inflight": True} if mode == "stream" else {}
    _, logs = _train(tiny_model_path, tmp_path / "replay", "vllm", **cut, **stream)
    assert logs and all(abs(h[IS_MEAN] - 1.0) <= 0.01 for h in logs), [h[IS_MEAN] for h in logs]
    assert all(h["sampling/support_exact"] == 1.0 for h in logs)
    if mode == "rounds" and "top_p" in cut:
        _, biased = _train(
            tiny_model_path, tmp_path / "plain", "vllm", importance_sampling_support_replay=False, **cut
        )
        assert all(h[IS_MEAN] < 0.6 for h in biased), [h[IS_MEAN] for h in biased]


def test_mismatch_metrics_are_zero_when_weights_match_and_positive_when_not(tiny_model_path, tmp_path):
    """hf, float32, identical weights: sampling/kl and sampling/logp_diff/max are ~0; with one weight of the engine
    perturbed (and no weight sync to undo it) they are positive. Every metric is in metrics.jsonl."""
    t, logs = _train(tiny_model_path, tmp_path / "same", "hf", top_p=0.9)
    for h in logs:
        assert h["sampling/kl"] < 1e-6 and h["sampling/logp_diff/max"] < 1e-5, h
    lines = [json.loads(x) for x in (tmp_path / "same" / "out" / "metrics.jsonl").read_text().splitlines()]
    names = (
        "sampling/kl",
        "sampling/masked_fraction",
        "sampling/logp_diff/mean",
        "sampling/logp_diff/max",
        "sampling/support_exact",
        IS_MEAN,
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/max",
    )
    train_lines = [r for r in lines if IS_MEAN in r]
    assert len(train_lines) == 2 and all(n in r for r in train_lines for n in names)

    args = tiny_config(
        tmp_path / "moved" / "out",
        learning_rate=0.0,
        max_steps=2,
        top_p=0.9,
        weight_sync_transport="none",  # the engine keeps what is pushed below
        importance_sampling_clip_min=0.95,
        importance_sampling_clip_max=1.05,
    )
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    state = {k: v.clone() for k, v in t.model.state_dict().items()}
    state["lm_head.weight"] += 0.5 * torch.randn_like(state["lm_head.weight"])
    push_state_dict(t.engine.get(), state, 0)
    try:
        t.train()
    finally:
        t.close()
    moved = [h for h in t.state.log_history if IS_MEAN in h]
    for h in moved:
        assert h["sampling/kl"] > 1e-3 and h["sampling/logp_diff/max"] > 1e-2, h
        assert h["sampling/masked_fraction"] > 0  # sequence_mask: completions whose ratio left [0.95, 1.05] zeroed


@pytest.mark.vllm
def test_a_server_falls_back_to_the_trainers_filter(tiny_model_path, tiny_server, tmp_path, caplog):
    """`grpo-async serve` does not report its sampler's kept sets: the consumer says so once, applies the same
    top_p to π_old (exact here: the server holds the trainer's weights) and logs `sampling/support_exact` 0."""
    from vllm_utils import API_KEY

    server = {"vllm_server_urls": [tiny_server.url], "vllm_api_key": API_KEY}
    with caplog.at_level("WARNING", logger="grpo_async.pipeline.consumer"):
        _, logs = _train(tiny_model_path, tmp_path / "replay", "vllm_server", top_p=0.8, **server)
    assert logs and all(abs(h[IS_MEAN] - 1.0) <= 0.01 for h in logs), [h[IS_MEAN] for h in logs]
    assert all(h["sampling/support_exact"] == 0.0 for h in logs)
    warned = [r for r in caplog.records if "does not report the tokens its sampler kept" in r.getMessage()]
    assert len(warned) == 1
    _, biased = _train(
        tiny_model_path,
        tmp_path / "plain",
        "vllm_server",
        top_p=0.8,
        importance_sampling_support_replay=False,
        **server,
    )
    assert all(h[IS_MEAN] < 0.6 for h in biased), [h[IS_MEAN] for h in biased]
