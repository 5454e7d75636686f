"""Advantages and losses: hand-worked values, and TRL 1.16's own `_compute_loss` on identical inputs."""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer as TRLGRPOTrainer

from grpo_async import compute_advantages
from grpo_async.algo.advantages import combine_rewards
from grpo_async.algo.loss import IS_MODES, LossContext, grpo_loss, importance_sampling_weights, k3_kl


# ---------------------------------------------------------------------------------------------- advantages
def test_group_advantages_hand_worked():
    # groups [1, 0] and [1, 1]: means 0.5 and 1; unbiased stds sqrt(0.5)=0.70711 and 0
    adv = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, "group")
    s = math.sqrt(0.5) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([0.5 / s, -0.5 / s, 0.0, 0.0]))


def test_batch_and_none_scaling_hand_worked():
    r = torch.tensor([1.0, 0.0, 3.0, 1.0])  # group means 0.5, 2 → centred [0.5, -0.5, 1, -1]
    torch.testing.assert_close(compute_advantages(r, 2, "none"), torch.tensor([0.5, -0.5, 1.0, -1.0]))
    batch_std = torch.tensor([1.0, 0.0, 3.0, 1.0]).std().item()  # unbiased: sqrt(11/4 / 3 * 4 / 4)...
    expected = torch.tensor([0.5, -0.5, 1.0, -1.0]) / (batch_std + 1e-4)
    torch.testing.assert_close(compute_advantages(r, 2, "batch"), expected)


def test_nan_rewards_get_zero_advantage_and_are_left_out_of_the_group():
    # group [nan, 1, 3]: mean over {1, 3} = 2, std = sqrt(2)
    adv = compute_advantages(torch.tensor([float("nan"), 1.0, 3.0]), 3, "group")
    s = math.sqrt(2) + 1e-4
    torch.testing.assert_close(adv, torch.tensor([0.0, -1 / s, 1 / s]))


def test_combine_rewards_keeps_unscorable_rows_nan():
    table = torch.tensor([[1.0, float("nan")], [float("nan"), float("nan")], [0.5, 2.0]])
    out = combine_rewards(table, torch.tensor([1.0, 0.5]))
    assert out[0].item() == 1.0 and math.isnan(out[1].item()) and out[2].item() == 1.5


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="not a multiple of num_generations=3"):
        compute_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(torch.zeros(4), 2, "std")


# ---------------------------------------------------------------------------------------------- loss, by hand
def test_clipped_surrogate_hand_worked():
    # one token, A = +1, ratio e^{0.5} = 1.6487 > 1 + 0.2 → clipped to 1.2 → loss -1.2
    logp = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-0.5]])
    out = grpo_loss(logp, torch.tensor([1.0]), torch.ones(1, 1), loss_type="bnpo", old_per_token_logps=old)
    assert out.loss.item() == pytest.approx(-1.2)
    assert out.is_high_clipped.item() and not out.is_low_clipped.item()
    out.loss.backward()
    assert logp.grad.item() == 0.0  # clipped: no gradient
    # A = -1: min(-1.6487, -1.2) = -1.6487 → loss +1.6487 (the pessimistic side is not clipped)
    out = grpo_loss(logp.detach(), torch.tensor([-1.0]), torch.ones(1, 1), loss_type="bnpo", old_per_token_logps=old)
    assert out.loss.item() == pytest.approx(math.exp(0.5))


def test_reductions_hand_worked():
    # per-token loss with ratio 1: -A. Row 0: A=1, 2 tokens; row 1: A=-2, 1 token (mask).
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -2.0])
    ctx = LossContext(
        grad_accum_steps=2, max_completion_length=4, num_items_in_batch=6, num_processes=1, steps_per_generation=2
    )
    # grpo: seq means [-1, 2] → mean 0.5 → /GA 0.25
    assert grpo_loss(logp, adv, mask, loss_type="grpo", ctx=ctx).loss.item() == pytest.approx(0.25)
    # bnpo: (-1 -1 +2) / 3 tokens = 0 → 0
    assert grpo_loss(logp, adv, mask, loss_type="bnpo", ctx=ctx).loss.item() == pytest.approx(0.0)
    # dr_grpo: sum 0 / (2·4) → 0; use A=[1, 1]: sum -3 / 8 / 2 = -0.1875
    assert grpo_loss(logp, torch.ones(2), mask, loss_type="dr_grpo", ctx=ctx).loss.item() == pytest.approx(-0.1875)
    # dapo: sum -3 / (6 / 1 · 2 / 2) = -0.5
    assert grpo_loss(logp, torch.ones(2), mask, loss_type="dapo", ctx=ctx).loss.item() == pytest.approx(-0.5)


