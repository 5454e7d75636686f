"""The whole loss family against TRL 1.16's own `GRPOTrainer._compute_loss`, called unbound on identical tensors (only
its forward pass and collectives are stood in for): loss, gradients and metrics, for every loss type ×
importance-sampling level × option; then the trainer end to end on the tiny model."""

import itertools
import json
import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from support.warm_launch import run_2cpu  # noqa: E402
from trl import GRPOTrainer as TRLGRPOTrainer

from grpo_async.algo.logprobs import TokenScores, score_tokens
from grpo_async.algo.loss import LOSS_TYPES, LossContext, LossSettings
from grpo_async.algo.objective import EntropyController, PolicyObjective, SingleProcess, high_entropy_mask
from grpo_async.pipeline.metrics import loss_metrics

B, T = 6, 7


def _tensors(seed: int):
    """Random micro-batch tensors: padded rows of different lengths, one row without trained tokens (a dropped stale
    row), mixed-sign advantages with one exact 0, ratios far enough from 1 to clip."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    logps = -torch.rand(B, T, **f64) * 3
    mask = torch.ones(B, T, dtype=torch.long)
    for i, n in enumerate([7, 5, 3, 6, 0, 1]):
        mask[i, n:] = 0
    adv = torch.randn(B, **f64)
    adv[3] = 0.0
    is_token = torch.where(
        mask.bool(), 0.5 + torch.rand(B, T, **f64), 1.0
    )  # 1 at padding, as importance_sampling_weights
    is_token[1, 2] = 0.0  # a token token_mask dropped
    return {
        "logps": logps,
        "entropies": torch.rand(B, T, **f64) * 2,
        "mask": mask,
        "advantages": adv,
        "old": logps + 0.3 * torch.randn(B, T, **f64),
        "ref": logps + 0.2 * torch.randn(B, T, **f64),
        "sampler": logps + 0.4 * torch.randn(B, T, **f64),
        "is_token": is_token,
        "is_seq": 0.5 + torch.rand(B, 1, **f64),
        "aux": torch.tensor(0.37, dtype=torch.float64),
        "num_items": torch.tensor(53.0, dtype=torch.float64),
    }


def _identity_accelerator(**kw):
    return SimpleNamespace(
        num_processes=1,
        reduce=lambda t, reduction="sum": t,
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        pad_across_processes=lambda t, dim=0, pad_index=0: t,
        sync_gradients=True,
        **kw,
    )


def _trl_self(o: dict, ga: int, spg: int, max_len: int, aux_coef: float):
    """A stand-in `self` with every attribute TRL's `_compute_loss` reads (set from TRL's config names in `o`)."""
    s = SimpleNamespace(
        loss_type=o["loss_type"],
        importance_sampling_level=o["importance_sampling_level"],
        epsilon_low=o["epsilon"],
        epsilon_high=o["epsilon_high"],
        beta=o["beta"],
        off_policy_mask_threshold=o["off_policy_mask_threshold"],
        top_entropy_quantile=o["top_entropy_quantile"],
        entropy_coef=o["entropy_coef"],
        use_adaptive_entropy=o["use_adaptive_entropy"],
        _entropy_bonus_enabled=o["entropy_coef"] != 0.0 or o["use_adaptive_entropy"],
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        use_vllm=o["is_weights"] is not None,
        vllm_importance_sampling_correction=o["is_weights"] is not None,
        current_gradient_accumulation_steps=ga,
        max_completion_length=max_len,
        aux_loss_enabled=aux_coef != 0.0,
        router_aux_loss_coef=aux_coef,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        model=SimpleNamespace(training=True),
        accelerator=_identity_accelerator(),
        args=SimpleNamespace(steps_per_generation=spg, **{k: o[k] for k in _TRL_ARGS}),
        get_off_policy_mask=TRLGRPOTrainer.get_off_policy_mask,
        get_gamma_weights=TRLGRPOTrainer.get_gamma_weights,
    )
    s.get_high_entropy_mask = lambda e, m, t: TRLGRPOTrainer.get_high_entropy_mask(s, e, m, t)
    return s


_TRL_ARGS = (
    "delta",
    "use_bias_correction_kl",
    "sapo_temperature_neg",
    "sapo_temperature_pos",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "entropy_target",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
)
DEFAULTS = dict(
    loss_type="dapo",
    importance_sampling_level="token",
    epsilon=0.2,
    epsilon_high=0.28,
    delta=None,
    beta=0.0,
    use_bias_correction_kl=True,
    off_policy_mask_threshold=None,
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    entropy_coef_min=0.0,
    entropy_coef_max=1.0,
    entropy_coef_delta=0.005,
    entropy_target=0.2,
    sapo_temperature_neg=1.05,
    sapo_temperature_pos=1.0,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    is_weights=None,  # None, "token" or "seq"
    with_old=True,
    with_sampler=True,
)


def _ours(o: dict, ga: int, spg: int, max_len: int, aux_coef: float) -> PolicyObjective:
    settings = LossSettings.from_config(SimpleNamespace(**o))
    entropy = EntropyController(
        o["entropy_coef"],
        adaptive=o["use_adaptive_entropy"],
        coef_min=o["entropy_coef_min"],
        coef_max=o["entropy_coef_max"],
        delta=o["entropy_coef_delta"],
        target=o["entropy_target"],
    )
    return PolicyObjective(
        settings,
        top_entropy_quantile=o["top_entropy_quantile"],
        entropy=entropy,
        aux_loss_coef=aux_coef,
        router=(4, 2) if aux_coef else None,
        ops=SingleProcess(),
    )


def _leaves(t: dict):
    return {k: t[k].clone().requires_grad_(True) for k in ("logps", "entropies", "aux")}


def _run_trl(fake, t: dict, o: dict):
    x = _leaves(t)
    fake._get_per_token_logps_and_entropies = lambda *a, **k: (
        x["logps"],
        x["entropies"],
        x["aux"] if fake.aux_loss_enabled else None,
    )
    w = {None: None, "token": t["is_token"], "seq": t["is_seq"]}[o["is_weights"]]
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": t["mask"],
        "advantages": t["advantages"],
        "ref_per_token_logps": t["ref"],
        "num_items_in_batch": t["num_items"],
    }
    if o["with_old"]:
        inputs["old_per_token_logps"] = t["old"]
    if o["with_sampler"]:
        inputs["sampling_per_token_logps"] = t["sampler"]
    if w is not None:
        inputs["importance_sampling_ratio"] = w
    fake._metrics["train"].clear()
    loss = TRLGRPOTrainer._compute_loss(fake, None, inputs)
    loss.backward()
    metrics = {k: v[-1] for k, v in fake._metrics["train"].items()}
    return loss.detach(), {k: v.grad for k, v in x.items()}, metrics


def _run_ours(objective, t: dict, o: dict, ctx: LossContext, end_of_window: bool = True):
    x = _leaves(t)
    w = {None: None, "token": t["is_token"], "seq": t["is_seq"]}[o["is_weights"]]
    batch = SimpleNamespace(
        advantages=t["advantages"],
        loss_mask=t["mask"],
        old_logps=t["old"] if o["with_old"] else None,
        ref_logps=t["ref"] if o["beta"] else None,
        is_weights=w,
        rollout_logps=t["sampler"] if o["with_sampler"] else None,
        policy_version=torch.zeros(B, dtype=torch.long),
        token_version=None,
    )
    scores = TokenScores(logps=x["logps"], entropies=x["entropies"], aux_loss=x["aux"] if objective.router else None)
    out = objective(scores, batch, ctx, end_of_window=end_of_window)
    out.loss.backward()
    metrics = loss_metrics(out, batch, 0, SingleProcess())
    metrics = {k: v for k, v in metrics.items() if not k.startswith("async/")}
    return out.loss.detach(), {k: v.grad for k, v in x.items()}, metrics


def _close(a, b, what):
    if a is None or b is None:
        assert (a is None or not a.abs().sum()) and (b is None or not b.abs().sum()), what
        return
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9, msg=what)


def _compare(o: dict, seed: int = 0, ga: int = 3, spg: int = 6, max_len: int = 9, aux_coef: float = 0.0):
    t = _tensors(seed)
    trl_loss, trl_grads, trl_metrics = _run_trl(_trl_self(o, ga, spg, max_len, aux_coef), t, o)
    ctx = LossContext(
        grad_accum_steps=ga,
        max_completion_length=max_len,
        num_items_in_batch=t["num_items"],
        num_processes=1,
        steps_per_generation=spg,
    )
    loss, grads, metrics = _run_ours(_ours(o, ga, spg, max_len, aux_coef), t, o, ctx)
    what = {k: v for k, v in o.items() if v != DEFAULTS[k]}
    torch.testing.assert_close(loss, trl_loss, atol=1e-10, rtol=1e-9, msg=f"loss {what}")
    for k in grads:
        _close(grads[k], trl_grads[k], f"grad {k} {what}")
    assert set(metrics) == set(trl_metrics), (what, set(metrics) ^ set(trl_metrics))
    for k, v in trl_metrics.items():
        assert metrics[k] == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), (k, what)
    return trl_grads


OPTIONS = {
    "delta": [None, 1.3],
    "off_policy_mask_threshold": [None, 0.05],
    "top_entropy_quantile": [1.0, 0.6],
    "entropy_coef": [0.0, 0.05],
    "beta_bias": [(0.0, True), (0.04, True), (0.04, False)],
    "is_weights": [None, "token", "seq"],
}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_option_matches_trl(loss_type, level):
    """Loss, gradients (w.r.t. logps and entropies) and every metric TRL logs, over the product of the options."""
    n = 0
    for values in itertools.product(*OPTIONS.values()):
        o = {**DEFAULTS, **dict(zip(OPTIONS, values, strict=True)), "loss_type": loss_type}
        o["importance_sampling_level"] = level
        o["beta"], o["use_bias_correction_kl"] = o.pop("beta_bias")
        if o["delta"] is not None and loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            continue  # δ only enters the clipped surrogate
        _compare(o, seed=n)
        n += 1
    assert n >= 72


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("ga,spg", [(1, 1), (2, 2), (3, 6)])
def test_accumulation_and_round_geometry_match_trl(loss_type, ga, spg):
    o = {**DEFAULTS, "loss_type": loss_type, "beta": 0.04, "is_weights": "token"}
    _compare(o, ga=ga, spg=spg)


@pytest.mark.parametrize("with_old,with_sampler", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_and_missing_rollout_logps_match_trl(loss_type, with_old, with_sampler):
    """π_old absent (ratio 1 with gradient); the off-policy mask falls back to π_old without sampler logps."""
    o = {**DEFAULTS, "loss_type": loss_type, "with_old": with_old, "with_sampler": with_sampler}
    o.update(off_policy_mask_threshold=0.05, beta=0.04, entropy_coef=0.01)
    _compare(o)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "vespo"])
def test_moe_aux_loss_matches_trl(loss_type):
    grads = _compare({**DEFAULTS, "loss_type": loss_type}, aux_coef=0.01, ga=2)
    assert grads["aux"].item() == pytest.approx(0.01 / 2)


def test_sapo_and_vespo_knobs_match_trl():
    _compare({**DEFAULTS, "loss_type": "sapo", "sapo_temperature_neg": 2.0, "sapo_temperature_pos": 0.5})
    o = {**DEFAULTS, "loss_type": "vespo", "is_weights": "token"}
    _compare({**o, "vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5, "vespo_k_neg": 4.0, "vespo_lambda_neg": 0.0})


@pytest.mark.parametrize("target", [1.95, 0.3])  # above / below the top-30% tokens' mean entropy (≈ 1.7)
def test_adaptive_entropy_over_accumulation_windows_matches_trl(target):
    """Two windows of GA = 3 micro-batches: the coefficient applied, its updates, the logged metrics."""
    o = {**DEFAULTS, "use_adaptive_entropy": True, "entropy_coef": 0.02, "entropy_target": target}
    o.update(entropy_coef_delta=0.01, entropy_coef_max=0.035, top_entropy_quantile=0.7)
    ga = 3
    fake, ours = _trl_self(o, ga, ga, 9, 0.0), _ours(o, ga, ga, 9, 0.0)
    coefs = []
    for step in range(2 * ga):
        t = _tensors(100 + step)
        end = step % ga == ga - 1
        fake.accelerator.sync_gradients = end
        trl_loss, trl_grads, trl_metrics = _run_trl(fake, t, o)
        ctx = LossContext(ga, 9, t["num_items"], 1, ga)
        loss, grads, metrics = _run_ours(ours, t, o, ctx, end_of_window=end)
        torch.testing.assert_close(loss, trl_loss, atol=1e-10, rtol=1e-9)
        _close(grads["entropies"], trl_grads["entropies"], f"step {step}")
        assert metrics.keys() == trl_metrics.keys() and ("entropy_coef" in metrics) == end
        assert ours.entropy.coef == pytest.approx(fake.entropy_coef)
        assert ours.entropy.last_world_entropy == pytest.approx(fake._last_world_entropy)
        coefs.append(ours.entropy.coef)
    assert coefs == pytest.approx(
        [0.02, 0.02, 0.03, 0.03, 0.03, 0.035] if target > 1 else [0.02] * 2 + [0.01] * 3 + [0]
    )
    state = ours.state_dict()
    fresh = _ours(o, ga, ga, 9, 0.0)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert fresh.state_dict() == state


def test_static_entropy_coef_is_not_restored_from_a_checkpoint():
    c = EntropyController(0.1)
    c.load_state_dict({"entropy_coef": 0.5, "last_world_entropy": 0.1})
    assert c.coef == 0.1 and c.last_world_entropy == math.inf


# ---------------------------------------------------------------------------------------------- the entropy quantile
def test_entropy_quantile_over_two_processes_agrees_with_one():
    """Two processes with different token counts (padded to the longest with the sentinel, then gathered) get the
    threshold one process gets from all their tokens together."""
    g = torch.Generator().manual_seed(3)
    e = [torch.rand(3, 5, generator=g) * 2, torch.rand(2, 4, generator=g) * 2]
    m = [torch.ones(3, 5), torch.ones(2, 4)]
    m[0][0, 3:] = 0
    m[1][1, 1:] = 0
    locals_ = [ei[mi.bool()] for ei, mi in zip(e, m, strict=True)]
    longest = max(x.numel() for x in locals_)
    state = {}

    def pad(t, dim=0, pad_index=0):
        state["pad_index"] = pad_index
        return torch.cat([t, t.new_full((longest - t.numel(),), pad_index)])

    def gather(t):  # both processes' padded tensors, in rank order
        return torch.cat([pad(x, pad_index=state["pad_index"]) for x in locals_])

    ops = SimpleNamespace(reduce_sum=lambda t: t, gather_tensor=gather, pad_across_processes=pad)  # two ranks' data
    cut = torch.quantile(torch.cat(locals_), 0.4)
    for ei, mi in zip(e, m, strict=True):
        got = high_entropy_mask(ei, mi, 0.4, ops)
        torch.testing.assert_close(got, (ei >= cut) & mi.bool())


_QUANTILE_WORKER = """
import json, sys, torch
from accelerate import Accelerator
from grpo_async.algo.objective import high_entropy_mask
from grpo_async.pipeline.collectives import AcceleratorCollectives
acc = Accelerator(cpu=True)
g = torch.Generator().manual_seed(7)
e = [torch.rand(3, 5, generator=g) * 2, torch.rand(2, 4, generator=g) * 2]  # rank r's entropies
m = [torch.ones(3, 5), torch.ones(2, 4)]
m[0][0, 3:] = 0
m[1][1, 1:] = 0
r = acc.process_index
mask = high_entropy_mask(e[r], m[r], 0.4, AcceleratorCollectives(acc))
cut = torch.quantile(torch.cat([e[0][m[0].bool()], e[1][m[1].bool()]]), 0.4)  # every process's tokens together
json.dump({"ok": torch.equal(mask, (e[r] >= cut) & m[r].bool()), "kept": int(mask.sum())},
          open(sys.argv[1] + f"/rank{r}.json", "w"))
