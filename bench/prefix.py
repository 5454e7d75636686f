"""Shared-prompt forward benchmark (issue 25): the old-logps stage and one training step with the prompt of a GRPO
group computed once (`share_prompt_prefix`, `algo.prefix_sharing`) against once per completion, side by side.

What it measures: SmolLM2-135M (float32), one group of G = 8 completions of one prompt.
- old-logps stage: `LogpsScorer` (the consumer's scorer: no grad, one chunk of G rows) on `[prompt, completion]` rows;
- training step: `score_tokens` with gradient and entropies (as `compute_loss`), the DAPO loss, backward and one AdamW
  step, on the same G rows.
Each is timed shared (`share_prefix=True`, the cost model choosing the trees) and unshared (the packed path), the two
alternated (median of `--repeats` old-logps passes, `--step_repeats` steps). Shapes: prompt 256 / completion 32 (the
case sharing is for: tool or retrieval prompts with short answers) and prompt 32 / completion 256 (long answers: a
tree would cost more attention than it saves, so the cost model must leave the group unshared and the ratio must
stay ≥ 0.95; timed on the old-logps stage, with one tree forced beside it to show what the cost model avoided).

The limit it compares to: the FLOPs. At 256 / 32 the unshared rows hold 8 × 288 = 2,304 tokens, the tree 512: ≤ 4.5×
fewer token-FLOPs (attention over 512² pairs once vs 288² eight times). Fixed per-call costs and the LM head (the same
256 completion positions either way) keep the measured ratio below that.

A round's micro-batches (`--groups` prompts × G rows dealt to `--steps` micro-batches, one optimizer step over all of
them, sharing on in both): rows shuffled (the consumer's deal before `keep_groups`: a micro-batch holds a few rows of
each of several groups) against whole groups kept together (`algo.prefix_sharing.group_permutation`, what the
consumer deals when `keep_groups_together` says so), the same seed. The tokens each deal computes are printed.

How to read it: `prefix_logps_speedup = time(unshared) / time(shared)` on the old-logps stage (goal ≥ 2.5),
`prefix_step_speedup` likewise on the training step (goal ≥ 2); `prefix_long_completion_ratio` is the old-logps ratio
at 32 / 256 with the default (goal ≥ 0.95); `prefix_round_step_speedup = time(rows shuffled) / time(groups kept)`
for the round's training step. Log-probs of every mode are checked against the unshared ones (max abs
difference printed).

Run: `python bench/prefix.py` (~20 min on 2 loaded cores; `--only round`: the round's step alone, written to
`bench/out/prefix_round.json`); `--smoke`: the tiny model, short rows, 1 repeat (seconds; run by
tests/test_benches.py). Writes `bench/out/prefix.json`; ends with the `RESULT` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from grpo_async.algo.logprobs import LogpsScorer, score_tokens  # noqa: E402
from grpo_async.algo.loss import LossContext, LossSettings, grpo_loss  # noqa: E402
from grpo_async.algo.prefix_sharing import (  # noqa: E402
    SharingCost,
    group_permutation,
    pack_shared,
    sharing_cost,
)

ONE_TREE = SharingCost(per_token=1.0, per_pair=0.0)  # every group as one tree, whatever it costs


def make_group(G: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0):
    """One prompt × G completions: rows `[G, P+T]`, completions of 3/4 to full length (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (1, prompt_len), generator=g).repeat(G, 1)  # [G, P]
    completion = torch.randint(3, vocab, (G, completion_len), generator=g)  # [G, T]
    lengths = torch.randint(3 * completion_len // 4, completion_len + 1, (G,), generator=g)
    cmask = (torch.arange(completion_len) < lengths[:, None]).long()  # [G, T]
    ids = torch.cat([prompt, completion * cmask], 1)  # [G, P+T]
    return ids, torch.cat([torch.ones_like(prompt), cmask], 1)


def logps_stage(model, ids, mask, T, share) -> tuple[float, torch.Tensor]:
    scorer = LogpsScorer(lambda: model, temperature=1.0, padding_free=True, device="cpu", share_prefix=share)
    t0 = time.perf_counter()
    logps = scorer(ids, mask, T)
    return time.perf_counter() - t0, logps


def train_step(model, optimizer, ids, mask, T, share) -> float:
    t0 = time.perf_counter()
    scores = score_tokens(model, ids, mask, T, 1.0, None, True, entropy=True, share_prefix=share)
    cmask = mask[:, -T:].float()  # [G, T]
    advantages = torch.linspace(-1, 1, ids.size(0))  # [G]
    out = grpo_loss(
        scores.logps,
        advantages,
        cmask,
        settings=LossSettings(loss_type="dapo"),
        old_per_token_logps=scores.logps.detach(),
        ctx=LossContext(num_items_in_batch=float(cmask.sum())),
    )
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def make_round(groups: int, G: int, prompt_len: int, completion_len: int, vocab: int):
    """`groups` prompts × G completions, a group's rows consecutive (as generated): rows `[groups·G, P+T]`."""
    parts = [make_group(G, prompt_len, completion_len, vocab, seed=k) for k in range(groups)]
    return torch.cat([ids for ids, _ in parts]), torch.cat([mask for _, mask in parts])


def round_step(model, optimizer, ids, mask, T, order, steps: int) -> tuple[float, int]:
    """One optimizer step over a round dealt in `order` to `steps` micro-batches (each forward with gradient,
    entropies and the DAPO loss normalised over the round, backward), sharing on. Returns seconds and the tokens the
    forward passes computed (tree or row positions)."""
    cost, tokens = sharing_cost(model), 0
    t0 = time.perf_counter()
    items = float(mask[:, -T:].sum())  # loss tokens of the round
    for part in order.chunk(steps):
        b_ids, b_mask = ids[part], mask[part]
        scores = score_tokens(model, b_ids, b_mask, T, 1.0, None, True, entropy=True, share_prefix=True)
        cmask = b_mask[:, -T:].float()  # [B, T]
        out = grpo_loss(
            scores.logps,
            torch.linspace(-1, 1, len(part)),
            cmask,
            settings=LossSettings(loss_type="dapo"),
            old_per_token_logps=scores.logps.detach(),
            ctx=LossContext(num_items_in_batch=items, grad_accum_steps=steps, steps_per_generation=steps),
        )
        out.loss.backward()
        packed = pack_shared(b_ids, b_mask, T, cost)
        tokens += int(b_mask.sum()) if packed is None else int(packed.real.sum())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, tokens


def measure_round(model, optimizer, groups: int, G: int, P: int, T: int, steps: int, repeats: int) -> dict:
    """Median seconds of the round's step with rows shuffled and with groups kept together (alternated)."""
    ids, mask = make_round(groups, G, P, T, model.config.vocab_size)
    deals = {
        "rows_shuffled": torch.randperm(len(ids), generator=torch.Generator().manual_seed(0)),
        "groups_kept": group_permutation(ids[:, :P], mask[:, :P], torch.Generator().manual_seed(0)),
    }
    times, tokens = {d: [] for d in deals}, {}
    for r in range(repeats):
        for name, order in deals.items():
            dt, tokens[name] = round_step(model, optimizer, ids, mask, T, order, steps)
            times[name].append(dt)
            print(f"  round of {groups}x{G} rows, {steps} micro-batches, {name} #{r + 1}: {dt:.2f} s", flush=True)
    return {
        "step_s": {d: statistics.median(v) for d, v in times.items()},
        "step_times": times,
        "tokens": {**tokens, "unshared": int(mask.sum())},
        "groups_per_micro_batch": {
            d: [len({tuple(ids[i, :P].tolist()) for i in part.tolist()}) for part in order.chunk(steps)]
            for d, order in deals.items()
        },
    }


def measure(model, optimizer, G, P, T, repeats: int, step_repeats: int, modes: dict) -> dict:
    """Median seconds of the logps stage (`repeats`) and of the training step (`step_repeats`, 0: not timed) per mode,
    the modes alternated, and the logps' max difference from the unshared ones."""
    ids, mask = make_group(G, P, T, model.config.vocab_size)
    logps_t = {m: [] for m in modes}
    step_t = {m: [] for m in modes}
    logps = {}
    for r in range(repeats):
        for name, share in modes.items():
            dt, logps[name] = logps_stage(model, ids, mask, T, share)
            logps_t[name].append(dt)
            print(f"  P={P} T={T} old-logps {name} #{r + 1}: {dt:.2f} s", flush=True)
    for r in range(step_repeats):
        for name, share in modes.items():
            step_t[name].append(train_step(model, optimizer, ids, mask, T, share))
            print(f"  P={P} T={T} training step {name} #{r + 1}: {step_t[name][-1]:.2f} s", flush=True)
    real = mask[:, -T:].bool()
    diff = max((logps[m] - logps["unshared"])[real].abs().max().item() for m in modes)
    trees = pack_shared(ids, mask, T, sharing_cost(model))
    return {
        "logps_s": {m: statistics.median(v) for m, v in logps_t.items()},
        "step_s": {m: statistics.median(v) for m, v in step_t.items() if v},
        "logps_times": logps_t,
        "step_times": step_t,
        "max_abs_diff": diff,
        "default_shares": trees is not None,
        "tokens": {"unshared": int(mask.sum()), "shared": P + int(mask[:, -T:].sum())},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--completion_len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed old-logps passes per mode")
    p.add_argument("--step_repeats", type=int, default=1, help="timed training steps per mode")
    p.add_argument("--groups", type=int, default=4, help="prompts of the round (the round's step)")
    p.add_argument("--steps", type=int, default=4, help="micro-batches the round is dealt to (the round's step)")
    p.add_argument("--only", choices=["round"], default=None, help="run only the round's step")
    p.add_argument("--smoke", action="store_true", help="tiny model, short rows, 1 repeat (seconds)")
    a = p.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if a.smoke:
        from grpo_async.testing import build_tiny_model

        a.G, a.prompt_len, a.completion_len, a.repeats, a.step_repeats, a.steps = 4, 48, 8, 1, 1, 2
        with tempfile.TemporaryDirectory(prefix="grpo_bench_prefix_") as tmp:
            model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp + "/model"), dtype=torch.float32)
    else:
        from grpo_async.testing import build_smollm2

        model = AutoModelForCausalLM.from_pretrained(build_smollm2(), dtype=torch.float32)
    model.train()  # SmolLM2 has no dropout: train mode changes nothing but what compute_loss would see
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    n_params = sum(x.numel() for x in model.parameters()) / 1e6
    print(f"model: {n_params:.1f} M params, float32, torch threads {torch.get_num_threads()}, G = {a.G}")
    modes = {"unshared": False, "shared": True}
    warm_ids, warm_mask = make_group(2, 16, 4, model.config.vocab_size)
    for share in modes.values():  # warm-up (allocator, the probe of sharing_supported) on a small group
        logps_stage(model, warm_ids, warm_mask, 4, share)
        train_step(model, optimizer, warm_ids, warm_mask, 4, share)
    res, rows, raw = {}, [], {"args": vars(a)}
    if a.only is None:
        res, rows, raw = one_group(a, model, optimizer, modes)
    rnd = measure_round(model, optimizer, a.groups, a.G, a.prompt_len, a.completion_len, a.steps, a.step_repeats)
    res["prefix_round_step_speedup"] = rnd["step_s"]["rows_shuffled"] / rnd["step_s"]["groups_kept"]
    tokens, prompts = rnd["tokens"], rnd["groups_per_micro_batch"]
    print(
        f"round of {a.groups} prompts x G={a.G} ({a.prompt_len} / {a.completion_len}) dealt to {a.steps} "
        f"micro-batches, sharing on: tokens computed {tokens['rows_shuffled']} rows shuffled, "
        f"{tokens['groups_kept']} groups kept ({tokens['unshared']} unshared); prompts per micro-batch "
        f"{prompts['rows_shuffled']} vs {prompts['groups_kept']}"
    )
    for deal, sec in rnd["step_s"].items():
        print(f"  {deal:13s} training step {sec:.3f} s (median; fastest {min(rnd['step_times'][deal]):.3f} s)")
    rows.append(
        {
            "metric": f"training step of a round, {a.groups} prompts x G={a.G} in {a.steps} micro-batches, "
            f"prompt {a.prompt_len} / completion {a.completion_len}, sharing on (s)",
            "ours": rnd["step_s"]["groups_kept"],
            "peer": rnd["step_s"]["rows_shuffled"],
            "peer_name": "rows shuffled",
            "ratio": res["prefix_round_step_speedup"],
        }
    )
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "smoke" if a.smoke else "")
    os.makedirs(out_dir, exist_ok=True)
    name = "prefix.json" if a.only is None else f"prefix_{a.only}.json"  # a partial run never replaces the full JSON
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({**raw, "round": rnd, **res, "rows": rows}, f)
    for k, v in res.items():
        print(f"RESULT {k}={v:.2f}")
    return res


