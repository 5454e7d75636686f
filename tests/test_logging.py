"""Logging: the completions table (console + parquet), tensorboard event files, and the PNG plots written at the
end of training and by `grpo-async plot OUTPUT_DIR` (mirrors grpo_async/logging_utils.py and
grpo_async/plotting.py)."""

import contextlib
import glob
import io
import json
import os
import shutil

import pytest

from grpo_async import GRPOConfig, GRPOTrainer
from grpo_async.demo_task import ends_cleanly, letter_reward, make_dataset
from grpo_async.logging_utils import COMPLETIONS_DIR, completion_columns, read_completions
from grpo_async.plotting import METRICS_FILE, PLOT_FILE, copy_or_plot, metric_panels, plot_metrics, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    """One 3-step run with a KL term, two reward functions, the completions table and tensorboard."""
    out = str(tmp_path_factory.mktemp("logging") / "out")
    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        report_to=["tensorboard"],
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=1,
        max_completion_length=8,
        max_steps=3,
        beta=0.04,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        log_completions=True,
        num_completions_to_print=2,
        reward_weights=[1.0, 0.5],
        seed=0,
    )
    trainer = GRPOTrainer(
        model=tiny_model_path,
        reward_funcs=[letter_reward, ends_cleanly],
        args=args,
        train_dataset=make_dataset(64),
    )
    console = io.StringIO()
    with contextlib.redirect_stdout(console):  # rich prints the table to sys.stdout
        trainer.train()
    return trainer, out, console.getvalue()


def test_completions_parquet_has_every_sample_with_rewards_and_policy_version(run):
    trainer, out, _ = run
    files = sorted(os.listdir(os.path.join(out, COMPLETIONS_DIR)))
    assert files == ["step_000001.parquet", "step_000002.parquet", "step_000003.parquet"]  # one per log step
    df = read_completions(out)
    assert list(df.columns) == [
        "step",
        "round",
        "prompt",
        "completion",
        "letter_reward",
        "ends_cleanly",
        "reward",
        "advantage",
        "policy_version",
    ]
    assert len(df) == 3 * 8  # every completion of each round (8 rows: 2 prompts × 4 generations)
    assert sorted(set(df["step"])) == [1, 2, 3]
    assert sorted(set(df["round"])) == [0, 1, 2]
    # the reward is the weighted sum of the functions' rewards
    expected = df["letter_reward"] * 1.0 + df["ends_cleanly"] * 0.5
    assert (df["reward"] - expected).abs().max() < 1e-5
    # advantages are centred within each prompt's group of 4
    for _, group in df.groupby(["round", "prompt"]):
        assert len(group) == 4 and abs(group["advantage"].mean()) < 1e-5
    # num_batches_ahead=1: round 0 (and round 1) come from the initial weights, later rounds from newer ones
    versions = df.groupby("round")["policy_version"].first().tolist()
    assert versions[0] == 0 and versions == sorted(versions) and versions[-1] >= 1
    assert all(isinstance(p, str) and p for p in df["prompt"])


def test_console_table_names_each_reward_and_the_policy_version(run):
    from rich.console import Console

    from grpo_async.logging_utils import completions_table

    printed = run[2]
    assert printed.count("completions @ step") == 3  # one table per log step
    for col in ("letter_reward", "ends_cleanly", "advantage", "policy_version"):
        assert col in printed, col
    samples = {
        "prompt": ["p1", "p2"],
        "completion": ["c1", "c2"],
        "rewards": {"letter_reward": [1.0, 0.0], "ends_cleanly": [1.0, 1.0]},
        "reward": [1.5, 0.5],
        "advantage": [0.7, -0.7],
        "policy_version": [3, 3],
        "round": 4,
    }
    console = Console(record=True, width=200)
    console.print(completions_table(samples, step=7, n=2))
    text = console.export_text()
    for col in ("prompt", "completion", "letter_reward", "ends_cleanly", "reward", "advantage", "policy_version"):
        assert col in text, col
    assert "completions @ step 7" in text


