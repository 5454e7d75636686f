"""What only a CUDA GPU can show (`pytest -m gpu`; skipped where torch sees no GPU): a bf16 run of the trainer on the
device (generation with `transformers.generate` on the engine's own copy of the policy, training under bf16
autocast, the throughput meter's MFU from TRL's peak table), and the shared-prompt forward (`share_prompt_prefix`)
through CUDA's SDPA kernels against the unshared forward."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_async.algo.logprobs import score_tokens
from grpo_async.algo.prefix_sharing import pack_shared, sharing_cost, unsupported_reason

pytestmark = pytest.mark.gpu


def test_a_bf16_run_on_cuda_trains_and_logs_mfu(tiny_model_path, tmp_path):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    args = tiny_config(tmp_path / "run", use_cpu=False, bf16=True, generation_backend="hf", max_steps=3)
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    model = trainer.accelerator.unwrap_model(trainer.model)
    before = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    try:
        trainer.train()
    finally:
        trainer.close()
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    moved = max((p.detach().float().cpu() - before[n]).abs().max().item() for n, p in model.named_parameters())
    assert moved > 0, "no parameter changed in 3 optimizer steps"
    assert all(h["perf/train_tokens_per_second"] > 0 for h in history if "perf/train_tokens_per_second" in h)
    from trl.trainer.utils import get_peak_flops

    if get_peak_flops(torch.cuda.get_device_name(), "bfloat16") is not None:  # TRL's table knows this GPU
        mfu = [h["perf/mfu"] for h in history if "perf/mfu" in h]
        assert len(mfu) == 3 and all(0 < m < 100 for m in mfu), mfu


def _batch(vocab: int, groups: int, G: int, P: int, T: int, device):
    """`groups` prompts × `G` completions, prompts left-padded to different lengths, completions right-padded."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (groups, P), generator=g).repeat_interleave(G, 0)  # [B, P]
    completions = torch.randint(10, vocab, (groups * G, T), generator=g)  # [B, T]
    pmask = torch.ones(groups * G, P, dtype=torch.long)
    for k in range(groups):
        pmask[k * G : (k + 1) * G, : 3 * k] = 0
    lengths = torch.randint(1, T + 1, (groups * G,), generator=g)
    cmask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return torch.cat([prompts, completions], 1).to(device), torch.cat([pmask, cmask], 1).to(device)


def _logps_and_grads(model, ids, mask, T, share: bool):
    model.zero_grad()
    scores = score_tokens(model, ids, mask, T, 1.0, None, True, share_prefix=share)
    cmask = mask[:, -T:].float()
    loss = -(scores.logps * cmask).sum() / cmask.sum()
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (scores.logps.detach().float() * cmask), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prompt_forward_on_cuda_equals_unshared(tiny_model_path, dtype):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dtype).cuda()
    assert unsupported_reason(model) is None  # SDPA on CUDA takes the tree mask: no fallback
    ids, mask = _batch(model.config.vocab_size, groups=2, G=4, P=48, T=8, device="cuda")
    packed = pack_shared(ids, mask, 8, sharing_cost(model), True)
    assert packed is not None and packed.input_ids.size(0) <= 2  # 8 rows → 2 trees: the shared path really runs
    logps_a, grads_a = _logps_and_grads(model, ids, mask, 8, share=False)
    logps_b, grads_b = _logps_and_grads(model, ids, mask, 8, share=True)
    # float32: the CPU bound (1e-5 relative to |logp|); bfloat16: its 8-bit mantissa (2^-8 ≈ 4e-3) over a forward
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert ((logps_a - logps_b).abs() / logps_b.abs().clamp(min=1.0)).max().item() <= tol
    scale = max(g.abs().max().item() for g in grads_a.values())
    for name, grad in grads_a.items():
        assert (grad - grads_b[name]).abs().max().item() <= tol * max(scale, 1.0), name