def one_group(a, model, optimizer, modes) -> tuple[dict, list[dict], dict]:
    """The one-group measurements: old-logps stage and training step at prompt/completion, old-logps stage at
    completion/prompt. Returns the RESULT values, the table rows and the raw measurements."""
    short = measure(model, optimizer, a.G, a.prompt_len, a.completion_len, a.repeats, a.step_repeats, modes)
    # long completions: the default must not be slower; one tree forced shows what the cost model avoids (logps only)
    long_modes = {**modes, "one_tree": ONE_TREE}
    long = measure(model, optimizer, a.G, a.completion_len, a.prompt_len, a.repeats, 0, long_modes)
    res = {
        "prefix_logps_speedup": short["logps_s"]["unshared"] / short["logps_s"]["shared"],
        "prefix_step_speedup": short["step_s"]["unshared"] / short["step_s"]["shared"],
        "prefix_long_completion_ratio": long["logps_s"]["unshared"] / long["logps_s"]["shared"],
    }
    for m, (P, T) in ((short, (a.prompt_len, a.completion_len)), (long, (a.completion_len, a.prompt_len))):
        print(
            f"prompt {P} / completion {T}: tokens {m['tokens']['unshared']} unshared, {m['tokens']['shared']} as one "
            f"tree; the default cost model {'shares' if m['default_shares'] else 'does not share'}; "
            f"max |Δ logps| {m['max_abs_diff']:.2e}"
        )
        for mode in m["logps_s"]:
            step = f"   training step {m['step_s'][mode]:.3f} s" if mode in m["step_s"] else ""
            fastest = min(m["logps_times"][mode])
            print(f"  {mode:9s} old-logps stage {m['logps_s'][mode]:.3f} s (median; fastest {fastest:.3f} s){step}")
    one_tree = long["logps_s"]["unshared"] / long["logps_s"]["one_tree"]
    print(f"prompt {a.completion_len} / completion {a.prompt_len}, one tree forced: old-logps ratio {one_tree:.2f}x")
    rows = [
        {
            "metric": f"old-logps stage, prompt {a.prompt_len} / completion {a.completion_len}, G={a.G} (s)",
            "ours": short["logps_s"]["shared"],
            "peer": short["logps_s"]["unshared"],
            "peer_name": "prompt once per completion",
            "ratio": res["prefix_logps_speedup"],
        },
        {
            "metric": f"training step, prompt {a.prompt_len} / completion {a.completion_len}, G={a.G} (s)",
            "ours": short["step_s"]["shared"],
            "peer": short["step_s"]["unshared"],
            "peer_name": "prompt once per completion",
            "ratio": res["prefix_step_speedup"],
        },
        {
            "metric": f"old-logps stage, prompt {a.completion_len} / completion {a.prompt_len}, G={a.G} (s)",
            "ours": long["logps_s"]["shared"],
            "peer": long["logps_s"]["unshared"],
            "peer_name": "prompt once per completion",
            "ratio": res["prefix_long_completion_ratio"],
        },
    ]
    return res, rows, {"short": short, "long": long, "one_tree_ratio": one_tree}


if __name__ == "__main__":
    main()
