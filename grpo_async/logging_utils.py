"""Metrics on disk: a JSONL line per Trainer log (plotted at the end of training by `plotting.plot_metrics`, as
`grpo-async plot OUTPUT_DIR` does), the console's progress lines, and the completions table (console and parquet)."""

from __future__ import annotations

import json
import logging
import os
import time

from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .plotting import METRICS_FILE, PLOT_FILE, plot_metrics, read_metrics

logger = logging.getLogger(__name__)


class MetricsJsonlCallback(TrainerCallback):
    """Appends every log dict (plus `step`) to `output_dir/metrics.jsonl` on the main process; with `plot`, draws
    `output_dir/metrics.png` from it at the end of training (`GRPOConfig.save_metrics_plot`)."""

    def __init__(self, path: str | None = None, plot: bool = True):
        self.path = path
        self.plot = plot

    def on_train_begin(self, args, state, control, **kwargs):
        if self.path is None:
            self.path = os.path.join(args.output_dir, METRICS_FILE)
        if state.is_world_process_zero:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            if state.global_step > 0:  # resumed: the steps after the checkpoint are trained (and logged) again
                truncate_metrics(self.path, state.global_step)
            elif os.path.exists(self.path) and os.path.getsize(self.path) > 0:
                # a fresh run (e.g. a run killed before its first checkpoint, started again): its steps are logged
                # anew; the earlier lines would appear twice, so they are kept beside it, not mixed in
                root, ext = os.path.splitext(self.path)
                os.replace(self.path, f"{root}.previous{ext}")
                logger.warning(
                    "%s is an earlier run's (no checkpoint to resume): moved to %s",
                    self.path,
                    root + ".previous" + ext,
                )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        """Plots the run into `output_dir/metrics.png` (what `grpo-async plot OUTPUT_DIR` draws)."""
        if not self.plot or not state.is_world_process_zero or self.path is None or not os.path.exists(self.path):
            return
        try:
            if not any("train_runtime" not in row for row in read_metrics(self.path)):  # logging_steps > the steps
                logger.info("no training step was logged (logging_steps=%s): no %s", args.logging_steps, PLOT_FILE)
                return
            plot_metrics(self.path, os.path.join(args.output_dir, PLOT_FILE), title=os.path.basename(args.output_dir))
        except Exception as e:  # a plot must not fail a finished run; say why it is missing
            logger.warning("could not plot %s: %s: %s", self.path, type(e).__name__, e)


