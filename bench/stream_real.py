"""Stream vs rounds on a real model: held-out greedy accuracy against wall-clock time, `recipes/real_math.py`
(SmolLM2-135M-Instruct on 2-digit addition, its completion lengths vary naturally) trained in `async_mode="rounds"`
and in `async_mode="stream"`.

Both runs are `recipes/real_math.py`'s training at its defaults (`real_math_defaults()`: 16 rows = 4 prompts × G=4
per step, `num_batches_ahead=1`, 20 steps, seed 0, the same problems), built by its own `make_trainer` and scored by
its own `greedy_accuracy` (nothing copied), with two changes for both modes:

- `--engine server` (default): generation on one `grpo-async serve` of the model pinned to core 0, each training run
  pinned to core 1 (one torch thread): the 2-core split of `bench/streaming.py`, where generation and training do
  not take each other's core, and in-flight weight pushes in both modes. `--engine in_process`: the recipe's
  in-process engine sharing both cores with the trainer, in-flight pushes in stream mode only (the in-process vllm
  backend allows them only there, `config/rules.py` `inflight_needs_a_server`): the run of 2026-11-26, which was
  training-bound (stream gained nothing);
- `--max_completion_length 128` (the recipe's default is 64): the untrained model explains at length and the
  64-token cap cut those explanations off, so most early completions had the same length; RL soon teaches short
  answers (mean length 55 → 13 in `make demo-real`), and with 128 the completions that still ramble form the long
  tail a round waits for.

The only difference between the two runs: `async_mode` (and, in process, the in-flight pushes).

Timing without evaluation in the clock: each run is a fresh process; the engine is built and the initial model
scored before the clock starts (as `real_math.py` does); the clock starts at `trainer.train()` and records the wall
time at the end of every optimizer step. Every `--eval_every` steps (and at the last step) a callback copies the
model's weights to memory (`state_dict` clones, the same cost in both modes; the seconds it took are reported);
after training each copy is loaded back into the model, pushed to the same engine (`trainer.sync_weights()`) and
scored: held-out greedy accuracy on `--eval_problems` problems at the wall time of the step it was taken at. The
initial weights go through the same copy / load / push path (step 0, 0 s) and must score what they scored directly
before training (`reload_ok` in the JSON; a warning is printed if not).

Printed: per mode the accuracy curve (step, seconds, accuracy), s/step. `RESULT` lines:

- `stream_real_time_ratio`: rounds' time to reach its own final accuracy ÷ stream's time to reach that accuracy
  (first scored checkpoint at or above it, step ≥ 1); > 1: stream gets there sooner. If stream never reaches it, the
  ratio printed is rounds' time ÷ stream's whole run (an upper bound) and `stream_real_reached=0`;
- `stream_real_reached` (1 or 0), `stream_real_acc_rounds`, `stream_real_acc_stream` (final accuracies),
  `stream_real_acc_before` (the initial model, both runs), `stream_real_s_per_step_rounds`,
  `stream_real_s_per_step_stream` (wall seconds from `train()` to the end of the last step ÷ steps),
  `stream_real_speedup` (rounds ÷ stream of those seconds, the same number of steps).

Run: `python bench/stream_real.py` (~17 min on 2 CPU cores: two ~5 min runs, their scoring, the server's start);
`--smoke`: the tiny random model, 2 steps each, a handful of problems, each run a fork of one warm interpreter (a
minute). Writes `bench/out/stream_real.json` and `bench/plots/stream_real.png` (accuracy vs wall-clock seconds, both
modes).
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

MODES = ("rounds", "stream")
#: flags of recipes/real_math.py that differ between the modes (everything else: the recipe's defaults), per engine:
#: the in-process engine allows in-flight weight pushes only in stream mode; a server allows them in both
ENGINE_MODE_FLAGS = {
    "in_process": {
        "rounds": ["--async_mode", "rounds"],
        "stream": ["--async_mode", "stream", "--weight_sync_inflight", "true"],
    },
    "server": {
        "rounds": ["--async_mode", "rounds", "--weight_sync_inflight", "true"],
        "stream": ["--async_mode", "stream", "--weight_sync_inflight", "true"],
    },
}


# ---------------------------------------------------------------------------------------------- one run (child)
def child(spec: dict) -> dict:
    """One `real_math.py` training run: per-step wall times, weight copies every `eval_every` steps, then scored."""
    if spec.get("trainer_core") is not None:  # the 2-core split: this trainer on its core, the server on the other
        os.sched_setaffinity(0, {spec["trainer_core"]})
    import torch

    if spec.get("trainer_core") is not None:
        torch.set_num_threads(1)
    from transformers import TrainerCallback

    from recipes import real_math

    script, args, model_args = real_math.parse_args(spec["argv"])
    every, last = spec["eval_every"], args.max_steps
    clock = {"t0": None, "ends": [], "copy_s": 0.0}
    copies: dict[int, dict[str, torch.Tensor]] = {}  # step → the model's weights after it
    holder: dict = {}

    class Clock(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            clock["ends"].append(time.perf_counter() - clock["t0"])
            if state.global_step % every == 0 or state.global_step == last:
                start = time.perf_counter()
                model = holder["trainer"].accelerator.unwrap_model(holder["trainer"].model)
                copies[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
                clock["copy_s"] += time.perf_counter() - start

    trainer, held_out = real_math.make_trainer(script, args, model_args, callbacks=[Clock()])
    holder["trainer"] = trainer
    max_tokens = args.max_completion_length
    model = trainer.accelerator.unwrap_model(trainer.model)
    score_initial = spec.get("score_initial", True)  # False: a bench that scores the initial weights once elsewhere
    if score_initial:
        copies[0] = {k: v.detach().clone() for k, v in model.state_dict().items()}  # scored like the others: a check
    # a server still holds what the previous run pushed last (a run publishes its version 0 only inside train()):
    # push the initial weights first (an in-process engine already has them; this builds it, outside the clock)
    trainer.sync_weights()
    before = None
    if score_initial:
        before, _ = real_math.greedy_accuracy(trainer, held_out, max_tokens)
        print(f"[{args.async_mode}] greedy accuracy before training: {before:.3f}", flush=True)
    clock["t0"] = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - clock["t0"]
    ends = [0.0] + clock["ends"]  # ends[k]: wall seconds at the end of step k
    curve = []
    scoring = time.perf_counter()
    for step in sorted(copies):
        model.load_state_dict(copies.pop(step))
        trainer.sync_weights()  # the engine samples with this copy's weights
        acc, _ = real_math.greedy_accuracy(trainer, held_out, max_tokens)
        curve.append({"step": step, "seconds": ends[step], "accuracy": acc})
        print(f"[{args.async_mode}] step {step:3d} at {ends[step]:7.1f} s: accuracy {acc:.3f}", flush=True)
    # the initial weights copied, loaded back, pushed: the same score
    reload_ok = curve[0]["accuracy"] == before if score_initial else None
    if reload_ok is False:
        print(
            f"WARNING [{args.async_mode}] scoring path: the initial weights scored {before:.4f} directly but "
            f"{curve[0]['accuracy']:.4f} after a copy, load_state_dict and sync_weights",
            flush=True,
        )
    scoring = time.perf_counter() - scoring
    trainer.close()
    return {
        "mode": args.async_mode,
        "weight_sync_inflight": bool(args.weight_sync_inflight),
        "step_ends": ends[1:],
        "steps_s": ends[-1],  # wall seconds from train() to the end of the last optimizer step
        "train_s": train_s,  # train() as a whole (its teardown included)
        "copy_s": clock["copy_s"],
        "scoring_s": scoring,
        "eval_problems": len(held_out),
        "curve": curve,
        "before_direct": before,
        "reload_ok": reload_ok,
    }


def launch(
    mode_argv: list[str], argv: list[str], eval_every: int, log, timeout: float, trainer_core, warm: bool = False
) -> dict:
    """One mode's run (`--child`) in a fresh process (a fork of a warm interpreter with `warm`: `_runs.run_python`);
    its `RUN` record."""
    from _runs import run_python, run_record

    spec = {"argv": argv + mode_argv, "eval_every": eval_every, "trainer_core": trainer_core}
    env = None if trainer_core is None else {**os.environ, "OMP_NUM_THREADS": "1"}
    # argv names the run's own output_dir
    proc = run_python(os.path.abspath(__file__), ["--child", json.dumps(spec)], timeout=timeout, env=env, warm=warm)
    log.write(proc.stdout)
    log.flush()
    for line in proc.stdout.splitlines():
        if line.startswith("[") and "accuracy" in line:
            print("  " + line, flush=True)
    return run_record(proc, " ".join(mode_argv))


# ---------------------------------------------------------------------------------------------- the server
PROMPT_TOKENS = 128  # real_math_defaults()'s max_prompt_length


def model_path(recipe: list[str]) -> str:
    """The model the runs train: `--model_name_or_path` of the recipe flags, else SmolLM2 (the recipe's default)."""
    if "--model_name_or_path" in recipe:
        return recipe[recipe.index("--model_name_or_path") + 1]
    from grpo_async.testing import build_smollm2

    return build_smollm2()


def start_server(model: str, max_len: int, smoke: bool):
    """One `grpo-async serve` of `model` on core 0 for both runs (each run publishes its initial weights, its version
    0, before its first round); returns it and the trainers' core."""
    from _runs import launch_pinned_server

    args = ["--dtype", "float32", "--max-model-len", str(max_len)] + (["--enforce-eager"] if smoke else [])
    return launch_pinned_server(model, args, quick_start=smoke, ready_timeout=600)


# ---------------------------------------------------------------------------------------------- the numbers
def time_to(curve: list[dict], target: float) -> float | None:
    """Wall seconds of the first scored checkpoint after training began (step ≥ 1) whose accuracy ≥ `target`."""
    return next((p["seconds"] for p in curve if p["step"] >= 1 and p["accuracy"] >= target - 1e-12), None)


def compare(runs: dict[str, dict]) -> dict:
    """`RESULT` numbers from the two runs (see the module docstring)."""
    r, s = runs["rounds"], runs["stream"]
    target = r["curve"][-1]["accuracy"]
    t_rounds, t_stream = time_to(r["curve"], target), time_to(s["curve"], target)
    reached = t_stream is not None
    return {
        "target_accuracy": target,
        "rounds_time_to_target": t_rounds,
        "stream_time_to_target": t_stream,
        "reached": reached,
        "time_ratio": t_rounds / (t_stream if reached else s["steps_s"]),
        "acc_rounds": target,
        "acc_stream": s["curve"][-1]["accuracy"],
        "acc_before": r["curve"][0]["accuracy"],
        "s_per_step_rounds": r["steps_s"] / len(r["step_ends"]),
        "s_per_step_stream": s["steps_s"] / len(s["step_ends"]),
        "speedup": r["steps_s"] / s["steps_s"],
    }


def plot(runs: dict[str, dict], cmp: dict, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"rounds": "tab:blue", "stream": "tab:green"}
    for mode in MODES:
        run = runs[mode]
        xs = [p["seconds"] for p in run["curve"]]
        ys = [p["accuracy"] for p in run["curve"]]
        label = f"{mode} ({run['steps_s'] / len(run['step_ends']):.1f} s/step)"
        ax.plot(xs, ys, marker="o", color=colors[mode], label=label)
    ax.axhline(cmp["target_accuracy"], color="gray", ls="--", lw=0.8, label="rounds' final accuracy")
    for key, mode in (("rounds_time_to_target", "rounds"), ("stream_time_to_target", "stream")):
        if cmp[key] is not None:
            ax.axvline(cmp[key], color=colors[mode], ls=":", lw=0.8)
    if not cmp["reached"]:
        reached = "never reached by stream"
    elif cmp["time_ratio"] >= 1:
        reached = f"stream {cmp['time_ratio']:.2f}× sooner"
    else:
        reached = f"stream took {1 / cmp['time_ratio']:.2f}× as long"
    ax.set_title(f"{title}\nrounds' final accuracy {cmp['target_accuracy']:.3f}: {reached}", fontsize=9)
    ax.set_xlabel("wall-clock seconds of training (scoring excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max_steps", type=int, default=None, help="optimizer steps per run (default: the recipe's)")
    ap.add_argument("--eval_every", type=int, default=4, help="copy the weights for scoring every N steps")
    ap.add_argument("--eval_problems", type=int, default=None, help="held-out problems (default: the recipe's)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "stream_real.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "plots", "stream_real.png"))
    ap.add_argument(
        "--engine",
        choices=("server", "in_process"),
        default="server",
        help="server (default): one `grpo-async serve` of the model on core 0, each trainer run pinned to core 1 (the "
        "2-core split of bench/streaming.py); in_process: the recipe's in-process engine, sharing both cores with the "
        "trainer (the run of 2026-11-26)",
    )
    ap.add_argument(
        "--max_completion_length",
        type=int,
        default=128,
        help="completion cap of both runs (the recipe's default is 64, which cuts the untrained model's explanations "
        "off: 128 leaves a natural long tail)",
    )
    ap.add_argument("--smoke", action="store_true", help="the tiny random model, 2 steps, a few problems")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print("RUN " + json.dumps(child(json.loads(a.child))), flush=True)
        os._exit(0)  # no finalizers: engine threads can hang at interpreter exit
    workdir = tempfile.TemporaryDirectory(prefix="bench_stream_real_")  # the recipe's output_dir (metrics)
    recipe = []
    title = "SmolLM2-135M-Instruct, 2-digit addition (recipes/real_math.py)"
    timeout = 2400.0
    if a.smoke:
        from grpo_async.testing import build_tiny_model

        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "grpo_async_bench_stream_real_tiny"))
        recipe += ["--model_name_or_path", model, "--train_problems", "64"]
        recipe += ["--per_device_train_batch_size", "8", "--vllm_enforce_eager", "true"]
        a.max_steps, a.eval_every, a.eval_problems, a.max_completion_length = 2, 1, 8, 8
        a.out = os.path.join(HERE, "out", "smoke", "stream_real.json")
        a.plot = os.path.join(HERE, "out", "smoke", "stream_real.png")
        title, timeout = "tiny random model (smoke)", 300.0
    if a.max_steps is not None:
        recipe += ["--max_steps", str(a.max_steps)]
    if a.eval_problems is not None:
        recipe += ["--eval_problems", str(a.eval_problems)]
    max_len = PROMPT_TOKENS + a.max_completion_length  # the recipe's max_prompt_length + the completion cap
    recipe += ["--max_completion_length", str(a.max_completion_length), "--vllm_max_model_length", str(max_len)]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    started = time.time()
    runs = {}
    server, trainer_core, device = None, None, f"CPU x{os.cpu_count()}, in-process engine"
    if a.engine == "server":
        server, trainer_core = start_server(model_path(recipe), max_len, a.smoke)
        device = f"CPU x{os.cpu_count()}, server core 0, trainer core {trainer_core}"
        recipe += ["--generation_backend", "vllm_server", "--vllm_server_urls", server.url]
    mode_flags = ENGINE_MODE_FLAGS[a.engine]
    try:
        with workdir, open(a.out.replace(".json", ".runs.log"), "w") as log:
            for mode in MODES:
                print(f"== {mode}: python recipes/real_math.py {' '.join(recipe + mode_flags[mode])}", flush=True)
                output_dir = ["--output_dir", os.path.join(workdir.name, mode)]  # each run's own metrics.jsonl
                runs[mode] = launch(
                    mode_flags[mode], output_dir + recipe, a.eval_every, log, timeout, trainer_core, warm=a.smoke
                )
    finally:
        if server is not None:
            server.stop()
    cmp = compare(runs)
    result = {
        "device": device,
        "setup": {
            "engine": a.engine,
            "recipe_flags": recipe,
            "mode_flags": mode_flags,
            "eval_every": a.eval_every,
            "max_completion_length": a.max_completion_length,
        },
        "wall_s": time.time() - started,
        "runs": runs,
        **cmp,
    }
    result["rows"] = [
        {
            "metric": "time to rounds' final held-out accuracy (s): stream vs rounds",
            "ours": cmp["stream_time_to_target"] if cmp["reached"] else runs["stream"]["steps_s"],
            "peer": cmp["rounds_time_to_target"],
            "ratio": cmp["time_ratio"],
            "peer_name": "async_mode='rounds'" + ("" if cmp["reached"] else "; stream never reached it: upper bound"),
        },
        {
            "metric": "s/step, SmolLM2 real_math: stream vs rounds",
            "ours": cmp["s_per_step_stream"],
            "peer": cmp["s_per_step_rounds"],
            "ratio": cmp["speedup"],
            "peer_name": "async_mode='rounds'",
        },
        {
            "metric": "final held-out greedy accuracy: stream vs rounds",
            "ours": cmp["acc_stream"],
            "peer": cmp["acc_rounds"],
            "ratio": cmp["acc_stream"] / cmp["acc_rounds"] if cmp["acc_rounds"] else float("nan"),
            "peer_name": "async_mode='rounds'",
        },
    ]
    print("mode   | steps | s/step | steps s | weight copies s | final acc | curve (step: s, acc)")
    for mode in MODES:
        run = runs[mode]
        pts = ", ".join(f"{p['step']}: {p['seconds']:.0f} s {p['accuracy']:.3f}" for p in run["curve"])
        print(
            f"{mode:6s} | {len(run['step_ends']):5d} | {run['steps_s'] / len(run['step_ends']):6.2f} | "
            f"{run['steps_s']:7.1f} | {run['copy_s']:15.2f} | {run['curve'][-1]['accuracy']:.3f}     | {pts}"
        )
    if cmp["reached"]:
        print(
            f"rounds reached its final accuracy {cmp['target_accuracy']:.3f} at {cmp['rounds_time_to_target']:.1f} s, "
            f"stream at {cmp['stream_time_to_target']:.1f} s"
        )
    else:
        print(
            f"stream never reached rounds' final accuracy {cmp['target_accuracy']:.3f} (its best: "
            f"{max(p['accuracy'] for p in runs['stream']['curve']):.3f}); stream_real_time_ratio below is an upper "
            "bound: rounds' time to it ÷ stream's whole run"
        )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    where = "server core 0, trainer core 1" if a.engine == "server" else "in-process engine"
    plot(runs, cmp, f"{title}\n{where}; completions ≤ {a.max_completion_length} tokens", a.plot)
    print(f"wrote {a.out} and {a.plot}")
    print(f"RESULT stream_real_time_ratio={cmp['time_ratio']:.3f}")
    print(f"RESULT stream_real_reached={int(cmp['reached'])}")
    print(f"RESULT stream_real_acc_rounds={cmp['acc_rounds']:.4f}")
    print(f"RESULT stream_real_acc_stream={cmp['acc_stream']:.4f}")
    print(f"RESULT stream_real_acc_before={cmp['acc_before']:.4f}")
    print(f"RESULT stream_real_s_per_step_rounds={cmp['s_per_step_rounds']:.3f}")
    print(f"RESULT stream_real_s_per_step_stream={cmp['s_per_step_stream']:.3f}")
    print(f"RESULT stream_real_speedup={cmp['speedup']:.3f}")
    return result


if __name__ == "__main__":
    main()
