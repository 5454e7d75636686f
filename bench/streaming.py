"""Streaming benchmark: trained completion tokens per second, `async_mode="stream"` vs `"rounds"`, on long-tailed
completion lengths (and on uniform ones, where stream must not be slower).

Lengths are forced per prompt with the dataset's `generation_kwargs` column (`min_tokens = max_tokens = L`): L is
drawn once per prompt from a lognormal with median `--median` (16) and p99 `--p99` (256), capped at `--cap` (256), the
same draw for both modes (the prompts come in dataset order, `shuffle_dataset=False`, so both modes train the same
prompts with the same lengths). The uniform case gives every prompt the long-tailed draw's mean length, rounded.

Setup: the 2-core split of `bench/overlap.py`: one `grpo-async serve` server (vLLM, OpenMP bound to core 0) pinned to
core 0, shared by every run; each run is a fresh trainer process pinned to core 1 with one torch thread. Both modes:
the same model (2 layers, hidden 192), batch (`--prompts` prompts × G per step, one optimizer step per round),
`num_batches_ahead=1`, weight pushes in flight (`weight_sync_inflight=True`: the server freezes running requests
around a load in both modes, so neither drains the engine at a push), the same number of steps. Stream mode keeps
`max_inflight_groups` at its default (every group of the 2 rounds the pipeline holds).

Runs alternate in blocks, rounds / stream / stream / rounds, ... (`--repeats` of them per length distribution), so a
change of load hits both modes alike; the first `--warmup` steps of each run are left out. Per mode:

- trained completion tokens per second = Σ (completion tokens of each step's round) / Σ step wall time;
- `async/engine_busy`: the share of wall time the generator had work (a round, or a group, being generated);
- trainer wait per step: `async/trainer_wait`, seconds the trainer waited for the generator;
- stream only: `async/group_latency/p50`, `/p90` (seconds from a group's start to its rewards).

`RESULT stream_speedup` = stream ÷ rounds tokens/s on the long-tailed lengths (goal ≥ 1.5); `RESULT
uniform_ratio` the same on uniform lengths (goal ≥ 0.95); `RESULT engine_busy_stream` (goal ≥ 0.9).

Staleness policies (`GRPOConfig.staleness_policy`): on the long-tailed lengths, stream mode runs twice more per
repeat with `max_staleness=--max-staleness` (2), once with `"pace"` and once with `"drop"` (alternated). Each run
records every row it delivered to the trainer: its completion length and whether it was trained (a dropped row's
loss mask is all zero). Per policy, over the rows of the steps after the warm-up: the mean and p90 completion length
of the generated rows (every row delivered) and of the trained ones, and their ratio (trained ÷ generated: below 1
when dropping discards the long completions); the fraction dropped; trained completion tokens per second;
`async/pace_wait_s`. `RESULT staleness_<policy>_mean_ratio`, `..._p90_ratio`, `..._dropped`, and `RESULT
staleness_pace_vs_drop_tokens` (trained tokens/s, pace ÷ drop). `--staleness-only` runs just these.

Run: `python bench/streaming.py` (~10 min on 2 cores); `--smoke`: a 1-layer model, short runs, one repeat, each run a
fork of one warm interpreter. Writes `bench/out/streaming.json` and `bench/plots/streaming.png`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _runs import SERVER_ARGS, launch_pinned_server, median, run_python, run_record  # noqa: E402

MODES = ("rounds", "stream")
KEYS = (
    "completions/mean_length",
    "async/engine_busy",
    "async/trainer_wait",
    "async/inflight_groups",
    "async/group_latency/p50",
    "async/group_latency/p90",
    "async/staleness_max",
    "timing/wait_generation",
    "async/dropped_stale",
    "async/pace_wait_s",
)
POLICIES = ("pace", "drop")


def draw_lengths(n: int, median_len: float, p99: float, cap: int, seed: int = 0) -> list[int]:
    """`n` lengths from a lognormal with that median and 99th percentile (σ = ln(p99 / median) / z₀.₉₉), in
    [1, cap]."""
    sigma = math.log(p99 / median_len) / 2.3263478740408408
    rng = random.Random(seed)
    return [max(1, min(cap, round(median_len * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- one run (child)
def child(spec: dict) -> dict:
    """One trainer run against the shared server, pinned to core 1: per-step wall times and the logged metrics."""
    import torch

    os.sched_setaffinity(0, {spec["trainer_core"]})
    torch.set_num_threads(1)
    from _runs import StepClock

    from grpo_async import GRPOCallback, GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    P, G = spec["prompts"], spec["G"]
    lengths = spec["lengths"]
    ds = make_dataset(len(lengths), seed=0)
    ds = ds.add_column("generation_kwargs", [{"min_tokens": L, "max_tokens": L, "ignore_eos": True} for L in lengths])
    policy = spec.get("policy")  # staleness runs: "pace" or "drop" with max_staleness set
    limits = {"max_staleness": spec["max_staleness"], "staleness_policy": policy} if policy else {}
    rows: list[list[int]] = []  # [completion length, trained 0/1] of every row delivered to the trainer, by step

    class RowRecorder(GRPOCallback):  # what each micro-batch delivers to the loss (`on_micro_batch`)
        def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
            lengths = micro_batch.completion_mask.sum(1).tolist()  # [B]
            trained = micro_batch.loss_mask.any(1).tolist()  # [B] False: dropped as stale
            rows.extend([state.global_step, int(n), int(t)] for n, t in zip(lengths, trained, strict=True))

    with tempfile.TemporaryDirectory(prefix="bench_streaming_") as workdir:
        args = GRPOConfig(
            output_dir=workdir,
            use_cpu=True,
            per_device_train_batch_size=P * G,
            gradient_accumulation_steps=1,
            num_generations=G,
            max_prompt_length=32,
            max_completion_length=spec["cap"],
            shuffle_dataset=False,
            learning_rate=1e-6,
            lr_scheduler_type="constant",
            beta=0.0,
            num_batches_ahead=spec["ahead"],
            async_mode=spec["mode"],
            generation_backend="vllm_server",
            vllm_server_urls=[spec["url"]],
            vllm_max_concurrency=max(64, 2 * P * G),
            weight_sync_inflight=True,
            max_steps=spec["steps"],
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
            seed=0,
            disable_tqdm=True,
            **limits,
        )
        clock = StepClock()
        callbacks = [clock.callback, RowRecorder()]
        trainer = GRPOTrainer(
            model=spec["model"], reward_funcs=[letter_reward], args=args, train_dataset=ds, callbacks=callbacks
        )
        trainer.train()
        trainer.close()
    steps = [{k: log[k] for k in KEYS if k in log} for log in clock.logs if "loss" in log]
    return {"step_times": clock.step_times(), "steps": steps, "rows_per_step": P * G, "rows": rows}


def launch(spec: dict, log, timeout: float = 1200.0, warm: bool = False) -> dict:
    """One run (`--child`) in a fresh process, one thread (a fork of a warm interpreter with `warm`:
    `_runs.run_python`); its `RUN` record."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_python(os.path.abspath(__file__), ["--child", json.dumps(spec)], timeout=timeout, env=env, warm=warm)
    log.write(proc.stdout)
    log.flush()
    return run_record(proc, spec.get("policy") or spec["mode"])