def truncate_metrics(path: str, step: int) -> int:
    """Drop the lines of `path` logged after optimizer step `step` (a run resumed from checkpoint-`step` logs them
    again; kept, they would appear twice and the plot would draw backwards). Returns how many were dropped.

    A torn last line (the process was killed while appending it) is dropped with a warning; an unreadable line
    before the last raises a `ValueError` naming the file and line."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    steps = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            steps.append(record.get("step", 0))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            if i < len(lines) - 1:
                raise ValueError(f"{path} line {i + 1} is not a JSON object ({e}); repair or remove that line") from e
            logger.warning("%s: dropping its torn last line (a run killed while logging): %r", path, line[:120])
            steps.append(None)
    kept = [line for line, s in zip(lines, steps) if s is not None and s <= step]
    if len(kept) != len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    return len(lines) - len(kept)


def _fmt(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def summary_line(logs: dict, step: int, max_steps: int | None = None, seconds_per_step: float | None = None) -> str:
    """One short console line for a Trainer log: step, reward, KL, mean completion length, seconds per optimizer
    step (wall clock) and mean staleness (the full dict goes to metrics.jsonl and `report_to`)."""
    if "train_runtime" in logs:  # the end-of-training summary
        return (
            f"done: {_fmt(logs.get('train_runtime'), '.0f')} s, {_fmt(logs.get('train_steps_per_second'), '.3f')} "
            f"steps/s, mean loss {_fmt(logs.get('train_loss'), '.4f')}"
        )
    total = f"/{max_steps}" if max_steps and max_steps > 0 else ""
    return (
        f"step {step}{total}  reward {_fmt(logs.get('reward'), '.3f')}  kl {_fmt(logs.get('kl'), '.4f')}  "
        f"len {_fmt(logs.get('completions/mean_length'), '.1f')}  {_fmt(seconds_per_step, '.2f')} s/step  "
        f"staleness {_fmt(logs.get('async/staleness'), '.2f')}"
    )


class ConciseProgressCallback(ProgressCallback):
    """The Trainer's progress bar, with one short line per log (`summary_line`) instead of the whole metrics dict,
    and a line saying from which step a resumed run continues. Install it with `use_concise_console(trainer)`."""

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = (time.perf_counter(), state.global_step)
        if state.is_world_process_zero and state.global_step > 0:
            print(resume_message(state.global_step, getattr(args, "resume_from_checkpoint", None)), flush=True)
        super().on_train_begin(args, state, control, **kwargs)

    _last: tuple[float, int] | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now, seconds = time.perf_counter(), None
        if self._last is not None and state.global_step > self._last[1]:
            seconds = (now - self._last[0]) / (state.global_step - self._last[1])
        self._last = (now, state.global_step)
        line = summary_line(logs, state.global_step, state.max_steps, seconds)
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)


def resume_message(step: int, checkpoint: str | None = None) -> str:
    where = f" ({checkpoint})" if isinstance(checkpoint, str) else ""
    return f"resuming from the checkpoint at step {step}{where}: training continues at step {step + 1}"


def use_concise_console(trainer) -> None:
    """Replace the Trainer's console printer (a dict of every metric per log) by `ConciseProgressCallback`: the
    progress bar (unless `disable_tqdm`) and one short line per log. `metrics.jsonl` and `report_to` still get every
    metric."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    cb = ConciseProgressCallback()
    if trainer.args.disable_tqdm:  # no bar: the lines only
        cb.on_train_begin = _lines_only_begin.__get__(cb)
        cb.on_step_end = lambda *a, **k: None
        cb.on_prediction_step = lambda *a, **k: None
        cb.on_evaluate = lambda *a, **k: None
        cb.on_predict = lambda *a, **k: None
        cb.on_train_end = lambda *a, **k: None
    trainer.add_callback(cb)


def _lines_only_begin(self, args, state, control, **kwargs):
    self._last = (time.perf_counter(), state.global_step)
    if state.is_world_process_zero and state.global_step > 0:
        print(resume_message(state.global_step, getattr(args, "resume_from_checkpoint", None)), flush=True)


# ----------------------------------------------------------------------------------------------------------------
# completions table: console (rich) and output_dir/completions/step_<N>.parquet
# ----------------------------------------------------------------------------------------------------------------
COMPLETIONS_DIR = "completions"


def as_text(x) -> str:
    """A prompt or completion as one string: chat messages as `role: content` lines."""
    if isinstance(x, str):
        return x
    if isinstance(x, list) and all(isinstance(m, dict) and "role" in m for m in x):
        return "\n".join(f"{m['role']}: {m.get('content', '')}" for m in x)
    return str(x)


def completion_columns(samples: dict, step: int) -> dict[str, list]:
    """The table's columns: step, round, prompt, completion, one per reward function, reward, advantage,
    policy_version. `samples` is the `"samples"` dict of a generated round."""
    n = len(samples["prompt"])
    cols: dict[str, list] = {
        "step": [step] * n,
        "round": [samples.get("round", -1)] * n,
        "prompt": [as_text(p) for p in samples["prompt"]],
        "completion": [as_text(c) for c in samples["completion"]],
    }
    fixed = {"step", "round", "prompt", "completion", "reward", "advantage", "policy_version"}
    for name, values in samples.get("rewards", {}).items():
        cols[f"reward_{name}" if name in fixed else name] = [float(v) for v in values]
    cols["reward"] = [float(v) for v in samples["reward"]]
    cols["advantage"] = [float(v) for v in samples["advantage"]]
    cols["policy_version"] = [int(v) for v in samples.get("policy_version", [-1] * n)]
    for name, values in samples.get("extra", {}).items():  # reward functions' log_extra columns, as given
        cols[name if name not in cols else f"extra_{name}"] = list(values)
    if len(samples.get("images") or ()) == n:  # a VLM's rows (log_multimodal): each row's images as PNG bytes
        cols["images"] = [list(v) for v in samples["images"]]
    return cols


