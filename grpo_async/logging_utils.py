"""Metrics on disk: a JSONL line per Trainer log, and PNG plots of the curves users look at first."""

from __future__ import annotations

import json
import os

from transformers import TrainerCallback

METRICS_FILE = "metrics.jsonl"


class MetricsJsonlCallback(TrainerCallback):
    """Appends every log dict (plus `step`) to `output_dir/metrics.jsonl` on the main process."""

    def __init__(self, path: str | None = None):
        self.path = path

    def on_train_begin(self, args, state, control, **kwargs):
        if self.path is None:
            self.path = os.path.join(args.output_dir, METRICS_FILE)
        if state.is_world_process_zero:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


PLOTS = (
    ("reward", "reward"),
    ("kl", "KL to reference"),
    ("completions/mean_length", "completion length (tokens)"),
    ("timing/generation", "seconds per round: generation"),
    ("timing/train_step", "seconds per optimizer step: training"),
    ("timing/wait_generation", "seconds the trainer waited for a round"),
)


def plot_metrics(metrics_path: str, out_png: str, title: str = "grpo_async") -> str:
    """One PNG with a panel per metric present in the JSONL (reward, KL, length, timings)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(metrics_path) if "train_runtime" not in r]
    panels = [(k, label) for k, label in PLOTS if any(k in r for r in rows)]
    if not panels:
        raise ValueError(f"{metrics_path} has none of the metrics {[k for k, _ in PLOTS]}")
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(11, 3.2 * nrows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", lw=1)
        ax.set_title(label)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