# ---------------------------------------------------------------------------------------------- the numbers
def measure(runs: list[dict], warmup: int) -> dict:
    """Pooled over the runs of one (lengths, mode): tokens/s and the medians / means of the live metrics."""
    tokens = seconds = 0.0
    recs: dict[str, list[float]] = {k: [] for k in KEYS}
    for run in runs:
        for t, step in list(zip(run["step_times"], run["steps"], strict=False))[warmup:]:
            tokens += step.get("completions/mean_length", float("nan")) * run["rows_per_step"]
            seconds += t
            for k in KEYS:
                if k in step:
                    recs[k].append(step[k])
    mean = lambda k: statistics.fmean(recs[k]) if recs[k] else float("nan")  # noqa: E731
    return {
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "s_per_step": seconds / max(1, sum(max(0, len(r["step_times"]) - warmup) for r in runs)),
        "engine_busy": mean("async/engine_busy"),
        "trainer_wait": median(recs["async/trainer_wait"] or recs["timing/wait_generation"]),
        "group_latency_p50": mean("async/group_latency/p50"),
        "group_latency_p90": mean("async/group_latency/p90"),
        "inflight_groups": mean("async/inflight_groups"),
        "staleness_max": max(recs["async/staleness_max"], default=float("nan")),
        "steps": sum(max(0, len(r["step_times"]) - warmup) for r in runs),
    }


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)] if xs else float("nan")


