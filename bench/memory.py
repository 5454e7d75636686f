"""Trainer-process peak memory: padding-free packing vs padded rows, and reference logps from a frozen
`grpo-async serve` server vs an in-process reference copy.

What it measures: each variant runs in a fresh Python process (so one variant's freed-but-kept heap never hides
another's peak) and reports its peak resident set (`VmHWM`, i.e. `ru_maxrss`), the only number that counts torch's
CPU tensors (plain malloc) together with everything else.

1. packing (`GRPOConfig.padding_free`): one training micro-batch of `--rows` rows with skewed lengths (one row of
   `--long` tokens, the others `--short`; seed 004's case: a few long completions pad a whole batch to their length).
   The trainer's own code runs on it: the old-logps pass where the product runs one (`trainer.consumer.old_logps`;
   none with the defaults here: π_old is the training forward's own, `InForwardImportanceSampling`) then
   `compute_loss` + backward. The number is the peak *during the step* (`VmHWM` reset just before it through
   `/proc/self/clear_refs`) minus the resident set just before it (model, trainer), i.e. the activations, logits and
   attention temporaries it needs.
2. token budget (`GRPOConfig.token_budget`): `--tb_rows` rows of long-tailed lengths (Pareto, most rows short, one
   of `--tb_long` tokens), one training step (`compute_loss` + backward, padding-free) split by a budget of
   `--tb_budget` token positions per forward pass (the packed `[K, W]`, filler included; the positions of each pass
   are printed, read at the model's input), against the row-based split that fits the same peak: micro-batches of
   `k = tb_budget // tb_long` rows (gradient accumulation over them), the most rows whose worst case (k rows of the
   longest length) stays within the budget; 2k and 4k rows are measured too (their worst case does not fit). The
   budget's bound (`tb_bound`) is the step peak of 4 passes at the budget's worst case: k bins of `--tb_long`
   positions (its most positions in its widest bins: a padding-free bin is as long as the pass's longest row), one
   holding a row of `--tb_long`, the others two rows of half that each. Several rows in a bin make transformers build
   the packed-sequence mask `[K, 1, W, W]`, which attention keeps per layer for the backward pass (measured with
   torch's memory profiler, this tiny model, passes of 2 bins of 1,024: 201 MB of activations with one row per bin,
   233 MB with several, 32 MB = 4 layers × 2 × 1,024² float32); bins of one row each, the bound before, need no mask
   (plain causal attention) and are not the worst case.
3. reference (`GRPOConfig.ref_server_url`): the peak of the whole trainer process (construction with beta > 0 and
   one ref-logps pass over the same rows), with the reference copy in-process vs asked from a server.

The limit it compares to: padded rows cost `rows × longest` token positions (and `rows × longest²` attention
scores), packed rows `Σ lengths` (and one `(Σ lengths)²` block-diagonal mask), so on this batch the activation part
can shrink by up to `rows × longest / Σ lengths`; the fixed part (weights, gradients, allocator slack) does not
shrink. The in-process reference costs one more copy of the weights plus its forward's temporaries. A token budget
bounds each forward pass by its tokens whatever the lengths; a fixed row count must be sized for its longest rows, so
on long-tailed lengths its passes hold far fewer tokens than the budget allows.

How to read the ratios: `packing_memory_ratio = padded / packed` step peak (> 1: packing needs that many times less;
target ≥ 1.5 on the default batch); `ref_memory_ratio = in-process / server` trainer peak (> 1: the server saves
that much of the trainer's memory); `token_budget_peak_ratio = token-budget step peak / the budget's bound` (goal
≤ 1) and `token_budget_throughput_ratio = tokens per second of the token-budget step / of the row-based split of k
rows` (goal ≥ 1.3). Times of the packed/padded steps are printed too (2 cores: rough).

Run: `python bench/memory.py` (~5 min on 2 cores: nine fresh processes and one server). Writes
`bench/out/memory.json`; ends with the `RESULT` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the policy of the packing variants: small weights, so activations dominate the step
SPEC = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4)
#: the model of the reference variants: weights large enough that a second copy shows
REF_SPEC = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12
)


def peak_mb() -> float:
    """Peak resident set of this process since it started or since `reset_peak()` (Linux VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # pragma: no cover (not Linux)


def reset_peak() -> float:
    """Hand freed heap back to the OS, reset the peak to the current resident set (Linux `clear_refs` 5) and
    return it: what a step adds is then `peak_mb() - reset_peak()`."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_mb()


def make_rows(rows: int, long: int, short: int, vocab: int):
    """One long row, the others short; prompts a quarter of each row. Left-padded prompts, right-padded completions."""
    return rows_of_lengths([long] + [short] * (rows - 1), vocab)


def tailed_lengths(rows: int, long: int, scale: int = 48, alpha: float = 1.5, seed: int = 0) -> list[int]:
    """Long-tailed row lengths: Pareto(`alpha`) from `scale` tokens, capped at `long`, one row exactly `long`, in
    random order. Example (rows 64, long 1024): mostly 48-150 tokens, a few hundred-token rows, one of 1024."""
    import torch

    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=g).clamp(min=1e-6)
    lengths = (scale * u ** (-1 / alpha)).clamp(max=long).long()  # [rows]
    lengths[torch.randint(rows, (1,), generator=g)] = long
    return lengths.tolist()


def rows_of_lengths(lengths: list[int], vocab: int):
    """A `MicroBatch` of rows of `lengths` tokens, prompts a quarter of each row (left-padded prompts, right-padded
    completions)."""
    import torch

    rows = len(lengths)
    g = torch.Generator().manual_seed(0)
    p_len = torch.tensor([max(1, n // 4) for n in lengths])
    c_len = torch.tensor(lengths) - p_len
    P, T = int(p_len.max()), int(c_len.max())
    prompt_mask = (torch.arange(P) >= P - p_len[:, None]).long()  # [B, P]
    completion_mask = (torch.arange(T) < c_len[:, None]).long()  # [B, T]
    from grpo_async.pipeline.types import MicroBatch

    return MicroBatch(
        prompt_ids=torch.randint(7, vocab, (rows, P), generator=g) * prompt_mask,  # [B, P]
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(7, vocab, (rows, T), generator=g) * completion_mask,  # [B, T]
        completion_mask=completion_mask,
        loss_mask=completion_mask.clone(),
        rollout_logps=torch.zeros(rows, T),  # what the IS weights come to does not change the memory measured
        advantages=torch.randn(rows, generator=g),
        policy_version=torch.zeros(rows, dtype=torch.long),
        round_id=torch.zeros(rows, dtype=torch.long),
        row_index=torch.arange(rows),
        num_items_in_batch=float(completion_mask.sum()),
    )


def token_budget_child(a) -> dict:
    """One token-budget variant (`tb_bound`, `tb_budget`, `tb_rows_<k>`) in this fresh process: its step peak, the
    fastest of `--tb_repeats` steps and the tokens it trained."""
    import torch

    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    torch.manual_seed(0)
    k_safe = a.tb_budget // a.tb_long
    if a.variant == "tb_bound":  # passes at the budget's worst case, 4 of them (several passes, as the others: what
        # the allocator keeps between passes counts in a step's peak too): k bins of tb_long, the first one row, the
        # others two rows each (several rows in a bin: the packed-sequence mask, as in the budget's passes)
        half = a.tb_long // 2
        one_pass = [a.tb_long] + [half, a.tb_long - half] * (k_safe - 1)
        lengths, per_pass, budget = one_pass * 4, len(one_pass), None
    else:
        lengths = tailed_lengths(a.tb_rows, a.tb_long)
        budget = a.tb_budget if a.variant == "tb_budget" else None
        per_pass = len(lengths) if budget else int(a.variant.rsplit("_", 1)[1])
    accumulation = len(lengths) // per_pass
    args = GRPOConfig(
        output_dir=os.path.join(a.tmp, a.variant),
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=per_pass,
        gradient_accumulation_steps=accumulation,
        num_generations=2,
        max_completion_length=a.tb_long,
        max_prompt_length=a.tb_long,
        padding_free=True,
        token_budget=budget,
        share_prompt_prefix=False,  # every prompt differs here; nothing to share
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    t = GRPOTrainer(model=a.model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(len(lengths)))
    rows = rows_of_lengths(lengths, t.model.config.vocab_size)
    t.current_gradient_accumulation_steps = accumulation  # what the training loop sets before its micro-steps
    t.model.train()
    positions = []  # token positions of each forward pass, at the model's input
    t.model.register_forward_pre_hook(lambda m, args, kw: positions.append(kw["input_ids"].numel()), with_kwargs=True)

    def step() -> float:
        t0 = time.perf_counter()
        for start in range(0, len(lengths), per_pass):  # the micro-batches of one optimizer step
            loss = t.compute_loss(t.model, rows.select(slice(start, start + per_pass)).trim())
            t.accelerator.backward(loss)
        t.model.zero_grad(set_to_none=False)
        return time.perf_counter() - t0

    step()  # warm-up, untimed: first-call costs (allocator, kernels, the padding-free check)
    positions.clear()
    before = reset_peak()
    times = [step() for _ in range(a.tb_repeats)]
    return {
        "step_peak_mb": peak_mb() - before,
        "seconds": min(times),
        "times": times,
        "tokens": sum(lengths),
        "rows_per_pass": per_pass,
        "passes": accumulation if budget is None else None,
        "pass_positions": positions[: len(positions) // a.tb_repeats],  # one step's passes
    }


def children(a) -> dict[str, dict]:
    """The variants of `--child` (comma-separated), one after the other in this process: their measurements."""
    out = {}
    for variant in a.child.split(","):
        a.variant = variant
        out[variant] = child(a)
    return out


def child(a) -> dict:
    """One variant (`a.variant`) in this process; returns its measurements."""
    import dataclasses

    if a.variant.startswith("tb_"):
        return token_budget_child(a)
    import torch

    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    torch.manual_seed(0)
    packed = a.variant == "packed"
    ref = a.variant.startswith("ref_")
    start = peak_mb()
    args = GRPOConfig(
        output_dir=os.path.join(a.tmp, a.variant),
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=a.rows,
        num_generations=2,
        max_completion_length=a.long,
        max_prompt_length=a.long,
        padding_free=packed or ref,
        beta=0.04 if ref else 0.0,
        ref_server_url=a.server if a.variant == "ref_server" else None,
        vllm_api_key="bench",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    t = GRPOTrainer(model=a.model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(a.rows))
    rows = make_rows(a.rows, a.long, a.short, t.model.config.vocab_size)
    n_params = sum(p.numel() for p in t.model.parameters()) / 1e6
    T = rows.completion_ids.size(1)
    ids = torch.cat([rows.prompt_ids, rows.completion_ids], 1)  # [B, P+T]
    mask = torch.cat([rows.prompt_mask, rows.completion_mask], 1)  # [B, P+T]
    if ref:
        with torch.no_grad():
            t.consumer.ref_logps(ids, mask, T)
        return {"peak_mb": peak_mb(), "start_mb": start, "params_m": n_params}
    t.current_gradient_accumulation_steps = 1  # what the training loop sets before its micro-steps
    t.model.train()
    before = reset_peak()
    t0 = time.perf_counter()
    if t.consumer.old_logps is not None:  # else π_old is the training forward's own (InForwardImportanceSampling)
        with torch.no_grad():
            old, _ = t.consumer.old_logps(ids, mask, T, None)  # [B, T] (no kept sets: nothing was cut)
            rows = dataclasses.replace(rows, old_logps=old)
    loss = t.compute_loss(t.model, rows)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {
        "step_peak_mb": peak_mb() - before,
        "peak_mb": peak_mb(),
        "seconds": seconds,
        "loss": loss.item(),
        "params_m": n_params,
    }


def run_children(a, variants: list[str], model: str, server: str | None = None) -> dict[str, dict]:
    """The measurements of `variants`, each in a fresh process of its own (its peak is its own); a smoke run measures
    them all in one process, a fork of a warm interpreter (it checks the bench's path, its numbers mean nothing: 2
    forks instead of 9 fresh processes)."""
    from _runs import run_python, run_record

    out = {}
    for group in [variants] if a.smoke else [[v] for v in variants]:
        args = ["--child", ",".join(group), "--model", model, "--tmp", a.tmp]
        args += ["--rows", str(a.rows), "--long", str(a.long), "--short", str(a.short)]
        args += ["--tb_rows", str(a.tb_rows), "--tb_long", str(a.tb_long), "--tb_budget", str(a.tb_budget)]
        args += ["--tb_repeats", str(a.tb_repeats)] + (["--server", server] if server else [])
        out.update(run_record(run_python(os.path.abspath(__file__), args, timeout=1200, warm=a.smoke), group))
    return out


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=16, help="rows of the micro-batch")
    p.add_argument("--long", type=int, default=512, help="tokens of the one long row (prompt + completion)")
    p.add_argument("--short", type=int, default=48, help="tokens of every other row")
    p.add_argument("--tb_rows", type=int, default=64, help="token budget: rows of the long-tailed step")
    p.add_argument("--tb_long", type=int, default=1024, help="token budget: the longest row's tokens")
    p.add_argument("--tb_budget", type=int, default=2048, help="token budget: tokens per forward pass")
    p.add_argument("--tb_repeats", type=int, default=2, help="token budget: timed steps per variant (fastest kept)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, warm forks: checks the bench runs (seconds)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    p.add_argument("--server", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.smoke:
        a.rows, a.long, a.short = 4, 64, 16
        a.tb_rows, a.tb_long, a.tb_budget, a.tb_repeats = 16, 128, 256, 1
    if a.child:
        print("RUN " + json.dumps(children(a)), flush=True)
        return 0.0

    with tempfile.TemporaryDirectory(prefix="grpo_bench_memory_") as a.tmp:  # the models, the children's outputs
        return measure(a)


def measure(a: argparse.Namespace) -> float:
    """The bench itself, its scratch files in `a.tmp`; the packed / padded step-peak ratio."""
    from _runs import launch_bench_server

    from grpo_async.generation.server_process import TWO_PROCESS_ENV
    from grpo_async.testing import TinyModelSpec, build_tiny_model

    pos = {"max_position_embeddings": 2 * max(a.long, a.tb_long), "seed": 0}
    model = build_tiny_model(os.path.join(a.tmp, "model"), TinyModelSpec(**SPEC, **pos))
    ref_model = build_tiny_model(os.path.join(a.tmp, "ref_model"), TinyModelSpec(**REF_SPEC, **pos))
    k = a.tb_budget // a.tb_long
    if k < 1 or a.tb_rows % (4 * k):
        raise SystemExit(
            f"--tb_budget {a.tb_budget} must hold a row of --tb_long {a.tb_long}; --tb_rows a multiple of 4k"
        )
    tb_variants = ["tb_bound", "tb_budget", *(f"tb_rows_{m * k}" for m in (1, 2, 4))]
    res = run_children(a, ["padded", "packed", *tb_variants], model)
    server = launch_bench_server(  # smoke: forked from a warm interpreter, the worker inside the engine-core process
        ref_model,
        ["--dtype", "float32", "--max-model-len", str(2 * a.long), "--enforce-eager"],
        api_key="bench",
        env=TWO_PROCESS_ENV if a.smoke else None,
        ready_timeout=300,
        warm=a.smoke,
    )
    try:
        res.update(run_children(a, ["ref_inprocess", "ref_server"], ref_model, server.url))
    finally:
        server.stop()

    tokens_padded = a.rows * (max(1, a.long // 4) + a.long - max(1, a.long // 4))
    tokens_packed = a.long + (a.rows - 1) * a.short
    pad, pk = res["padded"], res["packed"]
    ratio = pad["step_peak_mb"] / pk["step_peak_mb"]
    ref_ratio = res["ref_inprocess"]["peak_mb"] / res["ref_server"]["peak_mb"]
    print(
        f"batch: {a.rows} rows, one of {a.long} tokens, {a.rows - 1} of {a.short}: "
        f"padded {tokens_padded} token positions, packed {tokens_packed} ({tokens_padded / tokens_packed:.1f}x fewer)"
    )
    print(f"policy: tiny Llama, {pad['params_m']:.1f} M params, float32, sdpa attention")
    for name in ("padded", "packed"):
        r = res[name]
        print(
            f"{name:>7}: step peak +{r['step_peak_mb']:8.1f} MB (process peak {r['peak_mb']:.1f} MB), "
            f"old logps + loss + backward {r['seconds']:.2f} s, loss {r['loss']:.6f}"
        )
    print(
        f"packing: padded / packed step peak = {ratio:.2f}x (target >= 1.5x); "
        f"padded / packed time {pad['seconds'] / pk['seconds']:.2f}x"
    )
    for name in ("ref_inprocess", "ref_server"):
        print(f"{name:>13}: trainer process peak {res[name]['peak_mb']:.1f} MB")
    print(
        f"reference model: {res['ref_server']['params_m']:.1f} M params "
        f"(a float32 copy: {res['ref_server']['params_m'] * 4:.0f} MB)"
    )
    print(f"reference: in-process / server trainer peak = {ref_ratio:.2f}x")
    lengths = tailed_lengths(a.tb_rows, a.tb_long)
    print(
        f"token budget: {a.tb_rows} rows of long-tailed lengths (median {sorted(lengths)[len(lengths) // 2]}, "
        f"max {max(lengths)}, {sum(lengths)} tokens), budget {a.tb_budget} tokens per pass; row-based split sized "
        f"for the longest rows: {k} rows per pass"
    )
    for v in tb_variants:
        r = res[v]
        r["tokens_per_second"] = r["tokens"] / r["seconds"]
        bound = f"bound: 4 passes of {k} bins of {a.tb_long}, several rows in a bin"
        what = {"tb_bound": bound, "tb_budget": "token budget"}.get(v, "")
        what = what or f"{r['rows_per_pass']} rows per pass ({r['passes']} passes)"
        print(
            f"{v:>11}: step peak +{r['step_peak_mb']:8.1f} MB, step {r['seconds']:.2f} s, "
            f"{r['tokens_per_second']:.0f} tokens/s  [{what}; positions per pass {r['pass_positions']}]"
        )
    tb_peak = res["tb_budget"]["step_peak_mb"] / res["tb_bound"]["step_peak_mb"]
    tb_speed = res["tb_budget"]["tokens_per_second"] / res[f"tb_rows_{k}"]["tokens_per_second"]
    print(
        f"token budget: step peak {tb_peak:.2f}x the budget's bound (goal <= 1); {tb_speed:.2f}x the tokens per "
        f"second of {k} rows per pass (goal >= 1.3)"
    )
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "smoke" if a.smoke else "")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "memory.json"), "w") as f:
        json.dump(
            {
                "results": res,
                "packing_memory_ratio": ratio,
                "ref_memory_ratio": ref_ratio,
                "token_budget_peak_ratio": tb_peak,
                "token_budget_throughput_ratio": tb_speed,
                "token_budget_rows_per_pass": k,
                "args": vars(a),
            },
            f,
        )
    print(f"RESULT ref_memory_ratio={ref_ratio:.2f}")
    print(f"RESULT packing_memory_ratio={ratio:.2f}")
    print(f"RESULT token_budget_peak_ratio={tb_peak:.2f}")
    print(f"RESULT token_budget_throughput_ratio={tb_speed:.2f}")
    return ratio


if __name__ == "__main__":
    main()