def write_completions_parquet(samples: dict, output_dir: str, step: int) -> str:
    """Writes every sample of the round to `output_dir/completions/step_<step>.parquet`; returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = os.path.join(output_dir, COMPLETIONS_DIR, f"step_{step:06d}.parquet")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pydict(completion_columns(samples, step)), path)
    return path


def read_completions(output_dir: str):
    """All completion tables of a run as one pandas DataFrame, in step order."""
    import pandas as pd

    folder = os.path.join(output_dir, COMPLETIONS_DIR)
    files = sorted(f for f in os.listdir(folder) if f.endswith(".parquet"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .parquet completion tables (was log_completions on?)")
    return pd.concat([pd.read_parquet(os.path.join(folder, f)) for f in files], ignore_index=True)


def cut_prompt(text: str, limit: int) -> str:
    """The end of `text` in at most `limit` characters: cut at a word boundary, with a leading ellipsis when cut."""
    if len(text) <= limit:
        return text
    tail = text[-(limit - 1) :]
    for i, ch in enumerate(tail):
        if ch.isspace():
            if tail[i + 1 :].strip():
                tail = tail[i + 1 :]
            break
    return "…" + tail


def completions_table(samples: dict, step: int, n: int | None, unique_prompts: bool = False):
    """A rich `Table` of the first `n` samples: prompt, completion, each reward function, reward, advantage,
    policy version. `unique_prompts`: only the first completion of each prompt (TRL's `log_unique_prompts`)."""
    from rich.table import Table

    cols = completion_columns(samples, step)
    reward_cols = [k for k in cols if k not in ("step", "round", "prompt", "completion", "policy_version", "images")]
    table = Table(title=f"completions @ step {step} (round {cols['round'][0]})", show_lines=True)
    table.add_column("prompt", overflow="fold", min_width=24, max_width=48)
    table.add_column("completion", overflow="fold", min_width=24, max_width=64)
    for k in reward_cols:
        table.add_column(k, justify="right", no_wrap=True)
    table.add_column("policy_version", justify="right", no_wrap=True)
    rows = list(range(len(cols["prompt"])))
    if unique_prompts:
        rows = [i for i in rows if cols["prompt"][i] not in cols["prompt"][:i]]
    for i in rows if n is None else rows[:n]:  # None: all (as TRL)
        table.add_row(
            cut_prompt(cols["prompt"][i], 200),
            cols["completion"][i][:400],
            *(f"{cols[k][i]:.3f}" if isinstance(cols[k][i], float) else str(cols[k][i])[:40] for k in reward_cols),
            str(cols["policy_version"][i]),
        )
    return table


def log_completions(samples: dict, output_dir: str, step: int, n: int | None, unique_prompts: bool = False) -> str:
    """Prints the first `n` samples (of distinct prompts with `unique_prompts`) as a table (at least 160 columns wide
    when stdout is not a terminal) and writes all of them to `output_dir/completions/step_<step>.parquet`; returns
    the parquet path."""
    import sys

    from rich.console import Console

    path = write_completions_parquet(samples, output_dir, step)
    width = None if sys.stdout.isatty() else max(160, Console().width)
    Console(width=width).print(completions_table(samples, step, n, unique_prompts))
    return path