acc.wait_for_everyone()
torch.distributed.destroy_process_group()  # exiting with gloo's threads alive can abort (exit -6, seen once in 2)
"""


@pytest.mark.multiprocess
def test_entropy_quantile_on_two_real_processes(tmp_path):
    """accelerate launch, 2 processes (gloo): each process's mask uses the quantile of both processes' tokens."""

    script = tmp_path / "worker.py"
    script.write_text(_QUANTILE_WORKER)
    proc = run_2cpu(str(script), [tmp_path], timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:]
    ranks = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    assert all(r["ok"] for r in ranks), ranks
    assert sum(r["kept"] for r in ranks) == 11  # the top 60% of the 13 + 5 = 18 tokens of both processes


def test_entropy_quantile_zero_keeps_only_the_top_token():
    e = torch.tensor([[0.1, 0.9, 0.5], [0.3, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    mask = high_entropy_mask(e, m, 1.0, SingleProcess())  # top_entropy_quantile = 0
    assert mask.tolist() == [[False, True, False], [False, False, False]]


# ---------------------------------------------------------------------------------------------- forward pass
def _rows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    P, Tc = 4, 5
    ids = torch.randint(3, vocab, (4, P + Tc), generator=g)
    am = torch.zeros(4, P + Tc, dtype=torch.long)
    for i, (p, c) in enumerate([(4, 5), (2, 3), (3, 1), (1, 4)]):
        am[i, P - p : P + c] = 1
    return ids.masked_fill(am == 0, 0), am, Tc


def test_entropies_packed_and_padded_agree(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    ids, am, Tc = _rows(model.config.vocab_size)
    padded = score_tokens(model, ids, am, Tc, temperature=0.7, entropy=True)
    packed = score_tokens(model, ids, am, Tc, temperature=0.7, padding_free=True, entropy=True, entropy_grad=True)
    m = am[:, -Tc:].bool()
    torch.testing.assert_close(packed.entropies[m], padded.entropies[m], atol=1e-5, rtol=0)
    torch.testing.assert_close(packed.logps[m], padded.logps[m], atol=1e-5, rtol=0)
    assert not padded.entropies[~m].any() and not packed.entropies[~m].any()
    assert packed.entropies.requires_grad and not padded.entropies.requires_grad
    # the entropy of softmax(logits / 0.7) at the first completion position of row 0, by hand
    logits = model(input_ids=ids[:1], attention_mask=am[:1]).logits[0, -Tc - 1].double() / 0.7
    p = torch.softmax(logits, -1)
    assert padded.entropies[0, 0].item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-5)


def _tiny_moe(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    config = MixtralConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    path = str(tmp_path / "moe")
    MixtralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_moe_aux_loss_packed_and_padded_agree(tmp_path, tiny_model_path):
    """The load-balancing loss over the real tokens only: the packed bins' filler is left out like the padding."""
    from transformers import AutoModelForCausalLM

    from grpo_async.algo.objective import router_aux_settings

    model = AutoModelForCausalLM.from_pretrained(_tiny_moe(tmp_path, tiny_model_path), dtype=torch.float32)
    coef, router = router_aux_settings(model.config, None)
    assert coef == 0.02 and router == (4, 2)  # TRL: the config's coefficient when the field is None
    assert router_aux_settings(model.config, 0.0) == (0.0, None)
    ids, am, Tc = _rows(model.config.vocab_size)
    padded = score_tokens(model, ids, am, Tc, router=router)
    packed = score_tokens(model, ids, am, Tc, padding_free=True, router=router)
    assert padded.aux_loss.requires_grad
    torch.testing.assert_close(packed.aux_loss, padded.aux_loss, atol=1e-6, rtol=0)


