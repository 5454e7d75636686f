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


def test_serve_drains_on_sigterm_unless_told_otherwise():
    """vLLM's `--shutdown-timeout` defaults to 0 (its engine is SIGKILLed at once, leaving its shared memory to the
    resource tracker); `grpo-async serve` lets it drain and exit by itself, unless the flag is given."""
    from grpo_async.generation.serve import SHUTDOWN_TIMEOUT_S, _default_shutdown_timeout, make_parser

    for argv, want in (([], SHUTDOWN_TIMEOUT_S), (["--shutdown-timeout", "0"], 0), (["--shutdown-timeout", "3"], 3)):
        args = make_parser().parse_args(["--model", "m", *argv])
        assert args.shutdown_timeout == (0 if not argv else want)  # vLLM's own default first
        _default_shutdown_timeout(args, ["--model", "m", *argv])
        assert args.shutdown_timeout == want, argv


def test_serve_turns_vllms_aot_compile_cache_off_on_cpu_unless_told_otherwise(monkeypatch):
    """vLLM 0.32 cannot load on CPU the AOT artifact it saves (each restart compiled again after a load-failure
    warning); the default leaves the variable alone when it is set, and off CPU."""
    import vllm.platforms

    from grpo_async.generation.vllm_cpu import default_cpu_aot_compile

    environ = {}
    assert default_cpu_aot_compile(environ) and environ == {"VLLM_USE_AOT_COMPILE": "0"}
    environ = {"VLLM_USE_AOT_COMPILE": "1"}
    assert not default_cpu_aot_compile(environ) and environ == {"VLLM_USE_AOT_COMPILE": "1"}
    monkeypatch.setattr(vllm.platforms, "current_platform", type("Gpu", (), {"is_cpu": staticmethod(lambda: False)})())
    environ = {}
    assert not default_cpu_aot_compile(environ) and environ == {}


def test_on_cpu_vllm_inspects_an_uncached_model_class_without_a_subprocess(monkeypatch, tmp_path):
    """The first engine of an architecture on a machine (an empty `~/.cache/vllm/modelinfos`): vLLM's registry runs
    its inspection in a fresh interpreter (21.6 s for Llama on 2 AVX2 cores) unless `inspect_models_in_process` ran;
    then it inspects here and caches the result where vLLM reads it next time. Off CPU nothing changes."""
    import types

    import vllm.platforms
    from vllm.model_executor.models import registry

    from grpo_async.generation.vllm_cpu import inspect_models_in_process

    monkeypatch.setattr(registry, "_run_in_subprocess", registry._run_in_subprocess)  # restored after the test
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir", staticmethod(lambda: tmp_path))

    def no_subprocess(*a, **k):
        raise AssertionError(f"vLLM started a subprocess to inspect the model: {a}")

    monkeypatch.setattr(registry, "subprocess", types.SimpleNamespace(run=no_subprocess))  # the registry's only
    assert inspect_models_in_process()
    model = registry._LazyRegisteredModel("vllm.model_executor.models.llama", "LlamaForCausalLM")
    info = model.inspect_model_cls()
    assert info.architecture == "LlamaForCausalLM" and info.is_text_generation_model
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-model_executor-models-llama-LlamaForCausalLM.json"]
    monkeypatch.setattr(vllm.platforms, "current_platform", type("Gpu", (), {"is_cpu": staticmethod(lambda: False)})())
    inspect = registry._run_in_subprocess
    monkeypatch.setattr(registry, "_run_in_subprocess", "vLLM's")
    assert not inspect_models_in_process() and registry._run_in_subprocess == "vLLM's"
    assert inspect.__module__ == "grpo_async.generation.vllm_cpu"


def _live_group_members(pgid: int) -> list[str]:
    """`pid name` of the processes in group `pgid` that are still running (zombies, already dead, left out)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            members.append(f"{entry} {name}")
    return members


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("target", ["process", "group"])
def test_serve_stops_cleanly_on_sigterm(tiny_model_path, tmp_path, target):
    """SIGTERM to the server process (`kill PID`, systemd) or to its whole process group (a job scheduler, Ctrl-C's
    SIGINT alike): exit 0, engine processes gone, no nanobind leak lists or leaked semaphores on its stderr."""
    import signal
    import time

    from vllm_utils import SERVER_ARGS

    from grpo_async.generation.server_process import launch_server

    log = tmp_path / "serve.log"
    server = launch_server(tiny_model_path, extra_args=SERVER_ARGS, log_path=str(log), ready_timeout=300)
    try:
        if target == "process":
            os.kill(server.proc.pid, signal.SIGTERM)
        else:
            os.killpg(server.proc.pid, signal.SIGTERM)
        rc = server.proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while _live_group_members(server.proc.pid) and time.monotonic() < deadline:  # engine core, worker
            time.sleep(0.2)
        left = _live_group_members(server.proc.pid)
        assert not left, f"processes of the server's group alive 10 s after it exited: {left}\n{server.log_tail()}"
    finally:
        server.stop()
    text = log.read_text(errors="replace")
    shutdown = text[text.find("shutdown triggered") :]
    assert rc == 0, shutdown[-3000:]
    # Open (issue 21 item 8): vLLM's AsyncLLM output handler can still log a traceback when its engine core stops
    # first, and a SIGTERM to the whole group can leave one worker shared-memory segment to the resource tracker
    # (seen in 1 of 2 runs each); those are not asserted until they are fixed.
    for noise in ("nanobind: leaked", "leaked semaphore"):
        assert noise not in text, f"{noise!r} in the server's output after SIGTERM:\n{shutdown[-3000:]}"