def test_k3_kl_hand_worked():
    # d = ref - logp = log 2 → e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853
    kl = k3_kl(torch.tensor([[0.0]]), torch.tensor([[math.log(2)]]))
    assert kl.item() == pytest.approx(0.306853, abs=1e-6)


def test_new_loss_types_hand_worked():
    from grpo_async.algo.loss import gamma_weights, off_policy_mask

    one = torch.ones(1, 1)
    # δ = 1.3 caps the ratio e^{0.5} = 1.6487 for A = -1: -min(-1.3, -1.2) = 1.3, and no gradient (capped)
    logp = torch.tensor([[0.0]], requires_grad=True)
    out = grpo_loss(logp, torch.tensor([-1.0]), one, loss_type="bnpo", old_per_token_logps=-0.5 * one, delta=1.3)
    assert out.loss.item() == pytest.approx(1.3)
    out.loss.backward()
    assert logp.grad.item() == 0.0
    # cispo: -sg[min(w, ε_high)]·A·logp; w = e^{0.5} capped at ε_high = 1.2, logp = -1, A = 2 → 2.4; d/dlogp = -2.4
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ctx = LossContext(num_items_in_batch=1)
    out = grpo_loss(
        logp, torch.tensor([2.0]), one, loss_type="cispo", old_per_token_logps=-1.5 * one, epsilon_high=1.2, ctx=ctx
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(2.4) and logp.grad.item() == pytest.approx(-2.4)
    assert out.cispo_clipped.item() and out.is_low_clipped is None
    # sapo on-policy: σ(0)·4/τ = 2/τ → loss -2A/τ; its slope at w = 1 is 1, so the gradient is -A (like plain PG)
    logp = torch.tensor([[-1.0]], requires_grad=True)
    out = grpo_loss(logp, torch.tensor([3.0]), one, loss_type="sapo", sapo_temperature_pos=0.5)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-12.0) and logp.grad.item() == pytest.approx(-3.0)
    # GSPO: w = exp(mean of the masked log-ratios) = exp((0.2 + 0.4) / 2), one per sequence
    logp, old = torch.zeros(1, 3), -torch.tensor([[0.2, 0.4, 9.0]])
    out = grpo_loss(
        logp,
        torch.ones(1),
        torch.tensor([[1, 1, 0]]),
        old_per_token_logps=old,
        importance_sampling_level="sequence",
        ctx=ctx,
    )
    assert out.ratio.shape == (1, 1) and out.ratio.item() == pytest.approx(math.exp(0.3))
    # luspo: a sequence's loss summed over its tokens: A = 1, on-policy, lengths 2 and 1 → (-2 - 1) / 2
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = grpo_loss(torch.zeros(2, 3), torch.ones(2), mask, loss_type="luspo", importance_sampling_level="sequence")
    assert out.loss.item() == pytest.approx(-1.5)
    # vespo: φ(1) = e^λ · 1^k · e^{-λ} = 1 on-policy; φ(e) = e^{λ + k - λe} for A ≥ 0 (k = 2, λ = 3)
    adv = torch.tensor([[1.0], [-1.0]])
    phi = gamma_weights(adv, torch.tensor([[0.0, 0.0], [0.5, 0.5]]), torch.ones(2, 2), None)
    assert phi[0].item() == pytest.approx(1.0) and phi[1].item() == pytest.approx(math.exp(2 + 3 - 2 * math.e))
    # off-policy mask: drop A < 0 rows whose mean log π_sampler − log π exceeds the threshold
    keep = off_policy_mask(
        torch.tensor([[-1.0], [-1.0], [1.0]]),
        torch.zeros(3, 2),
        torch.tensor([[0.3, 0.3], [0.05, 0.05], [0.3, 0.3]]),
        torch.ones(3, 2),
        0.1,
    )
    assert keep.squeeze(1).tolist() == [0.0, 1.0, 1.0]


