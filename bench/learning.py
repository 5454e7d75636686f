"""Learning quality of the async modes: does generating ahead (or streaming with in-flight weight updates) learn as
well as synchronous GRPO, and does it get there sooner? SmolLM2-135M-Instruct on `recipes/real_math.py`'s 2-digit
addition, held-out greedy accuracy against optimizer steps and against wall-clock seconds, 3 seeds per mode.

Modes (every other setting the same; `MODES` holds the flags):

- `sync`: `num_batches_ahead=0`, each round generated from the weights it trains first;
- `async`: `num_batches_ahead=1` (the default), rounds mode, the publish waits for the round being generated;
- `async2`: `num_batches_ahead=2`;
- `stream`: `async_mode="stream"` with `weight_sync_inflight=True` (weights load between engine steps while groups
  generate), `num_batches_ahead=1`; rows lag up to 2 steps (a group started before a push is trained after the next);
- `stream1`: `stream` with `max_staleness=1` (pacing holds a group whose rows would lag more).

Each run is `recipes/real_math.py`'s training, built by its own `make_trainer` and scored by its own `greedy_accuracy`
(through `bench/stream_real.py`'s run: per-step wall times, weight copies every `--eval_every` steps scored after
training, outside the clock), at the recipe's defaults (4 prompts × G=4 = 16 rows a step, learning rate and
temperature as `real_math_defaults()`, 64-token completions) with `--max_steps` steps, and the 2-core split of
`bench/stream_real.py`: one `grpo-async serve` of the model pinned to core 0 for all runs, each trainer pinned to core
1 (one torch thread). Seeds 0, 1, 2 (`--seed`: the training problems and their order, the per-completion sampling
seeds; nothing else is random: full fine-tuning, no new layers); the held-out problems are the same for every run
(`--eval_seed 1000`), so the initial model is scored once (the first run) and that score is every curve's step 0.
Runs go seed by seed, the modes in turn within a seed, so a change in the machine's load hits every mode alike.

Collapse (per run): the held-out accuracy at the last step is below half the run's own peak (step 0 included), or the
training reward (`reward`: the sum of both rewards, mean over the step's 16 completions) is 0 at half or more of the
last 10 steps (of all steps, with fewer than 10).

`RESULT` lines, per mode `m`:

- `learning_final_acc_mean_<m>`, `learning_final_acc_min_<m>`: held-out accuracy at the last step, mean and min over
  seeds;
- `learning_collapsed_<m>`: seeds that collapsed;
- `time_to_sync_final_<m>`: the wall seconds mode `m`'s mean curve (accuracy and seconds averaged over seeds at each
  scored step) first reaches sync's final mean accuracy (a scored step ≥ 1), ÷ sync's wall seconds to its last step
  (mean over seeds). For `sync` itself it is ≤ 1 (1 when only its last step reaches the mean). A mode that never
  reaches it prints its whole run's seconds ÷ sync's (a lower bound) and `learning_reached_<m>=0`;
- `learning_reached_<m>` (1 or 0), `learning_s_per_step_<m>` (mean over seeds), `learning_acc_before`.

Goals (printed as `learning_goal_*` 1/0): no seed of any mode collapses; every async mode's final mean accuracy ≥
sync's worst seed; every async mode's `time_to_sync_final` ≤ 0.9.

Cost (2 CPU cores, quiet; an estimate from `bench/stream_real.py`'s 13.4 s/step): 15 runs (5 modes × 3 seeds) of
`--max_steps 16` at ~9–15 s a step, ~45 s of start-up and ~40 s of scoring (4 checkpoints × 128 problems) each, plus
the server's start: ~60–75 min (`python bench/learning.py`). Measured beside three other sessions' work (load 2–13),
2026-11-28: 14.5–28 s a step, 9–10 min a run (7 runs in 67 min before the server died; bench/NOTES.md).
`--smoke`: the tiny random model, every mode for 2 steps with 1 seed, a handful of problems, each run a fork of one
warm interpreter (~1 min). Writes `bench/out/learning.partial.json` after every run (the runs so far), then
`bench/out/learning.json` (or `bench/out/smoke/`) and `bench/plots/learning.png`
(accuracy vs optimizer step and vs wall-clock seconds, each mode's mean and its min–max band over seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

#: recipes/real_math.py flags of each mode (everything else: the same in every run)
MODES = {
    "sync": ["--num_batches_ahead", "0"],
    "async": ["--num_batches_ahead", "1"],
    "async2": ["--num_batches_ahead", "2"],
    "stream": ["--num_batches_ahead", "1", "--async_mode", "stream", "--weight_sync_inflight", "true"],
    "stream1": ["--num_batches_ahead", "1", "--async_mode", "stream", "--weight_sync_inflight", "true"]
    + ["--max_staleness", "1"],
}
COLORS = {"sync": "black", "async": "tab:blue", "async2": "tab:orange", "stream": "tab:green", "stream1": "tab:red"}
EVAL_SEED = 1000  # the held-out problems of every run
#: per-step metrics kept from each run's metrics.jsonl (the collapse rule reads `reward`; the rest explain a collapse)
STEP_METRICS = (
    "reward",
    "rewards/sum_reward/mean",
    "rewards/boxed_format/mean",
    "frac_reward_zero_std",
    "completions/mean_length",
    "grad_norm",
    "loss",
    "async/staleness_max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/logp_diff/max",
)


# ---------------------------------------------------------------------------------------------- one run (child)
def child(spec: dict) -> dict:
    """One run: `bench/stream_real.py`'s (recipe training, step clock, weight copies scored after training), plus the
    per-step metrics of its `metrics.jsonl`."""
    from stream_real import child as timed_run

    from grpo_async.plotting import METRICS_FILE

    run = timed_run(spec)
    argv = spec["argv"]
    path = os.path.join(argv[argv.index("--output_dir") + 1], METRICS_FILE)
    steps = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec and "step" in rec:  # a training step's log (not the summary at the end)
                steps.append({"step": rec["step"], **{k: rec[k] for k in STEP_METRICS if k in rec}})
    run["steps"] = steps
    return run


def launch(mode: str, seed: int, recipe: list[str], a, workdir: str, log, trainer_core, score_initial: bool) -> dict:
    """One run (`--child`) in a fresh process (a fork of a warm interpreter in `--smoke`); its `RUN` record."""
    from _runs import run_python, run_record

    out = os.path.join(workdir, f"{mode}_{seed}")  # the run's own output_dir (metrics.jsonl)
    argv = ["--output_dir", out, "--seed", str(seed)] + recipe + MODES[mode]
    spec = {"argv": argv, "eval_every": a.eval_every, "trainer_core": trainer_core, "score_initial": score_initial}
    env = None if trainer_core is None else {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"== {mode} seed {seed}: python recipes/real_math.py {' '.join(argv[2:])}", flush=True)
    child_argv = ["--child", json.dumps(spec)]
    proc = run_python(os.path.abspath(__file__), child_argv, timeout=a.timeout, env=env, warm=a.smoke)
    log.write(f"===== {mode} seed {seed}\n{proc.stdout}")
    log.flush()
    run = run_record(proc, f"{mode} seed {seed}")
    run.update(mode=mode, seed=seed)
    return run


# ---------------------------------------------------------------------------------------------- the numbers
def collapsed(run: dict) -> bool:
    """The docstring's rule: final accuracy below half the run's peak, or reward 0 at half of the last 10 steps."""
    accs = [p["accuracy"] for p in run["curve"]]
    rewards = [s["reward"] for s in run["steps"] if "reward" in s][-10:]
    zero = sum(r == 0 for r in rewards)
    return accs[-1] < 0.5 * max(accs) or (bool(rewards) and 2 * zero >= len(rewards))


def mean_curve(runs: list[dict]) -> list[dict]:
    """Per scored step: accuracy mean / min / max and mean wall seconds over the runs (the same steps in each)."""
    out = []
    for points in zip(*(r["curve"] for r in runs)):
        accs = [p["accuracy"] for p in points]
        out.append(
            {
                "step": points[0]["step"],
                "seconds": statistics.fmean(p["seconds"] for p in points),
                "mean": statistics.fmean(accs),
                "min": min(accs),
                "max": max(accs),
            }
        )
    return out


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Per mode: final accuracy mean / min, collapsed seeds, s/step, time to sync's final mean accuracy; the goals."""
    curves = {m: mean_curve(rs) for m, rs in runs.items()}
    target = curves["sync"][-1]["mean"]
    sync_s = curves["sync"][-1]["seconds"]
    modes = {}
    for m, rs in runs.items():
        finals = [r["curve"][-1]["accuracy"] for r in rs]
        hit = next((p for p in curves[m] if p["step"] >= 1 and p["mean"] >= target - 1e-12), None)
        modes[m] = {
            "final_mean": statistics.fmean(finals),
            "final_min": min(finals),
            "finals": finals,
            "collapsed": sum(map(collapsed, rs)),
            "collapsed_seeds": [r["seed"] for r in rs if collapsed(r)],
            "s_per_step": statistics.fmean(r["steps_s"] / len(r["step_ends"]) for r in rs),
            "reached": hit is not None,
            "time_to_target": None if hit is None else hit["seconds"],
            "time_to_sync_final": (curves[m][-1]["seconds"] if hit is None else hit["seconds"]) / sync_s,
            "curve": curves[m],
        }
    asyncs = [m for m in runs if m != "sync"]
    goals = {
        "no_collapse": all(modes[m]["collapsed"] == 0 for m in runs),
        "final_ge_sync_worst": all(modes[m]["final_mean"] >= modes["sync"]["final_min"] for m in asyncs),
        "time_le_0_9": all(modes[m]["reached"] and modes[m]["time_to_sync_final"] <= 0.9 for m in asyncs),
    }
    return {"target": target, "sync_seconds": sync_s, "modes": modes, "goals": goals}


