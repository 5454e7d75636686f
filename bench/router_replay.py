"""Router replay (issue 45): how often a bfloat16 sampler and the float32 trainer route a token to different experts,
and what replaying the sampler's routing does to the sampler/trainer mismatch `sampling/kl`.

What it measures: the tiny Qwen3-MoE (`grpo_async.testing.build_tiny_moe`: hidden 64, 2 MoE layers, 4 experts,
top-2) trained by `GRPOTrainer` (float32) for `--steps` steps of 16 completions of `--tokens` tokens, synchronously
(`num_batches_ahead=0`: the sampler holds exactly the trainer's weights when it samples, so every difference below is
numerics, not staleness), with the sampler in bfloat16: the in-process vLLM engine (`VLLMColocateBackend(dtype=
"bfloat16")`) and the `hf` backend (a bfloat16 copy), each with `router_replay="record"` (the sampler's experts are
recorded and compared, the trainer routes: replay off) and `"rollout"` (replayed in the old-logps and training
forwards); and a float32 engine as the control (same numerics as the trainer: no disagreement expected).

- `routing/mismatch_tokens` (the old-logps pass's metric, mean over the steps): completion tokens whose expert set at
  one MoE layer or more differs between what the sampler ran and what the trainer's routers choose (π_old, the same
  weights); `routing/mismatch_pairs` per (token, layer). With replay on the experts run are the sampler's (0 by
  construction, tests/test_router_replay.py); the number then says how many tokens replay overrode.
- Paired (the `"record"` runs, `PairedScores`): before each training micro-batch, π_old's log-probs of its trained
  tokens twice, routed by the trainer and replayed, same rows, same weights; k3 = exp(d) − 1 − d with d = log π_old −
  log π_sampler (what `sampling/kl` averages), over every trained token and over those after a token of their row that
  was routed elsewhere (a token's log-prob is read at the position before it: it depends on the routing of the tokens
  before it, not its own). Replay changes nothing for the others (prompt tokens are routed by the trainer either way).
- `sampling/kl` (Step 18) of the `"record"` and `"rollout"` runs: separate runs, their rows drift apart after step 1.

How to read the ratio: `router_replay_kl_ratio = k3(trainer-routed) / k3(replayed)` over every trained token of the
bfloat16 engine's rows (paired): > 1 means replay brought π_old closer to the sampler by that factor;
`..._after_misrouted` the same over the tokens that routing disagreement reaches (1 when it reaches none, as a short
run can: replay then scores every token as the trainer did). bfloat16 attention and expert
matmuls stay, so replay cannot take the KL to the float32 control's.

Run: `python bench/router_replay.py` (~4 min on 2 loaded cores: three engine starts); `--smoke`: 2 steps of 8
tokens (tests/test_benches.py). Writes `bench/out/router_replay.json`; ends with `RESULT router_replay_kl_ratio=<x>`.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_async import GRPOCallback, GRPOTrainer  # noqa: E402
from grpo_async.algo.logprobs import score_tokens  # noqa: E402
from grpo_async.algo.router_replay import capture_routing, routed  # noqa: E402
from grpo_async.demo_task import letter_reward, make_dataset  # noqa: E402
from grpo_async.generation import BackendSpec, register_backend  # noqa: E402
from grpo_async.testing import TinyMoESpec, build_tiny_moe, tiny_config  # noqa: E402

METRICS = ("routing/mismatch_tokens", "routing/mismatch_pairs", "sampling/kl", "sampling/logp_diff/mean", "reward")


def _vllm_bf16(args, model, tokenizer, model_path):
    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    return VLLMColocateBackend(
        model_path,
        dtype="bfloat16",
        max_model_len=256,
        seed=args.seed,
        kv_cache_seqs=args.generation_batch_size,
        record_routing=args.router_replay != "off",
    )


def _hf_bf16(args, model, tokenizer, model_path):
    from grpo_async.generation.hf import HFBackend

    return HFBackend(copy.deepcopy(model).to(torch.bfloat16), tokenizer, record_routing=args.router_replay != "off")


register_backend(BackendSpec("vllm_bf16", _vllm_bf16, in_process=True, records_routing=True))
register_backend(BackendSpec("hf_bf16", _hf_bf16, in_process=True, records_routing=True))

#: (label, generation_backend, router_replay)
RUNS = [
    ("vllm float32 (control), replay off", "vllm", "record"),
    ("vllm bfloat16, replay off", "vllm_bf16", "record"),
    ("vllm bfloat16, replay on", "vllm_bf16", "rollout"),
    ("hf bfloat16, replay off", "hf_bf16", "record"),
    ("hf bfloat16, replay on", "hf_bf16", "rollout"),
]


class PairedScores(GRPOCallback):
    """With `router_replay="record"`, before each training micro-batch (the weights are π_old's: one optimizer step
    per round, synchronous): π_old's log-probs of the micro-batch's completion tokens routed by the trainer and
    replayed, the same rows and weights, and which tokens the trainer's routers route elsewhere than the sampler did
    (at one MoE layer or more). Sums of k3 = exp(d) − 1 − d (d = log π_old − log π_sampler) over the trained tokens:
    all of them, those after a token of their row that was routed elsewhere (a token's log-prob is read at the
    position before it, so it depends on the routing of the tokens before it, not on its own), and the rest:
    `sums[kind] = [k3 off, k3 on, tokens]`."""

    def __init__(self, model, temperature: float):
        self.model, self.temperature = model, temperature
        self.sums = {kind: torch.zeros(3, dtype=torch.float64) for kind in ("all", "after", "rest")}

    @torch.no_grad()
    def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
        mb = micro_batch
        T = mb.completion_ids.size(1)
        ids = torch.cat([mb.prompt_ids, mb.completion_ids], 1)  # [B, P+T]
        am = torch.cat([mb.prompt_mask, mb.completion_mask], 1)  # [B, P+T]
        scored = {
            replay: score_tokens(self.model, ids, am, T, self.temperature, routing=mb.routed_experts, replay=replay)
            for replay in (False, True)
        }
        with capture_routing(self.model) as calls:
            self.model(input_ids=ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0))
        B, _, L, k = mb.routed_experts.shape
        own = torch.stack(calls[0], 1).view(B, -1, L, k)[:, -T:]  # [B, T, L, k]
        recorded = mb.routed_experts.long()
        same = (own.sort(-1).values == recorded.sort(-1).values).all(-1).all(-1)  # [B, T]
        elsewhere = ~same & routed(mb.routed_experts) & mb.completion_mask.bool()  # [B, T] routed elsewhere
        # token t's log-prob is read at position t - 1: it depends on the routing of the tokens before it
        after = (elsewhere.long().cumsum(1) - elsewhere.long()) > 0  # [B, T] a token before it was routed elsewhere
        trained = mb.loss_mask.bool()  # [B, T]
        k3 = {}
        for replay, out in scored.items():
            d = (out.logps - mb.rollout_logps).double()
            k3[replay] = torch.expm1(d) - d  # [B, T]
        for kind, where in (("all", trained), ("after", trained & after), ("rest", trained & ~after)):
            self.sums[kind] += torch.tensor([k3[False][where].sum(), k3[True][where].sum(), float(where.sum())])


def run(model: str, out: str, backend: str, mode: str, steps: int, tokens: int) -> dict:
    args = tiny_config(
        out,
        generation_backend=backend,
        router_replay=mode,
        max_steps=steps,
        max_completion_length=tokens,
        num_batches_ahead=0,
        learning_rate=1e-3,
    )
    t = GRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(16 * steps))
    paired = PairedScores(t.model, args.temperature) if mode == "record" else None
    if paired is not None:
        t.add_callback(paired)
    t0 = time.perf_counter()
    try:
        t.train()
    finally:
        t.close()
    logs = [h for h in t.state.log_history if "sampling/kl" in h]
    means = {m: statistics.fmean(h[m] for h in logs) for m in METRICS}
    out = {**means, "steps": len(logs), "seconds": time.perf_counter() - t0}
    if paired is not None:  # per trained token: k3 with the trainer's routing (off) and replayed (on)
        for kind, (off, on, n) in paired.sums.items():
            out[f"paired/{kind}"] = {"kl_off": off.item() / max(n.item(), 1), "kl_on": on.item() / max(n.item(), 1)}
            out[f"paired/{kind}"]["tokens"] = int(n)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tokens", type=int, default=32, help="max_completion_length")
    p.add_argument("--smoke", action="store_true", help="2 steps of 8 tokens: checks the bench runs")
    a = p.parse_args()
    if a.smoke:
        a.steps, a.tokens = 2, 8
    model = build_tiny_moe(os.path.join(tempfile.gettempdir(), "grpo_async_bench_tiny_moe"), TinyMoESpec())
    results = {}
    with tempfile.TemporaryDirectory(prefix="router_replay_") as tmp:
        for i, (label, backend, mode) in enumerate(RUNS):
            results[label] = run(model, os.path.join(tmp, str(i)), backend, mode, a.steps, a.tokens)
            r = results[label]
            print(
                f"{label:36s} tokens differ {r['routing/mismatch_tokens']:.4f}  (token, layer) pairs "
                f"{r['routing/mismatch_pairs']:.4f}  sampling/kl {r['sampling/kl']:.3e}  logp_diff "
                f"{r['sampling/logp_diff/mean']:.3e}  reward {r['reward']:.3f}  ({r['seconds']:.0f} s)",
                flush=True,
            )
            for kind in ("all", "after", "rest"):
                if f"paired/{kind}" in r:
                    q = r[f"paired/{kind}"]
                    print(
                        f"    same rows, pi_old routed by the trainer / replayed: {kind:6s} {q['tokens']:6d} tokens  "
                        f"k3 {q['kl_off']:.3e} / {q['kl_on']:.3e}",
                        flush=True,
                    )
    off, on = results["vllm bfloat16, replay off"], results["vllm bfloat16, replay on"]
    hf_off, hf_on = results["hf bfloat16, replay off"], results["hf bfloat16, replay on"]

    def ratio(x: float, y: float) -> float:
        return x / y if y > 0 else math.inf

    def paired_ratio(q: dict) -> float:
        # no token reached by a misrouting (a short run: `--smoke` on a CPU whose bf16 routing seldom differs): replay
        # re-scores every token exactly as the trainer routed it, so the two KLs are the same sum, and the ratio is 1
        return 1.0 if q["tokens"] == 0 else ratio(q["kl_off"], q["kl_on"])

    rows = []
    for name, r in (("vLLM", off), ("hf", hf_off)):
        for kind, what in (("all", "every trained token"), ("after", "tokens after one routed elsewhere")):
            q = r[f"paired/{kind}"]
            rows.append(
                {
                    "metric": f"k3 KL(sampler ‖ π_old), {name} bf16 sampler vs fp32 trainer, {what} "
                    f"({q['tokens']}): replayed vs trainer-routed",
                    "ours": q["kl_on"],
                    "peer": q["kl_off"],
                    "peer_name": "trainer-routed",
                    "ratio": paired_ratio(q),
                }
            )
    rows.append(
        {
            "metric": "sampling/kl of training runs, vLLM bf16 sampler: replay on vs off (separate runs)",
            "ours": on["sampling/kl"],
            "peer": off["sampling/kl"],
            "peer_name": "replay off",
            "ratio": ratio(off["sampling/kl"], on["sampling/kl"]),
        }
    )
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "smoke" if a.smoke else "")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "router_replay.json"), "w") as f:
        json.dump({"runs": results, "rows": rows, "args": vars(a)}, f, indent=1)
    q, hq = off["paired/all"], hf_off["paired/all"]
    d, hd = off["paired/after"], hf_off["paired/after"]
    print(f"RESULT router_replay_kl_ratio={paired_ratio(q):.3f}")
    print(f"RESULT router_replay_kl_ratio_after_misrouted={paired_ratio(d):.3f}")
    print(f"RESULT router_replay_hf_kl_ratio={paired_ratio(hq):.3f}")
    print(f"RESULT router_replay_hf_kl_ratio_after_misrouted={paired_ratio(hd):.3f}")
    print(f"RESULT router_replay_mismatch_tokens={off['routing/mismatch_tokens']:.4f}")
    print(f"RESULT router_replay_mismatch_tokens_hf={hf_off['routing/mismatch_tokens']:.4f}")
    print(f"RESULT router_replay_mismatch_tokens_fp32={results[RUNS[0][0]]['routing/mismatch_tokens']:.4f}")
    print(f"RESULT router_replay_sampling_kl_off={off['sampling/kl']:.3e}")
    print(f"RESULT router_replay_sampling_kl_on={on['sampling/kl']:.3e}")
    print(f"RESULT router_replay_hf_sampling_kl_off={hf_off['sampling/kl']:.3e}")
    print(f"RESULT router_replay_hf_sampling_kl_on={hf_on['sampling/kl']:.3e}")


if __name__ == "__main__":
    main()