def test_chat_prompts_become_text_and_colliding_reward_names_are_prefixed():
    samples = {
        "prompt": [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]],
        "completion": ["hello"],
        "rewards": {"reward": [0.5]},
        "reward": [0.5],
        "advantage": [0.0],
        "policy_version": [2],
        "round": 1,
    }
    cols = completion_columns(samples, step=5)
    assert cols["prompt"] == ["system: be brief\nuser: hi"]
    assert cols["reward_reward"] == [0.5] and cols["reward"] == [0.5]


def test_tensorboard_event_files_hold_our_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _ = run
    events = glob.glob(os.path.join(out, "**", "events.out.tfevents.*"), recursive=True)
    assert events, f"no tensorboard event file under {out}"
    tags = set()
    for path in events:
        acc = EventAccumulator(path)
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for name in ("reward", "kl", "completions/mean_length", "timing/generation", "rewards/letter_reward/mean"):
        assert f"train/{name}" in tags, (name, sorted(tags))


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG_MAGIC


def test_plot_written_at_the_end_of_training(run):
    _, out, _ = run
    assert _png(os.path.join(out, PLOT_FILE))
    rows = [r for r in read_metrics(os.path.join(out, METRICS_FILE)) if "train_runtime" not in r]
    panels = {title: [k for k, _ in series] for title, _, series in metric_panels(rows)}
    assert panels["reward"] == ["reward", "rewards/ends_cleanly/mean", "rewards/letter_reward/mean"]
    assert panels["KL to the reference model"] == ["kl"]
    assert panels["completion length"] == [
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
    ]
    assert panels["time per step"] == ["timing/generation", "timing/train_step", "timing/wait_generation"]
    assert panels["overlap of generation and training"] == ["async/overlap", "async/bottleneck", "async/engine_busy"]
    assert panels["idle time per step"] == ["async/trainer_wait", "async/generator_idle"]
    assert panels["importance-sampling ratio (π_old / π_sampler)"] == [
        "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/min",
        "sampling/importance_sampling_ratio/max",
    ]
    assert panels["sampler vs trainer (mismatch)"] == ["sampling/kl", "sampling/logp_diff/max"]  # nats
    assert panels["importance-sampling: outside the clip range"] == ["sampling/masked_fraction"]  # percent
    assert not [t for t in panels if "stream" in t]  # a rounds-mode run logs no stream-mode metric


def test_a_recipes_plot_is_the_runs_own_until_a_row_is_logged_after_it(run, tmp_path):
    """`copy_or_plot` (the recipes' `reward_curve.png`): the end-of-training plot copied, not drawn again; drawn anew
    from the rows once one was logged after that plot."""
    _, out, _ = run
    drawn = open(os.path.join(out, PLOT_FILE), "rb").read()
    copy = copy_or_plot(os.path.join(out, METRICS_FILE), str(tmp_path / "copy" / "reward_curve.png"), title="t")
    assert open(copy, "rb").read() == drawn
    later = tmp_path / "later"
    later.mkdir()
    shutil.copy2(os.path.join(out, PLOT_FILE), later / PLOT_FILE)
    rows = open(os.path.join(out, METRICS_FILE)).read() + json.dumps({"step": 4, "reward": 0.5}) + "\n"
    (later / METRICS_FILE).write_text(rows)  # written after the plot it sits beside
    redrawn = copy_or_plot(str(later / METRICS_FILE), str(later / "reward_curve.png"), title="t")
    assert _png(redrawn) and open(redrawn, "rb").read() != drawn


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")  # IHDR width, height


