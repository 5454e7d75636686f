"""The end-of-training plot (`metrics.png`, grpo_async/plotting.py) draws panels only for what the run ran, each
titled and labelled for a reader; and `grpo-async --help` shows `serve` the way the README does (issue 47).

The runs are real: the tiny model trains a few CPU steps with `save_metrics_plot=True`, and the figure is rebuilt from
the `metrics.jsonl` it wrote (`plotting.metrics_figure`, what `plot_metrics` saves) so its axes can be read."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from grpo_async import GRPOTrainer
from grpo_async.demo_task import ends_cleanly, letter_reward, make_dataset
from grpo_async.plotting import METRICS_FILE, PLOT_FILE, metrics_figure, read_metrics
from grpo_async.testing import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train(model, out, **overrides):
    """4 steps with a KL term and two reward functions; returns the rows of the `metrics.jsonl` the run wrote."""
    args = tiny_config(out, save_metrics_plot=True, max_steps=4, beta=0.04, **overrides)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[letter_reward, ends_cleanly], args=args, train_dataset=make_dataset(64)
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(os.path.join(out, PLOT_FILE), "rb") as f:
        assert f.read(8) == PNG_MAGIC  # drawn at the end of training
    return read_metrics(os.path.join(out, METRICS_FILE))


def _check_readable(fig) -> list[str]:
    """Every panel has a title, both axis labels, and a legend when it draws several series; returns the titles."""
    from matplotlib.text import Text

    assert fig.axes, "no panel"
    titles = []
    for ax in fig.axes:
        title = ax.get_title()
        assert title.strip(), f"a panel without a title (y: {ax.get_ylabel()!r})"
        assert ax.get_xlabel().strip() == "optimizer step", title
        assert ax.get_ylabel().strip(), f"{title!r} has no y-axis label"
        lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
        assert lines, f"{title!r} draws nothing"
        if len(lines) > 1:
            legend = ax.get_legend()
            assert legend is not None, f"{title!r} draws {len(lines)} series without a legend"
            assert [t.get_text() for t in legend.get_texts()] == [line.get_label() for line in lines]
        titles.append(title)
    # laid out without overlaps: each panel with its title, labels and tick labels inside the figure and clear of
    # the other panels and of the figure's title
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes]
    whole = fig.bbox
    (suptitle,) = [t for t in fig.findobj(Text) if t.figure is fig and t.get_text() == fig.get_suptitle()]
    for i, (ax, box) in enumerate(zip(fig.axes, boxes, strict=True)):
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and whole.y0 <= box.y0 and box.y1 <= whole.y1, ax.get_title()
        assert not box.overlaps(suptitle.get_window_extent(renderer)), ax.get_title()
        for other, other_box in zip(fig.axes[i + 1 :], boxes[i + 1 :], strict=True):
            assert not box.overlaps(other_box), (ax.get_title(), other.get_title())
    return titles


def _lines(fig) -> dict[str, object]:
    return {line.get_label(): line for ax in fig.axes for line in ax.get_lines()}


def test_a_rounds_mode_run_draws_no_stream_panel_and_every_panel_is_labelled(tiny_model_path, tmp_path):
    import matplotlib.pyplot as plt

    rows = _train(tiny_model_path, str(tmp_path / "rounds"), generation_backend="hf", async_mode="rounds")
    fig = metrics_figure(rows, title="rounds")
    try:
        titles = _check_readable(fig)
        assert not [t for t in titles if "stream" in t.lower()], titles
        assert any(t.startswith("Reward") for t in titles) and any(t.startswith("Overlap") for t in titles), titles
        # the 0/1 `async/bottleneck` is drawn as the running share of generation-bound steps, in percent
        steps = [r for r in rows if "async/bottleneck" in r]
        assert len(steps) == 4
        expected = [100 * sum(r["async/bottleneck"] for r in steps[: i + 1]) / (i + 1) for i in range(len(steps))]
        share = next(line for label, line in _lines(fig).items() if "running share" in label)
        assert list(share.get_xdata()) == [r["step"] for r in steps]
        assert list(share.get_ydata()) == pytest.approx(expected)
        overlap = next(ax for ax in fig.axes if ax.get_title().startswith("Overlap"))
        assert "%" in overlap.get_ylabel() and overlap.get_ylim() == (-5, 105)
    finally:
        plt.close(fig)


def test_the_running_share_weights_each_logged_window_by_its_steps():
    """With `logging_steps=10` a row holds its window's mean: the share is over steps, not over rows."""
    import matplotlib.pyplot as plt

    rows = [{"step": 10, "async/bottleneck": 1.0}, {"step": 30, "async/bottleneck": 0.25}]
    fig = metrics_figure(rows)
    try:
        (line,) = fig.axes[0].get_lines()
        assert list(line.get_ydata()) == pytest.approx([100.0, 100 * (10 * 1.0 + 20 * 0.25) / 30])
        _check_readable(fig)
    finally:
        plt.close(fig)