def test_router_aux_loss_coef_on_a_dense_model_is_an_error(tiny_model_path):
    from transformers import AutoConfig

    from grpo_async.algo.objective import router_aux_settings

    config = AutoConfig.from_pretrained(tiny_model_path)
    assert router_aux_settings(config, None) == (0.0, None)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01: LlamaConfig is not a Mixture-of-Experts"):
        router_aux_settings(config, 0.01)


# ---------------------------------------------------------------------------------------------- config
def test_config_validates_the_loss_knobs(tmp_path):
    from grpo_async import GRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4)
    assert GRPOConfig(**base).use_bias_correction_kl is True  # TRL's default
    bad = {
        "importance_sampling_level": "seq",
        "delta": 0.9,
        "off_policy_mask_threshold": -1.0,
        "top_entropy_quantile": 1.5,
        "sapo_temperature_neg": 0.0,
        "vespo_k_pos": -1.0,
        "entropy_coef_delta": -0.1,
        "router_aux_loss_coef": -0.1,
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=rf"GRPOConfig\.{name}: "):
            GRPOConfig(**base, **{name: value})
    with pytest.raises(
        ValueError, match=r"GRPOConfig\.entropy_coef_min: need 0 <= entropy_coef_min <= entropy_coef_max"
    ):
        GRPOConfig(**base, entropy_coef_min=0.5, entropy_coef_max=0.1)
    with pytest.raises(ValueError, match=r"GRPOConfig\.importance_sampling_mode: VESPO loss requires"):
        GRPOConfig(**base, loss_type="vespo", use_vllm=True)  # the default sequence_mask IS mode, with vLLM (TRL)
    GRPOConfig(**base, loss_type="vespo")  # hf: TRL's defaults are accepted
    GRPOConfig(**base, loss_type="vespo", importance_sampling_mode="token_mask")
    GRPOConfig(**base, loss_type="vespo", importance_sampling_correction=False)