def test_plot_draws_the_overlap_panels_when_logged(tmp_path):
    """`async/overlap` (and the idle seconds) get their own panels; a metrics file without them draws none."""
    path = str(tmp_path / METRICS_FILE)
    with open(path, "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "reward": 0.1 * step}) + "\n")
    assert [t for t, _, _ in metric_panels(read_metrics(path))] == ["reward"]
    without = _png_size(plot_metrics(path, str(tmp_path / "without.png")))
    with open(path, "w") as f:
        for step in (1, 2, 3):
            row = {"step": step, "reward": 0.1 * step, "async/overlap": 0.9, "async/bottleneck": 1.0}
            f.write(json.dumps({**row, "async/trainer_wait": 0.3, "async/generator_idle": 0.05}) + "\n")
    rows = read_metrics(path)
    assert [t for t, _, _ in metric_panels(rows)] == [
        "reward",
        "overlap of generation and training",
        "idle time per step",
    ]
    with_overlap = _png_size(plot_metrics(path, str(tmp_path / "with.png")))
    # 1 panel: one 6-inch column and one row; 3 panels: two columns and two rows (110 dpi)
    assert without == (660, 374) and with_overlap == (1320, 748)


def test_grpo_async_plot_command(run, tmp_path, capsys):
    """`grpo-async plot` through `grpo_async.cli.main(argv)` in this process (tests/test_cli.py runs
    `python -m grpo_async.cli plot` as a command)."""
    from grpo_async.cli import main

    _, out, _ = run
    png = str(tmp_path / "curves.png")
    assert main(["plot", out, "--out", png]) == 0
    assert capsys.readouterr().out.strip() == png and _png(png)
    # without --out: OUTPUT_DIR/metrics.png
    os.remove(os.path.join(out, PLOT_FILE))
    assert main(["plot", out]) == 0
    assert _png(os.path.join(out, PLOT_FILE))


def test_plot_command_errors_name_the_problem(tmp_path, capsys):
    from grpo_async.cli import main

    with pytest.raises(SystemExit) as e:
        main(["plot", str(tmp_path)])
    assert e.value.code == 2 and "metrics.jsonl does not exist" in capsys.readouterr().err
    with open(tmp_path / METRICS_FILE, "w") as f:
        f.write(json.dumps({"step": 1, "loss": 0.1}) + "\n")
    with pytest.raises(ValueError, match="has none of the metrics"):
        plot_metrics(str(tmp_path / METRICS_FILE), str(tmp_path / "x.png"))


# ------------------------------------------------------------------------------------------------ console, resume
def test_resume_drops_the_metrics_logged_after_the_checkpoint(tmp_path, capsys):
    """Resuming from checkpoint-60 of a run that got to step 72: steps 61-72 are trained and logged again, so the
    old lines go (else they appear twice and the plot draws backwards), and the console says from where it resumes."""
    from transformers.trainer_callback import TrainerControl, TrainerState

    from grpo_async import GRPOConfig
    from grpo_async.logging_utils import ConciseProgressCallback, MetricsJsonlCallback

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 100}) + "\n" for s in range(1, 73)))
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True)
    state = TrainerState(global_step=60, max_steps=100)
    MetricsJsonlCallback().on_train_begin(args, state, TrainerControl())
    assert [r["step"] for r in read_metrics(str(path))] == list(range(1, 61))
    ConciseProgressCallback().on_train_begin(args, state, TrainerControl())
    assert "resuming from the checkpoint at step 60" in capsys.readouterr().out


def test_a_fresh_run_moves_an_earlier_runs_metrics_aside(tmp_path):
    """A run killed before its first checkpoint and started again (nothing to resume) logs step 1 anew: the earlier
    lines move to metrics.previous.jsonl instead of appearing twice (the chaos test found `[1, 1, 2, ...]`)."""
    from transformers.trainer_callback import TrainerControl, TrainerState

    from grpo_async.logging_utils import MetricsJsonlCallback

    path = tmp_path / "metrics.jsonl"
    earlier = json.dumps({"step": 1, "reward": 0.5}) + "\n"
    path.write_text(earlier)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True)
    callback = MetricsJsonlCallback()
    callback.on_train_begin(args, TrainerState(global_step=0, max_steps=10), TrainerControl())
    callback.on_log(args, TrainerState(global_step=1, max_steps=10), TrainerControl(), logs={"reward": 0.7})
    assert [r["reward"] for r in read_metrics(str(path))] == [0.7]
    assert (tmp_path / "metrics.previous.jsonl").read_text() == earlier