def test_saving_the_plot_draws_the_figure_once(tmp_path, monkeypatch):
    """The panels are placed with fixed margins, not by a layout engine, which made `savefig` draw the whole figure
    twice (once to measure every text): half of a plot's CPU."""
    from matplotlib.figure import Figure

    from grpo_async.plotting import plot_metrics

    path = tmp_path / METRICS_FILE
    path.write_text("".join(f'{{"step": {s}, "reward": {s / 10}, "completions/mean_length": 7}}\n' for s in (1, 2, 3)))
    draws = []
    draw = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda fig, renderer: (draws.append(fig), draw(fig, renderer))[1])
    out = plot_metrics(str(path), str(tmp_path / PLOT_FILE))
    assert len(draws) == 1 and open(out, "rb").read(8) == PNG_MAGIC


@pytest.mark.vllm
def test_a_stream_mode_run_draws_the_stream_panels(tiny_model_path, tmp_path):
    import matplotlib.pyplot as plt

    rows = _train(
        tiny_model_path,
        str(tmp_path / "stream"),
        generation_backend="vllm",
        async_mode="stream",
        vllm_max_model_length=128,
    )
    fig = metrics_figure(rows, title="stream")
    try:
        titles = _check_readable(fig)
        stream = [t for t in titles if t.lower().startswith("stream mode")]
        assert len(stream) == 2, titles  # groups in flight, group latency
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------- CLI help vs README
def _serve_lines(text: str) -> list[str]:
    return [m.strip() for m in re.findall(r"^\s*(grpo-async serve .*)$", text, re.M)]


def test_grpo_async_help_shows_serve_as_the_readme_does():
    """`grpo-async --help` (the real command) gives the model as the README does: positionally, `PATH_OR_HUB_ID`
    (`grpo-async serve` takes `--model` too, as `vllm serve` does; one spelling is shown)."""
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_async.cli", "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    (help_serve,) = _serve_lines(proc.stdout)
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme_serve = [line for line in _serve_lines(f.read()) if "--port 8000 --api-key SECRET" in line]
    assert readme_serve, "the README shows no `grpo-async serve ... --port 8000 --api-key SECRET` command"
    for line in readme_serve:
        assert line.startswith(help_serve), (help_serve, line)  # the README's adds --dtype float32
    assert help_serve.split()[2] == "PATH_OR_HUB_ID" and "--model" not in help_serve


@pytest.mark.vllm
def test_the_serve_parser_takes_the_model_as_help_and_readme_show_it():
    """What `grpo-async serve` really parses: the model positionally (as shown), or with `--model`."""
    from grpo_async.generation.serve import make_parser

    args = make_parser().parse_args(["/models/tiny", "--port", "8000", "--api-key", "SECRET", "--dtype", "float32"])
    assert args.model_tag == "/models/tiny" and args.port == 8000
    assert make_parser().parse_args(["--model", "/models/tiny"]).model == "/models/tiny"
