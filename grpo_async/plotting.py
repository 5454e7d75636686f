"""The metrics a run logs, read back and drawn: `metrics.jsonl` (written by `logging_utils.MetricsJsonlCallback`) and
its plot, `metrics.png`. No torch or transformers here: `grpo-async plot` imports only this module and matplotlib
(~1 s, where importing the callbacks' transformers took ~6).

The plot draws a panel only for what the run logged: `metrics.jsonl` holds the logged metrics, not the run's config,
so a panel is drawn when at least one of its metrics is in the file. Stream mode's own metrics
(`async/inflight_groups`, `async/group_latency/*`) are logged by the group stream only, so a rounds-mode run (or a
synchronous one) draws no stream-mode panel."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, replace

#: the JSON-lines log of every `Trainer.log` call, in `output_dir`
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class Panel:
    """One panel of the plot. `name`: a short, stable id (what `metric_panels` returns; tests and callers key on it);
    `title`: what the panel shows, in words; `ylabel`: the quantity and its unit; `series`: (metric key, legend
    label). `percent`: the metrics are fractions in [0, 1], drawn × 100; `dashed_from`: series from this index on are
    drawn thinner and dashed (per-function rewards, min / max, ...); `running_share`: 0/1 metrics drawn as their
    running share of the steps so far (in percent)."""

    name: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]
    percent: bool = False
    full_range: bool = False  # percent panels: the y axis spans 0-100 %
    dashed_from: int | None = None
    running_share: tuple[str, ...] = ()
    eng_unit: str | None = None  # tick labels with SI prefixes (1.2 G) for this unit
    integer: bool = False  # counts: whole-number ticks on the y axis


#: every panel `plot_metrics` can draw, in order; `rewards/<name>/mean` of each reward function is added to "reward"
PANEL_SPECS = (
    Panel(
        "reward",
        "Reward (mean over the step's completions)",
        "reward",
        (("reward", "total (weighted sum of the functions)"),),
        dashed_from=1,
    ),
    Panel(
        "KL to the reference model",
        "KL divergence of the policy from the reference model",
        "KL (nats per token)",
        (("kl", "KL(policy ‖ reference)"),),
    ),
    Panel(
        "completion length",
        "Completion length",
        "tokens per completion",
        (
            ("completions/mean_length", "mean"),
            ("completions/min_length", "shortest"),
            ("completions/max_length", "longest"),
        ),
        dashed_from=1,
    ),
    Panel(
        "time per step",
        "Time per optimizer step (generation runs beside training)",
        "seconds",
        (
            ("timing/generation", "generating a round"),
            ("timing/train_step", "training (one optimizer step)"),
            ("timing/wait_generation", "trainer waiting for its round"),
        ),
    ),
    Panel(
        "overlap of generation and training",
        "Overlap of generation and training (100 % = neither side waited)",
        "percent (%)",
        (
            ("async/overlap", "overlap: max(generation, training) / step time"),
            ("async/bottleneck", "steps where training waited on generation (running share)"),
            ("async/engine_busy", "generator busy (share of wall time with work)"),
        ),
        percent=True,
        full_range=True,
        dashed_from=1,
        running_share=("async/bottleneck",),
    ),
    Panel(
        "idle time per step",
        "Idle time per optimizer step",
        "seconds idle",
        (
            ("async/trainer_wait", "trainer (waiting for a round, a push or queue room)"),
            ("async/generator_idle", "generator (nothing to generate)"),
        ),
    ),
    Panel(
        "throughput",
        "Throughput",
        "tokens per second",
        (
            ("perf/train_tokens_per_second", "trained (prompt + completion, per device)"),
            ("perf/generated_tokens_per_second", "generated (completion tokens)"),
        ),
    ),
    Panel(
        "stream mode: groups in flight",
        "Stream mode: prompt groups being generated at once",
        "prompt groups",
        (("async/inflight_groups", "groups in flight"),),
        integer=True,
    ),
    Panel(
        "stream mode: group latency",
        "Stream mode: time from a group's start to its rewards",
        "seconds",
        (("async/group_latency/p50", "median"), ("async/group_latency/p90", "90th percentile")),
    ),
    Panel(
        "importance-sampling ratio (π_old / π_sampler)",
        "Importance-sampling ratio π_old / π_sampler (1 = they agree)",
        "ratio",
        (
            ("sampling/importance_sampling_ratio/mean", "mean"),
            ("sampling/importance_sampling_ratio/min", "min"),
            ("sampling/importance_sampling_ratio/max", "max"),
        ),
        dashed_from=1,
    ),
    Panel(
        "sampler vs trainer (mismatch)",
        "Log-probability mismatch between the sampler and the trainer",
        "nats",
        (
            ("sampling/kl", "KL(sampler ‖ π_old) per token (k3)"),
            ("sampling/logp_diff/max", "largest |log π_old − log π_sampler|"),
        ),
    ),
    Panel(
        "importance-sampling: outside the clip range",
        "Importance sampling: ratios outside the clip range (masked or clipped)",
        "% of tokens (or completions)",
        (("sampling/masked_fraction", "outside [clip_min, clip_max]"),),
        percent=True,
    ),
    Panel(
        "training FLOPs per second",
        "Training compute per device",
        "FLOP/s per device",
        (("perf/flops_per_second", "FLOP/s"),),
        eng_unit="",
    ),
    Panel(
        "model FLOPs utilisation",
        "Model FLOPs utilisation (share of the device's peak)",
        "% of the device's peak",
        (("perf/mfu", "MFU"),),
    ),
)


def _present(rows: list[dict]) -> list[Panel]:
    """The panels with at least one metric logged in `rows`, each with only its logged series (the reward panel
    with each reward function's mean)."""
    keys = {k for r in rows for k in r}
    reward_funcs = sorted(k for k in keys if k.startswith("rewards/") and k.endswith("/mean"))
    panels = []
    for p in PANEL_SPECS:
        series = p.series
        if p.name == "reward":
            series += tuple((k, f"{k[len('rewards/') : -len('/mean')]} (unweighted)") for k in reward_funcs)
        present = tuple((k, label) for k, label in series if k in keys)
        if present:
            dashed = None if p.dashed_from is None else max(1, sum(1 for k, _ in series[: p.dashed_from] if k in keys))
            panels.append(replace(p, series=present, dashed_from=dashed))
    return panels


def metric_panels(rows: list[dict]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The panels `plot_metrics` draws for these log rows, as (name, y label, [(metric key, legend label)]): only
    panels with a series present in at least one row, each with only those series."""
    return [(p.name, p.ylabel, list(p.series)) for p in _present(rows)]


def _points(rows: list[dict], key: str, running_share: bool) -> tuple[list, list]:
    """(steps, values) of `key`; a running share is the step-weighted mean of the 0/1 values so far (a row logged
    every `logging_steps` holds the mean of its window, so it counts for the steps since the previous row)."""
    xs, ys = [], []
    total = weight_sum = 0.0
    prev = 0
    for r in rows:
        v = r.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        step = r.get("step", 0)
        if running_share:
            w = step - prev if isinstance(step, (int, float)) and step > prev else 1
            total, weight_sum = total + w * v, weight_sum + w
            v = total / weight_sum
        prev = step if isinstance(step, (int, float)) else prev
        xs.append(step)
        ys.append(v)
    return xs, ys


#: inches around each panel: its y tick labels and label (left), its title (above), its x tick labels and label
#: (below); and above the top row for the figure's title
PANEL_LEFT_IN, PANEL_RIGHT_IN, PANEL_TOP_IN, PANEL_BOTTOM_IN, TITLE_IN = 0.9, 0.15, 0.32, 0.5, 0.45


def _fixed_margins(fig, width: float, height: float, cols: int, nrows: int) -> None:
    """Place the panels with fixed margins in inches (`PANEL_*_IN`): a layout engine (`layout="constrained"`) made
    `savefig` draw the whole figure twice, once to measure every text, ~half of a plot's ~2.5 CPU-s."""
    ax_w = (width - cols * (PANEL_LEFT_IN + PANEL_RIGHT_IN)) / cols
    ax_h = (height - TITLE_IN - nrows * (PANEL_TOP_IN + PANEL_BOTTOM_IN)) / nrows
    fig.subplots_adjust(
        left=PANEL_LEFT_IN / width,
        right=1 - PANEL_RIGHT_IN / width,
        bottom=PANEL_BOTTOM_IN / height,
        top=1 - (TITLE_IN + PANEL_TOP_IN) / height,
        wspace=(PANEL_LEFT_IN + PANEL_RIGHT_IN) / ax_w,
        hspace=(PANEL_TOP_IN + PANEL_BOTTOM_IN) / ax_h,
    )


def metrics_figure(rows: list[dict], title: str = "grpo_async"):
    """The plot of these log rows (train_runtime summaries left out) as a `matplotlib` figure, one axis per panel of
    what the run logged (`fig.axes[i].get_title()` is panel i's title); the caller saves and closes it. Raises
    `ValueError` when the rows hold none of the plotted metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    rows = [r for r in rows if "train_runtime" not in r]
    panels = _present(rows)
    if not panels:
        raise ValueError(f"has none of the metrics {[k for p in PANEL_SPECS for k, _ in p.series]}")
    cols = 2 if len(panels) > 1 else 1
    nrows = (len(panels) + cols - 1) // cols
    width, height = 6 * cols, 3.4 * nrows
    fig, axes = plt.subplots(nrows, cols, figsize=(width, height), squeeze=False)
    _fixed_margins(fig, width, height, cols, nrows)
    for ax, p in zip(axes.flat, panels, strict=False):
        for i, (key, label) in enumerate(p.series):
            xs, ys = _points(rows, key, key in p.running_share)
            if p.percent:
                ys = [100 * y for y in ys]
            dashed = p.dashed_from is not None and i >= p.dashed_from
            ax.plot(
                xs,
                ys,
                marker="." if len(xs) < 60 else None,
                lw=1.0 if dashed else 1.5,
                ls="--" if dashed else "-",
                alpha=0.8 if dashed else 1.0,
                label=label,
            )
        ax.set_title(p.title, fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(p.ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if p.full_range:
            ax.set_ylim(-5, 105)
        elif p.percent:
            ax.set_ylim(bottom=0)
        if p.integer:
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if p.eng_unit is not None:
            ax.yaxis.set_major_formatter(EngFormatter(unit=p.eng_unit))
        ax.grid(alpha=0.3)
        if len(p.series) > 1:
            ax.legend(fontsize=7.5)
    for ax in list(axes.flat)[len(panels) :]:
        fig.delaxes(ax)  # an odd panel count leaves one slot empty
    fig.suptitle(title, y=1 - 0.1 / height)  # 0.1 in below the top edge, above the panels' titles
    return fig


def plot_metrics(metrics_path: str, out_png: str, title: str = "grpo_async") -> str:
    """Draw `metrics_figure` of the JSONL that `MetricsJsonlCallback` writes into `out_png`: a panel each for what
    the run logged (reward and each reward function, KL, completion length, where a step's time went, how well
    generation and training overlapped, idle time, throughput, stream mode's groups in flight and their latency,
    the sampler / trainer mismatch, FLOP/s, MFU); x = optimizer step. Returns `out_png`."""
    try:
        fig = metrics_figure(read_metrics(metrics_path), title)
    except ValueError as e:
        raise ValueError(f"{metrics_path} {e}") from None
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
    try:
        fig.savefig(out_png, dpi=110)
    finally:
        plt.close(fig)
    return out_png


def copy_or_plot(metrics_path: str, out_png: str, title: str = "grpo_async") -> str:
    """`out_png` under a recipe's own name: a copy of the run's end-of-training plot (`PLOT_FILE` beside
    `metrics_path`, which `MetricsJsonlCallback` draws after the run's last log row) when there is one newer than
    `metrics_path`, instead of drawing the same figure again (~2 CPU-s); otherwise `plot_metrics(metrics_path,
    out_png, title)` (no plot at the end of training: `save_metrics_plot=False`, rows logged after it, or a file
    system whose times cannot tell them apart). Returns `out_png`."""
    drawn = os.path.join(os.path.dirname(metrics_path), PLOT_FILE)
    if os.path.exists(drawn) and os.path.getmtime(drawn) > os.path.getmtime(metrics_path):
        os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
        shutil.copyfile(drawn, out_png)
        return out_png
    return plot_metrics(metrics_path, out_png, title)
