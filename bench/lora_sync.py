"""LoRA weight-sync benchmark: adapter-only vs merged full weights, on the real SmolLM2-135M-Instruct.

What it measures: bytes and wall seconds of one policy publish (`PolicyPublisher.publish`: collect from the live PEFT
model → transport → the vLLM worker installs it → prefix-cache reset) in the two `GRPOConfig.vllm_lora_sync` modes:

- adapter: only the LoRA `lora_A` / `lora_B` tensors travel; the worker builds a vLLM `LoRAModel` from them and makes
  it the served adapter (a new adapter id per version); the engine's base weights never move.
- merged:  `merge_adapter()`, every full weight (HF names) travels and is loaded by vLLM's layerwise reload (which
  re-packs every linear for its CPU kernels), then `unmerge_adapter()`.

Setup: SmolLM2-135M-Instruct (float32, 30 layers, tied embeddings) from `grpo_async.testing.build_smollm2()`
(offline), a PEFT LoRA (r=16, alpha=32, q/k/v/o/gate/up/down) as the trainer's model, two `VLLMColocateBackend`
engines alive at once (one with `enable_lora`, one plain), each in its own engine process (`separate_process=True`,
weights through shared memory, the same transport both modes use), so the repeats can alternate adapter / merged /
adapter / ... (the machine's load from other processes then hits both modes alike). Before every publish the adapter
is nudged (as an optimizer step would), so each sync carries new values. One warm-up publish per mode is not timed;
after it, the sampler's logprobs of a few sampled completions are compared with the HF PEFT model's (both modes must
be the policy, not just fast). The median of `--repeats` is reported.

Run: `python bench/lora_sync.py` (~3-5 min on 2 busy cores, ~4 GB RAM). Writes `bench/out/lora_sync.json` and ends
with `RESULT lora_sync_speedup=<merged seconds / adapter seconds>`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_async.generation.base import SamplingConfig  # noqa: E402
from grpo_async.generation.shared import SharedBackend  # noqa: E402
from grpo_async.pipeline.publisher import PolicyPublisher  # noqa: E402
from grpo_async.testing import build_smollm2, build_tiny_model  # noqa: E402
from grpo_async.weight_sync.lora import adapter_max_rank  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[1, 9690, 314, 253, 2365, 30], [1, 504, 3575, 282], [1, 2683, 6326, 30, 2002]]


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "n/a"


@torch.no_grad()
def max_logprob_gap(backend, model, prompts: list[list[int]]) -> float:
    """Largest |sampler logprob − HF logprob| over sampled completions of `prompts` (temperature 1, no filter: the
    sampler's processed logprobs are then the model's own log-softmax)."""
    worst = 0.0
    for prompt, c in zip(prompts, backend.generate(prompts, SamplingConfig(max_tokens=8, seed=0))):
        ids = torch.tensor([prompt + c.completion_ids])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits, -1)[torch.arange(len(c.completion_ids)), torch.tensor(c.completion_ids)]
        worst = max(worst, (ref - torch.tensor(c.logprobs)).abs().max().item())
    return worst


@torch.no_grad()
def nudge(model, gen: torch.Generator) -> None:
    """What an optimizer step does to a LoRA policy: every adapter tensor changes a little."""
    for n, p in model.named_parameters():
        if ".lora_" in n:
            p.add_(1e-3 * torch.randn(p.shape, generator=gen))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed publishes per mode (alternated)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="GRPOConfig.weight_sync_bucket_mb (its default)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "lora_sync.json"))
    ap.add_argument("--smoke", action="store_true", help="the tiny test model, 1 repeat: checks the bench runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.repeats, args.rank = 1, 4
        args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "smoke", "lora_sync.json")
    load_before = uptime()
    print(f"load before: {load_before}", flush=True)

    with tempfile.TemporaryDirectory(prefix="grpo_bench_lora_") as tmp:  # the smoke's tiny model, while engines run
        path = build_tiny_model(os.path.join(tmp, "model")) if args.smoke else build_smollm2()
        return measure(args, path, load_before)


def measure(args: argparse.Namespace, path: str, load_before: str) -> dict:
    """The bench itself on the model in `path`; its results (also written to `args.out`)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(model, lora).eval()
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]  # the tiny smoke model's vocabulary is small
    gen = torch.Generator().manual_seed(0)
    nudge(model, gen)  # lora_B starts at zero: make the adapter visible from the first sync

    common = {"max_model_len": 256, "bucket_mb": args.bucket_mb, "separate_process": True}
    t0 = time.perf_counter()
    engines = {
        "adapter": VLLMColocateBackend(path, lora_rank=adapter_max_rank(model), **common),
        "merged": VLLMColocateBackend(path, **common),
    }
    print(f"two engines up in {time.perf_counter() - t0:.0f} s", flush=True)
    publishers = {m: PolicyPublisher(SharedBackend(lambda b=b: b), adapter=m == "adapter") for m, b in engines.items()}
    results: dict = {
        "model": "tiny test model (smoke)" if args.smoke else "SmolLM2-135M-Instruct (float32)",
        "lora": {"r": args.rank, "alpha": 2 * args.rank, "targets": TARGETS},
        "transport": "shared memory into the engine process (separate_process=True)",
        "bucket_mb": args.bucket_mb,
        "repeats": args.repeats,
        "device": f"CPU x{os.cpu_count()}",
        "load_before": load_before,
    }
    try:
        version = 0
        for mode, pub in publishers.items():  # warm-up (first install, first reload), then: is it the policy?
            pub.publish(model, version)
            results[mode] = {
                "warmup_s": pub.last["seconds"],
                "logprob_gap": max_logprob_gap(engines[mode], model, prompts),
            }
            print(
                f"{mode:7s} warm-up {pub.last['seconds']:.3f} s, {pub.last['tensors']} tensors, "
                f"{pub.last['bytes'] / 1e6:.2f} MB; sampler vs HF PEFT logprobs: max gap "
                f"{results[mode]['logprob_gap']:.2e}",
                flush=True,
            )
        times: dict[str, list[float]] = {"adapter": [], "merged": []}
        for i in range(args.repeats):
            version += 1
            nudge(model, gen)
            for mode in ("adapter", "merged") if i % 2 == 0 else ("merged", "adapter"):
                times[mode].append(publishers[mode].publish(model, version))
        for mode, pub in publishers.items():
            r = results[mode]
            r.update(
                tensors=pub.last["tensors"],
                bytes=pub.last["bytes"],
                seconds=[round(s, 4) for s in times[mode]],
                median_s=statistics.median(times[mode]),
                logprob_gap_after=max_logprob_gap(engines[mode], model, prompts),  # still the policy after the repeats
            )
            r["MB_per_s"] = r["bytes"] / r["median_s"] / 1e6
            print(
                f"{mode:7s} {r['tensors']:4d} tensors {r['bytes'] / 1e6:8.2f} MB | median {r['median_s']:.3f} s "
                f"of {r['seconds']} | {r['MB_per_s']:.0f} MB/s | logprob gap after {r['logprob_gap_after']:.2e}",
                flush=True,
            )
    finally:
        for b in engines.values():
            b.close()
    results["speedup"] = results["merged"]["median_s"] / results["adapter"]["median_s"]
    results["bytes_ratio"] = results["merged"]["bytes"] / results["adapter"]["bytes"]
    results["load_after"] = uptime()
    print(f"load after:  {results['load_after']}")
    print(
        f"adapter-only sends {results['bytes_ratio']:.1f}x fewer bytes and syncs {results['speedup']:.1f}x faster "
        "than merged full weights"
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")
    print(f"RESULT lora_sync_speedup={results['speedup']:.2f}")
    return results


if __name__ == "__main__":
    main()
