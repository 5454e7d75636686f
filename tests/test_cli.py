"""The `grpo-async` console script (grpo_async/cli.py), run as a real process: argparse's conventions for usage
errors (exit 2, usage on stderr) and help (exit 0, plain text)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args):
    cmd = [sys.executable, "-m", "grpo_async.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_no_arguments_prints_usage_to_stderr_and_exits_2():
    proc = _run()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == ""
    assert proc.stderr.startswith("usage: grpo-async ")
    assert "error: the following arguments are required: COMMAND" in proc.stderr


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_is_plain_text_and_exits_0(flag):
    proc = _run(flag)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: grpo-async ")
    assert "```" not in proc.stdout  # no markdown fences
    for command in ("serve", "plot"):
        assert f"\n    {command} " in proc.stdout  # each command listed with its help line
    assert "grpo-async plot OUTPUT_DIR" in proc.stdout


def test_unknown_command_exits_2_naming_the_choices():
    proc = _run("train")
    assert proc.returncode == 2
    assert "invalid choice: 'train'" in proc.stderr and "serve" in proc.stderr and "plot" in proc.stderr


def test_plot_of_a_folder_without_metrics_exits_2(tmp_path):
    proc = _run("plot", str(tmp_path))
    assert proc.returncode == 2
    assert "metrics.jsonl does not exist" in proc.stderr


def test_plot_draws_the_png(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.75}\n')
    proc = _run("plot", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "metrics.png"
    assert proc.stdout.strip() == str(png) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