@pytest.mark.parametrize(
    "loss_type,level,match",
    [
        ("luspo", "token", "When using `'luspo'` loss, `importance_sampling_level` should be set to `'sequence'`"),
        ("vespo", "sequence", "VESPO computes sequence-level importance weights internally"),
        ("dapo", "sequence", "weights each sequence by its completion length"),
        ("cispo", "sequence", "weights each sequence by its completion length"),
    ],
)
def test_config_warns_about_trl_known_bad_combinations(tmp_path, loss_type, level, match):
    from grpo_async import GRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4)
    with pytest.warns(UserWarning, match=match):
        GRPOConfig(**base, loss_type=loss_type, importance_sampling_level=level, importance_sampling_mode="token_mask")


def test_config_does_not_warn_about_good_combinations(tmp_path, recwarn):
    from grpo_async import GRPOConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4)
    GRPOConfig(**base, loss_type="luspo", importance_sampling_level="sequence")
    GRPOConfig(**base, loss_type="grpo", importance_sampling_level="sequence")
    assert not [w for w in recwarn if "GRPOConfig:" in str(w.message)]


# ---------------------------------------------------------------------------------------------- the trainer
def _train(tiny_model_path, out, cls=None, **kw):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    args = tiny_config(out, **{"max_steps": 2, **kw})
    t = (cls or GRPOTrainer)(
        model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32)
    )
    t.train()
    return t