def test_a_run_that_logged_no_step_draws_no_plot_and_warns_nothing(tmp_path, caplog):
    """`logging_steps` above the run's steps (TRL's default 10, a 6-step run): only the train summary is logged, so
    there is no plot, said at info level, not as a failed plot."""
    from transformers.trainer_callback import TrainerControl, TrainerState

    from grpo_async.logging_utils import MetricsJsonlCallback

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=10)
    callback, state = MetricsJsonlCallback(), TrainerState(global_step=6, max_steps=6, is_world_process_zero=True)
    callback.on_train_begin(args, TrainerState(global_step=0, max_steps=6), TrainerControl())
    callback.on_log(args, state, TrainerControl(), logs={"train_runtime": 1.0, "reward": 0.5})
    with caplog.at_level("INFO", logger="grpo_async.logging_utils"):
        callback.on_train_end(args, state, TrainerControl())
    assert not (tmp_path / PLOT_FILE).exists()
    ours = [r for r in caplog.records if r.name == "grpo_async.logging_utils"]  # (other tests' state may warn too)
    assert [r.levelname for r in ours] == ["INFO"] and "logging_steps=10" in ours[0].getMessage()


def test_one_short_console_line_per_log():
    from grpo_async.logging_utils import summary_line

    logs = {"reward": 0.51234, "kl": 0.001, "completions/mean_length": 12.25, "async/staleness": 1.0, "loss": 0.1}
    line = summary_line({**logs, **{f"extra/{i}": i for i in range(40)}}, 7, 200, seconds_per_step=0.5)
    assert line == "step 7/200  reward 0.512  kl 0.0010  len 12.2  0.50 s/step  staleness 1.00"


def test_the_trainer_prints_short_lines_and_no_metric_dicts(tiny_model_path, tmp_path, capsys):
    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.logging_utils import use_concise_console

    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_prompt_length=16,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        generation_backend="hf",
        num_batches_ahead=0,
        disable_tqdm=False,
    )
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    use_concise_console(trainer)
    trainer.train()
    trainer.close()
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert "step 1/2  reward" in out and "step 2/2  reward" in out
    assert "'rewards/letter_reward/mean'" not in out  # no metric dict printed
    assert len(read_metrics(str(tmp_path / "metrics.jsonl"))) == 3  # every log still on disk (2 steps + summary)


def test_the_completions_table_cuts_the_prompt_at_a_word_boundary():
    from grpo_async.logging_utils import cut_prompt

    text = "system: " + " ".join(f"word{i}" for i in range(100)) + " Say b"
    cut = cut_prompt(text, 40)
    assert cut.startswith("…") and cut.endswith("Say b") and len(cut) <= 40
    assert cut[1:].split()[0] in text.split()  # starts with a whole word
    assert cut_prompt("short prompt", 40) == "short prompt"


def test_plot_draws_the_stream_panels_when_logged(tmp_path):
    """Stream mode's live metrics (`async/inflight_groups`, `async/group_latency/p50|p90`) get their two panels,
    only when logged; `async/engine_busy` (logged in either mode) is a series of the overlap panel."""
    path = str(tmp_path / METRICS_FILE)
    with open(path, "w") as f:
        for step in (1, 2, 3):
            row = {"step": step, "reward": 0.1 * step, "async/engine_busy": 0.95, "async/inflight_groups": 6.0}
            f.write(json.dumps({**row, "async/group_latency/p50": 0.4, "async/group_latency/p90": 2.5}) + "\n")
    panels = metric_panels(read_metrics(path))
    assert [t for t, _, _ in panels] == [
        "reward",
        "overlap of generation and training",
        "stream mode: groups in flight",
        "stream mode: group latency",
    ]
    assert [k for k, _ in panels[1][2]] == ["async/engine_busy"]
    assert [k for k, _ in panels[3][2]] == ["async/group_latency/p50", "async/group_latency/p90"]
    assert _png_size(plot_metrics(path, str(tmp_path / "stream.png"))) == (1320, 748)