def test_bias_corrected_kl_is_weighted_by_the_ratio():
    logp, old, ref = torch.zeros(1, 1), -0.5 * torch.ones(1, 1), torch.tensor([[math.log(2)]])
    kw = dict(old_per_token_logps=old, ref_per_token_logps=ref, beta=0.1, loss_type="bnpo")
    plain = grpo_loss(logp, torch.zeros(1), torch.ones(1, 1), use_bias_correction_kl=False, **kw).per_token_kl
    corrected = grpo_loss(logp, torch.zeros(1), torch.ones(1, 1), **kw).per_token_kl  # TRL's default: corrected
    assert plain.item() == pytest.approx(0.306853, abs=1e-6)
    assert corrected.item() == pytest.approx(0.306853 * math.exp(0.5), abs=1e-6)


def test_unknown_loss_knobs_are_refused():
    with pytest.raises(ValueError, match="Unknown loss_type 'ppo'"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), loss_type="ppo")
    with pytest.raises(ValueError, match="Unknown importance_sampling_level 'seq'"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), importance_sampling_level="seq")
    with pytest.raises(TypeError, match="epsilon"):
        grpo_loss(torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), epsilon=0.2)  # TRL's name is epsilon_low here


# ---------------------------------------------------------------------------------------------- TRL parity
def _trl_loss(loss_type, logps, inputs, beta, eps_low, eps_high, ga, spg, max_len, is_correction=False):
    """Run TRL 1.16's own GRPOTrainer._compute_loss; only its model forward and collectives are stood in for."""
    fake = SimpleNamespace(
        top_entropy_quantile=1.0,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        beta=beta,
        importance_sampling_level="token",
        off_policy_mask_threshold=None,
        use_vllm=is_correction,
        vllm_importance_sampling_correction=is_correction,
        current_gradient_accumulation_steps=ga,
        max_completion_length=max_len,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=True, steps_per_generation=spg),  # TRL's default
        # single process: reduce/gather are the identity
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )
    return TRLGRPOTrainer._compute_loss(fake, None, inputs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("with_old", [False, True])
def test_loss_matches_trl(loss_type, beta, with_old):
    g = torch.Generator().manual_seed(0)
    B, T, ga, spg, max_len = 4, 6, 2, 4, 8
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64) if with_old else None
    ref = logps + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 4:] = 0
    mask[2, 1:] = 0
    n_items = torch.tensor(37.0, dtype=torch.float64)
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": n_items,
    }
    ctx = LossContext(
        grad_accum_steps=ga,
        max_completion_length=max_len,
        num_items_in_batch=n_items,
        num_processes=1,
        steps_per_generation=spg,
    )
    ours = grpo_loss(
        logps,
        adv,
        mask,
        loss_type=loss_type,
        old_per_token_logps=old,
        ref_per_token_logps=ref,
        beta=beta,
        epsilon_low=0.2,
        epsilon_high=0.28,
        ctx=ctx,
    )
    theirs = _trl_loss(loss_type, logps, inputs, beta, 0.2, 0.28, ga, spg, max_len)
    torch.testing.assert_close(ours.loss, theirs, atol=1e-6, rtol=0)

    # per-token: with bnpo and a one-token mask, TRL's reduced loss is that token's loss / GA
    for i in range(B):
        for t in range(T):
            one = torch.zeros(B, T, dtype=torch.long)
            one[i, t] = 1
            theirs_t = _trl_loss("bnpo", logps, {**inputs, "completion_mask": one}, beta, 0.2, 0.28, ga, spg, max_len)
            torch.testing.assert_close(ours.per_token_loss[i, t] / ga, theirs_t, atol=1e-6, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_a_real_trl_trainer(tiny_model_path, tmp_path, scale):
    """TRL 1.16's GRPOTrainer computes advantages for rewards we choose (Nones included); ours must agree."""
    from datasets import Dataset
    from trl import GRPOConfig as TRLConfig

    given = []

    def reward(prompts, completions, **kw):
        g = torch.Generator().manual_seed(len(given))
        vals = torch.randint(0, 4, (len(completions),), generator=g).float().tolist()
        vals = [None if i % 7 == 3 else v for i, v in enumerate(vals)]  # some unscorable completions
        given.append(vals)
        return vals

    captured = []

    class Capture(TRLGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured.append(out["advantages"].detach().clone())
            return out

    args = TRLConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        scale_rewards=scale,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    ds = Dataset.from_dict({"prompt": [f"Say {c}" for c in "abcdefgh"]})
    Capture(model=tiny_model_path, reward_funcs=reward, args=args, train_dataset=ds).train()
    assert len(captured) == 2
    for vals, trl_adv in zip(given, captured, strict=True):
        r = torch.tensor([float("nan") if v is None else v for v in vals])
        torch.testing.assert_close(compute_advantages(r, 4, scale), trl_adv, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------- importance sampling
def _trl_is_block():
    """TRL 1.16's own importance-sampling code, cut out of `GRPOTrainer._generate_and_score_completions`."""
    import inspect
    import textwrap

    src = inspect.getsource(TRLGRPOTrainer._generate_and_score_completions)
    start = src.index(
        "            if self.use_vllm and self.vllm_importance_sampling_correction:\n                mask ="
    )
    end = src.index("            # Compute the per-token log probabilities for the reference model")
    return compile(textwrap.dedent(src[start:end]), "<trl importance sampling>", "exec")


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("clip_min, clip_max", [(None, 3.0), (0.5, 2.0), (0.9, None)])
def test_importance_sampling_matches_trl(mode, clip_min, clip_max):
    g = torch.Generator().manual_seed(1)
    B, T = 5, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    sampler = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler[1, 2] = float("nan")  # a logprob the engine did not return
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, 5:] = 0
    mask[3, 2:] = 0
    ns = {
        "self": SimpleNamespace(
            use_vllm=True,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max,
        ),
        "old_per_token_logps": old,
        "sampling_per_token_logps": sampler,
        "completion_mask": mask,
        "tool_mask": None,
        "torch": torch,
        "math": math,
    }
    exec(_trl_is_block(), ns)
    ours, diff = importance_sampling_weights(old, sampler, mask, mode, clip_min, clip_max)
    torch.testing.assert_close(ours, ns["vllm_importance_sampling_ratio"], atol=0, rtol=0)
    torch.testing.assert_close(diff, ns["per_token_logps_diff"], atol=0, rtol=0)


def test_importance_sampling_hand_worked():
    # d = [[0.1, 0.2]], clip_max 1.2: exp(0.1) = 1.105, exp(0.2) = 1.221 > 1.2, exp(0.3) = 1.350 > 1.2
    old, sampler, mask = torch.tensor([[0.1, 0.2]]), torch.zeros(1, 2), torch.ones(1, 2)
    w = {m: importance_sampling_weights(old, sampler, mask, m, None, 1.2)[0] for m in IS_MODES}
    torch.testing.assert_close(w["token_truncate"], torch.tensor([[math.exp(0.1), 1.2]]))
    torch.testing.assert_close(w["token_mask"], torch.tensor([[math.exp(0.1), 0.0]]))
    torch.testing.assert_close(w["sequence_truncate"], torch.tensor([[1.2]]))
    torch.testing.assert_close(w["sequence_mask"], torch.tensor([[0.0]]))
    with pytest.raises(ValueError, match="Unknown importance sampling mode 'seq'"):
        importance_sampling_weights(old, sampler, mask, "seq")


def test_loss_with_importance_weights_matches_trl():
    g = torch.Generator().manual_seed(2)
    B, T = 4, 6
    logps = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    sampler = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 3:] = 0
    for mode in IS_MODES:
        w, _ = importance_sampling_weights(old, sampler, mask, mode, 0.5, 1.5)
        n_items = mask.sum().double()
        inputs = {
            "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
            "prompt_mask": torch.ones(B, 2, dtype=torch.long),
            "completion_ids": torch.zeros(B, T, dtype=torch.long),
            "completion_mask": mask,
            "advantages": adv,
            "old_per_token_logps": old,
            "ref_per_token_logps": ref,
            "num_items_in_batch": n_items,
            "importance_sampling_ratio": w,
        }
        ctx = LossContext(
            grad_accum_steps=2, max_completion_length=8, num_items_in_batch=n_items, steps_per_generation=2
        )
        ours = grpo_loss(
            logps,
            adv,
            mask,
            loss_type="dapo",
            old_per_token_logps=old,
            ref_per_token_logps=ref,
            beta=0.04,
            importance_weights=w,
            ctx=ctx,
        )
        theirs = _trl_loss("dapo", logps, inputs, 0.04, 0.2, 0.2, 2, 2, 8, is_correction=True)
        torch.testing.assert_close(ours.loss, theirs, atol=1e-9, rtol=0)