METRICS = {
    "cispo": ["cispo_clip_ratio"],
    "sapo": [],
    "luspo": ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/high_max"],
    "vespo": ["vespo/phi_seq_mean"],
}


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("loss_type", list(METRICS))
def test_new_loss_types_train(tiny_model_path, tmp_path, loss_type, padding_free):
    kw = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    if loss_type == "vespo":
        kw["importance_sampling_mode"] = "token_truncate"
    t = _train(tiny_model_path, tmp_path / "out", loss_type=loss_type, padding_free=padding_free, **kw)
    logs = [h for h in t.state.log_history if "loss" in h and "entropy" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    for key in ["entropy", *METRICS[loss_type]]:
        assert all(key in h and math.isfinite(h[key]) for h in logs), key
    clip = {"clip_ratio/low_mean", "cispo_clip_ratio", "vespo/phi_seq_mean"} - set(METRICS[loss_type])
    assert not clip & set(logs[-1]), "metrics of another loss type"


def _first_step_grads(tiny_model_path, out, **kw):
    """The gradient of the first micro-batch (the same completions with the same seed)."""
    from grpo_async import GRPOTrainer

    grads = []

    class Capture(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if not grads:
                grads.append(torch.cat([p.grad.detach().reshape(-1).clone() for p in model.parameters()]))
            return loss

    _train(tiny_model_path, out, cls=Capture, max_steps=1, num_batches_ahead=0, **kw)
    return grads[0]


@pytest.mark.parametrize("padding_free", [True, False])
def test_entropy_masking_changes_the_gradient(tiny_model_path, tmp_path, padding_free):
    full = _first_step_grads(tiny_model_path, tmp_path / "a", padding_free=padding_free)
    again = _first_step_grads(tiny_model_path, tmp_path / "b", padding_free=padding_free)
    masked = _first_step_grads(tiny_model_path, tmp_path / "c", padding_free=padding_free, top_entropy_quantile=0.2)
    torch.testing.assert_close(full, again)  # deterministic: a difference below is the mask's
    assert (masked - full).abs().max() > 1e-3 * full.abs().max()


def test_adaptive_entropy_coef_survives_checkpoint_and_resume(tiny_model_path, tmp_path):
    from grpo_async.pipeline.checkpointing import PIPELINE_STATE_FILE

    out = tmp_path / "run"
    kw = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=100.0, entropy_coef_delta=0.02)
    kw.update(save_strategy="steps", save_steps=2, num_batches_ahead=0)
    first = _train(tiny_model_path, out, **kw)
    assert first.objective.entropy.coef == pytest.approx(0.05)  # entropy ≤ target: +0.02 per optimizer step
    coefs = [h["entropy_coef"] for h in first.state.log_history if "entropy_coef" in h]
    assert coefs == pytest.approx([0.03, 0.05])
    saved = json.load(open(os.path.join(out, "checkpoint-2", PIPELINE_STATE_FILE)))["objective"]["entropy"]
    assert saved["entropy_coef"] == pytest.approx(0.05) and math.isfinite(saved["last_world_entropy"])
    resumed = _train_resume(tiny_model_path, out, kw)
    coefs = [h["entropy_coef"] for h in resumed.state.log_history if "entropy_coef" in h and h["step"] > 2]
    assert coefs == pytest.approx([0.07])  # continued from 0.05, not restarted from 0.01


def _train_resume(tiny_model_path, out, kw):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    args = tiny_config(out, **{**kw, "max_steps": 3})
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32))
    t.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    return t


def test_moe_model_trains_with_the_aux_loss(tmp_path, tiny_model_path):
    t = _train(_tiny_moe(tmp_path, tiny_model_path), tmp_path / "out", max_steps=1, padding_free=True)
    logs = [h for h in t.state.log_history if "aux_loss" in h]
    assert logs and math.isfinite(logs[0]["aux_loss"]) and logs[0]["aux_loss"] > 0
    assert t.objective.aux_loss_coef == 0.02
