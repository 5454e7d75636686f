"""The metrics a run logs, read back and drawn: `metrics.jsonl` (written by `logging_utils.MetricsJsonlCallback`) and
its plot, `metrics.png`. No torch or transformers here: `grpo-async plot` imports only this module and matplotlib
(~1 s, where importing the callbacks' transformers took ~6)."""

from __future__ import annotations

import json
import os

#: the JSON-lines log of every `Trainer.log` call, in `output_dir`
METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


#: the panels of `plot_metrics`: (title, y label, [(metric key, legend label)]); `rewards/<name>/mean` of each
#: reward function is added to the reward panel
PANELS = (
    ("reward", "reward", [("reward", "reward (weighted sum)")]),
    ("KL to the reference model", "KL", [("kl", "kl")]),
    (
        "completion length",
        "tokens",
        [
            ("completions/mean_length", "mean"),
            ("completions/min_length", "min"),
            ("completions/max_length", "max"),
        ],
    ),
    (
        "time per step",
        "seconds",
        [
            ("timing/generation", "generation (per round)"),
            ("timing/train_step", "training (per optimizer step)"),
            ("timing/wait_generation", "trainer waiting for a round"),
        ],
    ),
    (
        "overlap of generation and training",
        "fraction",
        [
            ("async/overlap", "overlap: max(T_gen, T_train) / step time"),
            ("async/bottleneck", "share of steps bound by generation"),
        ],
    ),
    (
        "idle time per step",
        "seconds",
        [
            ("async/trainer_wait", "trainer waiting for the generator"),
            ("async/generator_idle", "generator idle"),
        ],
    ),
    (
        "throughput",
        "tokens per second",
        [
            ("perf/train_tokens_per_second", "trained (per device)"),
            ("perf/generated_tokens_per_second", "generated"),
        ],
    ),
    (
        "stream mode: the engine",
        "fraction / groups",
        [
            ("async/engine_busy", "engine busy (share of wall time with work)"),
            ("async/inflight_groups", "prompt groups in flight"),
        ],
    ),
    (
        "stream mode: group latency",
        "seconds",
        [("async/group_latency/p50", "p50 (start → scored)"), ("async/group_latency/p90", "p90")],
    ),
    (
        "importance-sampling ratio (π_old / π_sampler)",
        "ratio",
        [
            ("sampling/importance_sampling_ratio/mean", "mean"),
            ("sampling/importance_sampling_ratio/min", "min"),
            ("sampling/importance_sampling_ratio/max", "max"),
        ],
    ),
    (
        "sampler vs trainer (mismatch)",
        "nats / fraction",
        [
            ("sampling/kl", "KL(sampler ‖ π_old), k3"),
            ("sampling/logp_diff/max", "|logp diff|, max"),
            ("sampling/masked_fraction", "share masked / truncated by the IS mode"),
        ],
    ),
    ("training FLOPs per second", "FLOP/s (per device)", [("perf/flops_per_second", "FLOP/s")]),
    ("model FLOPs utilisation", "% of the device's peak", [("perf/mfu", "MFU")]),
)
PLOT_FILE = "metrics.png"


def metric_panels(rows: list[dict]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The panels `plot_metrics` draws for these log rows: only series present in at least one row."""
    reward_funcs = sorted({k for r in rows for k in r if k.startswith("rewards/") and k.endswith("/mean")})
    panels = []
    for title, ylabel, series in PANELS:
        if title == "reward":
            series = series + [(k, k[len("rewards/") : -len("/mean")]) for k in reward_funcs]
        present = [(k, label) for k, label in series if any(k in r for r in rows)]
        if present:
            panels.append((title, ylabel, present))
    return panels


def plot_metrics(metrics_path: str, out_png: str, title: str = "grpo_async") -> str:
    """One PNG with a panel each for reward (and each reward function), KL, completion length, the time per
    step of generation and training, and (when logged) how well they overlapped (`async/overlap`, the share of
    generation-bound steps) and the seconds each side sat idle per step (`async/trainer_wait`,
    `async/generator_idle`), from the JSONL that `MetricsJsonlCallback` writes; x = optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "train_runtime" not in r]
    panels = metric_panels(rows)
    if not panels:
        raise ValueError(f"{metrics_path} has none of the metrics {[k for _, _, s in PANELS for k, _ in s]}")
    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.4 * nrows), squeeze=False)
    for ax, (panel_title, ylabel, series) in zip(axes.flat, panels, strict=False):
        for i, (key, label) in enumerate(series):
            # per-function rewards, min/max lengths, the bottleneck share
            secondary = i > 0 and panel_title in (
                "reward",
                "completion length",
                "overlap of generation and training",
                "importance-sampling ratio (π_old / π_sampler)",
            )
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="." if len(pts) < 60 else None,
                lw=1.0 if secondary else 1.4,
                ls="--" if secondary else "-",
                alpha=0.75 if secondary else 1.0,
                label=label,
            )
        ax.set_title(panel_title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        if ylabel == "fraction":
            ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