def measure_lengths(runs: list[dict], warmup: int) -> dict:
    """Pooled over the runs of one staleness policy, rows of the steps after the warm-up: completion lengths of the
    rows generated (delivered to the trainer) and of those trained, the fraction dropped, trained tokens/s."""
    generated, trained, tokens, seconds, pace_wait = [], [], 0.0, 0.0, []
    for run in runs:
        for step, n, kept in run["rows"]:
            if step >= warmup:  # the optimizer steps counted from 0: step `warmup` is the first one measured
                generated.append(n)
                if kept:
                    trained.append(n)
                    tokens += n
        seconds += sum(run["step_times"][warmup:])
        pace_wait += [s["async/pace_wait_s"] for s in run["steps"][warmup:] if "async/pace_wait_s" in s]
    g_mean, t_mean = statistics.fmean(generated), statistics.fmean(trained) if trained else float("nan")
    return {
        "generated_rows": len(generated),
        "trained_rows": len(trained),
        "dropped": 1.0 - len(trained) / len(generated),
        "generated_mean": g_mean,
        "trained_mean": t_mean,
        "mean_ratio": t_mean / g_mean,
        "generated_p90": _p90(generated),
        "trained_p90": _p90(trained),
        "p90_ratio": _p90(trained) / _p90(generated),
        "trained_tokens_per_s": tokens / seconds if seconds else float("nan"),
        "pace_wait_s": statistics.fmean(pace_wait) if pace_wait else 0.0,
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, (key, label) in zip(
        axes, (("tokens_per_s", "trained completion tokens / s"), ("engine_busy", "engine busy")), strict=True
    ):
        xs, hs, colors = [], [], []
        for dist in ("longtail", "uniform"):
            for mode in MODES if dist in result else ():
                xs.append(f"{dist}\n{mode}")
                hs.append(result[dist][mode][key])
                colors.append("tab:blue" if mode == "rounds" else "tab:green")
        ax.bar(xs, hs, color=colors)
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=7)
    if "stream_speedup" in result:
        fig.suptitle(
            f"stream ÷ rounds: {result['stream_speedup']:.2f}× long-tailed, {result['uniform_ratio']:.2f}× uniform "
            f"({result['device']})",
            fontsize=9,
        )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (× G completions)")
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--median", type=float, default=16.0)
    ap.add_argument("--p99", type=float, default=256.0)
    ap.add_argument("--cap", type=int, default=256)
    ap.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ahead", type=int, default=1, help="num_batches_ahead, both modes")
    ap.add_argument("--dists", nargs="+", default=["longtail", "uniform"], choices=["longtail", "uniform"])
    ap.add_argument("--repeats", type=int, default=2, help="rounds/stream pairs per length distribution")
    ap.add_argument("--max-staleness", type=int, default=2, help="max_staleness of the pace / drop runs")
    ap.add_argument("--staleness-only", action="store_true", help="only the pace / drop runs (long-tailed lengths)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "streaming.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "plots", "streaming.png"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a 1-layer model, short runs, one repeat, runs forked from a warm interpreter",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print("RUN " + json.dumps(child(json.loads(a.child))), flush=True)
        os._exit(0)  # no finalizers: engine threads / gloo teardown can hang at interpreter exit
    if a.smoke:
        a.layers, a.hidden, a.prompts, a.G, a.cap, a.p99 = 1, 64, 2, 2, 32, 32.0
        a.median, a.steps, a.warmup, a.repeats = 4.0, 4, 1, 1
        a.out = os.path.join(HERE, "out", "smoke", "streaming.json")
        a.plot = os.path.join(HERE, "out", "smoke", "streaming.png")

    from grpo_async.testing import TinyModelSpec, build_tiny_model

    heads = max(1, a.hidden // 64)
    spec_m = TinyModelSpec(
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=512,
    )
    model = build_tiny_model(
        os.path.join(tempfile.gettempdir(), f"grpo_async_bench_stream_{a.layers}x{a.hidden}"), spec_m
    )
    P, G = a.prompts, a.G
    n = P * (a.steps + a.ahead + 2)  # the rounds a run trains, and those ahead
    longtail = draw_lengths(n, a.median, a.p99, a.cap)
    mean_len = round(statistics.fmean(longtail[: P * a.steps]))
    dists = {"longtail": longtail, "uniform": [mean_len] * n}
    dists = {d: dists[d] for d in ([] if a.staleness_only else a.dists)}
    server, trainer_core = launch_pinned_server(model, SERVER_ARGS + ["--max-model-len", "512"], quick_start=a.smoke)
    runs: dict[str, dict[str, list]] = {d: {m: [] for m in MODES} for d in dists}
    staleness_runs: dict[str, list] = {p: [] for p in POLICIES}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    started = time.time()
    try:
        with open(a.out.replace(".json", ".runs.log"), "w") as log:
            for r in range(a.repeats):
                for dist, lengths in dists.items():
                    order = MODES if r % 2 == 0 else MODES[::-1]  # blocks: rounds stream | stream rounds | ...
                    for mode in order:
                        spec = {
                            "mode": mode,
                            "model": model,
                            "url": server.url,
                            "prompts": P,
                            "G": G,
                            "cap": a.cap,
                            "steps": a.steps,
                            "lengths": lengths,
                            "trainer_core": trainer_core,
                            "ahead": a.ahead,
                        }
                        run = launch(spec, log, warm=a.smoke)
                        runs[dist][mode].append(run)
                        m = measure([run], a.warmup)
                        print(
                            f"[{r}] {dist:8s} {mode:6s}: {m['tokens_per_s']:.1f} trained tokens/s, "
                            f"{m['s_per_step']:.3f} s/step, engine busy {m['engine_busy']:.2f}, trainer wait "
                            f"{m['trainer_wait']:.3f} s/step",
                            flush=True,
                        )
                for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:  # stream, long-tailed, max_staleness
                    spec = {
                        "mode": "stream",
                        "policy": policy,
                        "max_staleness": a.max_staleness,
                        "model": model,
                        "url": server.url,
                        "prompts": P,
                        "G": G,
                        "cap": a.cap,
                        "steps": a.steps,
                        "lengths": longtail,
                        "trainer_core": trainer_core,
                        "ahead": a.ahead,
                    }
                    run = launch(spec, log, warm=a.smoke)
                    staleness_runs[policy].append(run)
                    m = measure_lengths([run], a.warmup)
                    print(
                        f"[{r}] staleness {policy}: generated mean {m['generated_mean']:.1f} / p90 "
                        f"{m['generated_p90']:g}, trained mean {m['trained_mean']:.1f} / p90 {m['trained_p90']:g}, "
                        f"dropped {m['dropped']:.3f}, {m['trained_tokens_per_s']:.1f} trained tokens/s",
                        flush=True,
                    )
    finally:
        server.stop()
    result: dict = {
        "device": f"CPU x{os.cpu_count()}, server core 0, trainer core {trainer_core}",
        "setup": {
            "layers": a.layers,
            "hidden": a.hidden,
            "prompts": P,
            "G": G,
            "median": a.median,
            "p99": a.p99,
            "cap": a.cap,
            "steps": a.steps,
            "warmup": a.warmup,
            "repeats": a.repeats,
            "uniform_length": mean_len,
            "longtail_lengths": longtail[: P * a.steps],
        },
        "wall_s": time.time() - started,
    }
    for dist in dists:
        result[dist] = {mode: measure(runs[dist][mode], a.warmup) for mode in MODES}
    st = result["staleness"] = {p: measure_lengths(staleness_runs[p], a.warmup) for p in POLICIES}
    st["max_staleness"] = a.max_staleness
    st["pace_vs_drop_tokens"] = st["pace"]["trained_tokens_per_s"] / st["drop"]["trained_tokens_per_s"]
    staleness_rows = [
        {
            "metric": f"trained ÷ generated mean completion length, stream, max_staleness={a.max_staleness}: pace",
            "ours": st["pace"]["mean_ratio"],
            "peer": st["drop"]["mean_ratio"],
            "ratio": st["pace"]["mean_ratio"] / st["drop"]["mean_ratio"],
            "peer_name": "staleness_policy='drop' (1 = no length bias)",
        },
        {
            "metric": f"trained completion tokens/s, stream, max_staleness={a.max_staleness}: pace vs drop",
            "ours": st["pace"]["trained_tokens_per_s"],
            "peer": st["drop"]["trained_tokens_per_s"],
            "ratio": st["pace_vs_drop_tokens"],
            "peer_name": "staleness_policy='drop'",
        },
    ]
    result["rows"] = []
    if a.staleness_only:
        result["runs"] = {"staleness": staleness_runs}
        result["rows"] = staleness_rows
        _report_staleness(result, a.out)
        return result
    lt, un = result["longtail"], result["uniform"]
    result["stream_speedup"] = lt["stream"]["tokens_per_s"] / lt["rounds"]["tokens_per_s"]
    result["uniform_ratio"] = un["stream"]["tokens_per_s"] / un["rounds"]["tokens_per_s"]
    result["rows"] = [
        {
            "metric": "trained completion tokens/s, long-tailed lengths: stream ÷ rounds",
            "ours": lt["stream"]["tokens_per_s"],
            "peer": lt["rounds"]["tokens_per_s"],
            "ratio": result["stream_speedup"],
            "peer_name": "async_mode='rounds' (goal ≥ 1.5×)",
        },
        {
            "metric": "trained completion tokens/s, uniform lengths: stream ÷ rounds",
            "ours": un["stream"]["tokens_per_s"],
            "peer": un["rounds"]["tokens_per_s"],
            "ratio": result["uniform_ratio"],
            "peer_name": "async_mode='rounds' (goal ≥ 0.95×)",
        },
        {
            "metric": "engine busy fraction, long-tailed: stream vs rounds",
            "ours": lt["stream"]["engine_busy"],
            "peer": lt["rounds"]["engine_busy"],
            "ratio": lt["stream"]["engine_busy"] / lt["rounds"]["engine_busy"],
            "peer_name": "rounds (goal ≥ 0.9 in stream)",
        },
    ]
    result["rows"] += staleness_rows
    result["runs"] = {**runs, "staleness": staleness_runs}
    print(
        f"model {a.layers} layers × hidden {a.hidden}; {P} prompts × G={G} per step; lengths lognormal median "
        f"{a.median:g}, p99 {a.p99:g}, cap {a.cap} (uniform: {mean_len}); {a.repeats} repeat(s) × {a.steps} steps"
    )
    print("lengths   | mode   | tokens/s | s/step | engine busy | trainer wait/step | group p50 / p90 | staleness max")
    for dist in dists:
        for mode in MODES:
            m = result[dist][mode]
            print(
                f"{dist:9s} | {mode:6s} | {m['tokens_per_s']:8.1f} | {m['s_per_step']:.3f}  | "
                f"{m['engine_busy']:.3f}       | {m['trainer_wait']:.3f}             | "
                f"{m['group_latency_p50']:.2f} / {m['group_latency_p90']:.2f}     | {m['staleness_max']:g}"
            )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.plot)
    print(f"wrote {a.out} and {a.plot}")
    print(f"RESULT stream_speedup={result['stream_speedup']:.3f}")
    print(f"RESULT uniform_ratio={result['uniform_ratio']:.3f}")
    print(f"RESULT engine_busy_stream={lt['stream']['engine_busy']:.3f}")
    print(f"RESULT engine_busy_rounds={lt['rounds']['engine_busy']:.3f}")
    print(f"RESULT trainer_wait_stream={lt['stream']['trainer_wait']:.3f}")
    print(f"RESULT trainer_wait_rounds={lt['rounds']['trainer_wait']:.3f}")
    _report_staleness(result, None)
    return result


def _report_staleness(result: dict, out: str | None) -> None:
    """The pace / drop table and its `RESULT` lines (and, with `out`, the JSON: `--staleness-only`)."""
    st = result["staleness"]
    print(f"stream, long-tailed lengths, max_staleness={st['max_staleness']}: rows delivered to the trainer")
    print("policy | generated rows | mean / p90 length | trained rows | mean / p90 length | dropped | tokens/s | wait")
    for p in POLICIES:
        m = st[p]
        print(
            f"{p:6s} | {m['generated_rows']:14d} | {m['generated_mean']:6.1f} / {m['generated_p90']:5g}    | "
            f"{m['trained_rows']:12d} | {m['trained_mean']:6.1f} / {m['trained_p90']:5g}    | {m['dropped']:.3f}   | "
            f"{m['trained_tokens_per_s']:8.1f} | {m['pace_wait_s']:.3f} s"
        )
    if out is not None:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {out}")
    for p in POLICIES:
        print(f"RESULT staleness_{p}_mean_ratio={st[p]['mean_ratio']:.3f}")
        print(f"RESULT staleness_{p}_p90_ratio={st[p]['p90_ratio']:.3f}")
        print(f"RESULT staleness_{p}_dropped={st[p]['dropped']:.3f}")
    print(f"RESULT staleness_pace_vs_drop_tokens={st['pace_vs_drop_tokens']:.3f}")


if __name__ == "__main__":
    main()