def plot(runs: dict[str, list[dict]], summary: dict, title: str, path: str) -> None:
    """Two panels: accuracy vs optimizer step and vs wall-clock seconds; per mode the mean and min–max over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for m in runs:
        s = summary["modes"][m]
        c = s["curve"]
        label = f"{m} (final {s['final_mean']:.3f}, min {s['final_min']:.3f}; {s['s_per_step']:.1f} s/step)"
        for ax, x in zip(axes, ("step", "seconds")):
            xs = [p[x] for p in c]
            ax.plot(xs, [p["mean"] for p in c], marker="o", ms=3, color=COLORS[m], label=label)
            ax.fill_between(xs, [p["min"] for p in c], [p["max"] for p in c], color=COLORS[m], alpha=0.15)
    for ax in axes:
        ax.axhline(summary["target"], color="gray", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_xlabel("optimizer step")
    axes[1].set_xlabel("wall-clock seconds of training (mean over seeds; scoring excluded)")
    axes[0].set_ylabel("held-out greedy accuracy (mean, min–max over seeds)")
    axes[0].legend(fontsize=7, loc="lower right")
    ratios = ", ".join(f"{m} {summary['modes'][m]['time_to_sync_final']:.2f}" for m in runs if m != "sync")
    target = summary["target"]
    axes[1].set_title(f"time to sync's final mean ({target:.3f}, dashed) ÷ sync's time: {ratios}", fontsize=8)
    axes[0].set_title(title, fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def table_rows(summary: dict) -> list[dict]:
    """RESULTS.md rows: per async mode, time to sync's final mean accuracy and final accuracy vs sync's worst seed."""
    rows, s = [], summary["modes"]
    for m in (m for m in s if m != "sync"):
        rows.append(
            {
                "metric": f"time to sync's final mean held-out accuracy (s), {m} vs sync's whole run"
                + ("" if s[m]["reached"] else " (never reached: its whole run)"),
                "ours": s[m]["time_to_sync_final"] * summary["sync_seconds"],
                "peer": summary["sync_seconds"],
                "peer_name": "sync (goal ratio ≥ 1.11)",
                "ratio": 1 / s[m]["time_to_sync_final"],
            }
        )
        rows.append(
            {
                "metric": f"final held-out accuracy, {m} mean over {len(s[m]['finals'])} seed(s) vs sync's worst seed",
                "ours": s[m]["final_mean"],
                "peer": s["sync"]["final_min"],
                "peer_name": "sync's worst seed (goal ratio ≥ 1)",
                "ratio": s[m]["final_mean"] / s["sync"]["final_min"] if s["sync"]["final_min"] else float("nan"),
            }
        )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max_steps", type=int, default=16, help="optimizer steps of every run")
    ap.add_argument("--eval_every", type=int, default=4, help="copy the weights for scoring every N steps")
    ap.add_argument("--eval_problems", type=int, default=128, help="held-out problems (the same for every run)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per mode (0, 1, ...)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), help="modes to run (sync first)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "learning.json"))
    ap.add_argument("--plot", default=os.path.join(HERE, "plots", "learning.png"))
    ap.add_argument("--smoke", action="store_true", help="the tiny random model, every mode 2 steps, 1 seed")
    ap.add_argument(
        "--resume", action="store_true", help="keep the runs of learning.partial.json (same flags), run the rest"
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child is not None:
        print("RUN " + json.dumps(child(json.loads(a.child))), flush=True)
        os._exit(0)  # no finalizers: engine threads can hang at interpreter exit
    from stream_real import PROMPT_TOKENS, model_path, start_server

    if "sync" not in a.modes:
        ap.error("--modes must include sync (the reference)")
    max_completion_length = 64  # real_math_defaults()'s
    recipe = ["--eval_seed", str(EVAL_SEED)]
    title = "SmolLM2-135M-Instruct, 2-digit addition (recipes/real_math.py)"
    if a.smoke:
        from grpo_async.testing import build_tiny_model

        model = build_tiny_model(os.path.join(tempfile.gettempdir(), "grpo_async_bench_learning_tiny"))
        recipe += ["--model_name_or_path", model, "--train_problems", "64"]
        recipe += ["--per_device_train_batch_size", "8", "--vllm_enforce_eager", "true"]
        a.max_steps, a.eval_every, a.eval_problems, a.seeds, max_completion_length = 2, 1, 8, 1, 8
        a.out = os.path.join(HERE, "out", "smoke", "learning.json")
        a.plot = os.path.join(HERE, "out", "smoke", "learning.png")
        title, a.timeout = "tiny random model (smoke)", 300.0
    max_len = PROMPT_TOKENS + max_completion_length
    recipe += ["--max_steps", str(a.max_steps), "--eval_problems", str(a.eval_problems)]
    recipe += ["--max_completion_length", str(max_completion_length), "--vllm_max_model_length", str(max_len)]
    modes = ["sync"] + [m for m in a.modes if m != "sync"]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    started = time.time()
    partial = a.out.replace(".json", ".partial.json")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    before, restarts = None, []
    if a.resume and os.path.exists(partial):  # the runs a stopped invocation finished (same flags: the caller's word)
        with open(partial) as f:
            saved = json.load(f)
        before = saved["acc_before"]
        for m in modes:
            runs[m] = [r for r in saved["runs"].get(m, []) if r["seed"] < a.seeds]
        print(f"resumed {sum(map(len, runs.values()))} finished runs from {partial}", flush=True)
    server_model = model_path(recipe)
    server, trainer_core = start_server(server_model, max_len, a.smoke)
    recipe += ["--generation_backend", "vllm_server", "--vllm_server_urls", server.url]
    try:
        with (
            tempfile.TemporaryDirectory(prefix="bench_learning_") as workdir,
            open(a.out.replace(".json", ".runs.log"), "a" if a.resume else "w") as log,
        ):
            for seed in range(a.seeds):
                for m in modes:
                    if any(r["seed"] == seed for r in runs[m]):
                        continue
                    for attempt in (1, 2):
                        try:
                            run = launch(m, seed, recipe, a, workdir, log, trainer_core, score_initial=before is None)
                            break
                        except RuntimeError:
                            if server.alive or attempt == 2:
                                raise
                        # the server died under the run: say how (exit status, log), start a fresh one, run this mode
                        # and seed again against it
                        died = f"server exited with status {server.proc.returncode} during {m} seed {seed}"
                        print(f"!! {died}; its log's tail:\n{server.log_tail(15)}!! restarting it", flush=True)
                        log.write(f"!! {died}\n{server.log_tail(60)}\n")
                        server.stop()
                        old_url = server.url
                        server, _ = start_server(server_model, max_len, a.smoke)
                        recipe[recipe.index(old_url)] = server.url
                        restarts.append(died)
                    if before is None:
                        before = run["curve"][0]["accuracy"]
                    else:  # the same initial weights on the same held-out problems: scored once, by the first run
                        run["curve"].insert(0, {"step": 0, "seconds": 0.0, "accuracy": before})
                    runs[m].append(run)
                    with open(partial, "w") as f:  # what a later failure cannot lose
                        json.dump({"acc_before": before, "runs": runs}, f)
                    pts = ", ".join(f"{p['step']}: {p['accuracy']:.3f}" for p in run["curve"])
                    print(
                        f"   {m} seed {seed}: {run['steps_s'] / len(run['step_ends']):.2f} s/step, "
                        f"collapsed {collapsed(run)}; accuracy by step {pts}",
                        flush=True,
                    )
    finally:
        server.stop()
    summary = summarize(runs)
    result = {
        "device": f"CPU x{os.cpu_count()}, server core 0, trainer core {trainer_core}",
        "setup": {
            "recipe_flags": recipe,
            "mode_flags": {m: MODES[m] for m in modes},
            "seeds": a.seeds,
            "eval_every": a.eval_every,
            "max_steps": a.max_steps,
        },
        "wall_s": time.time() - started,
        "server_restarts": restarts,
        "acc_before": before,
        "summary": summary,
        "runs": runs,
        "rows": table_rows(summary),
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(runs, summary, f"{title}; {a.seeds} seed(s), {a.max_steps} steps", a.plot)
    print("mode   | final mean | final min | collapsed | s/step | time to sync's final ÷ sync's time")
    for m in modes:
        s = summary["modes"][m]
        reach = f"{s['time_to_sync_final']:.3f}" + ("" if s["reached"] else " (never reached: lower bound)")
        print(
            f"{m:6s} | {s['final_mean']:10.3f} | {s['final_min']:9.3f} | {s['collapsed']:9d} | "
            f"{s['s_per_step']:6.2f} | {reach}"
        )
    print(f"wrote {a.out} and {a.plot} ({result['wall_s']:.0f} s)")
    print(f"RESULT learning_acc_before={before:.4f}")
    for m in modes:
        s = summary["modes"][m]
        print(f"RESULT learning_final_acc_mean_{m}={s['final_mean']:.4f}")
        print(f"RESULT learning_final_acc_min_{m}={s['final_min']:.4f}")
        print(f"RESULT learning_collapsed_{m}={s['collapsed']}")
        print(f"RESULT time_to_sync_final_{m}={s['time_to_sync_final']:.3f}")
        print(f"RESULT learning_reached_{m}={int(s['reached'])}")
        print(f"RESULT learning_s_per_step_{m}={s['s_per_step']:.3f}")
    for goal, ok in summary["goals"].items():
        print(f"RESULT learning_goal_{goal}={int(ok)}")
    return result


if __name__ == "__main__":
    main()
