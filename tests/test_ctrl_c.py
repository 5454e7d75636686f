"""Ctrl-C (SIGINT) during `trainer.train()` in a user's own script (`python my_train.py`): one line saying where
training stopped and where its last checkpoint is, exit status 130, no traceback, no process left behind
(`grpo_async/interrupt.py`). With the HF backend and with the in-process vLLM engine; `GRPO_ASYNC_DEBUG=1` gives the
traceback back. The exit times are not asserted (they depend on the machine's load): see the README's failure table.
"""

import signal
import sys
import textwrap
import time

import psutil
import pytest
from support.warm_launch import start_script

SCRIPT = textwrap.dedent(
    """
    import sys

    from transformers import TrainerCallback

    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config


    class Logged(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            print(f"LOGGED {state.global_step} excepthook={getattr(sys.excepthook, '__name__', '?')}", flush=True)


    backend, model, out = sys.argv[1:4]
    kw = dict(max_steps=1000, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=32)
    if backend == "vllm":
        kw.update(use_vllm=True, vllm_mode="colocate")  # generation_backend="vllm": the engine in this process
    if len(sys.argv) > 4:
        kw.update(save_strategy="steps", save_steps=int(sys.argv[4]))
    args = tiny_config(out, **kw)
    trainer = GRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(256),
                          callbacks=[Logged()])
    trainer.train()
    print("NOT INTERRUPTED", flush=True)
    """
)


def _interrupt(tmp_path, model, backend, *extra, env=None, after="LOGGED 1 "):
    """Run the script (a warm fork ending as `python script` does, SIGINT at its default), SIGINT it once `after`
    was printed; returns (exit status, seconds to exit, its whole output, what it wrote after the signal, the
    processes it had started then that are still running)."""
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    log = tmp_path / "out.log"
    log.touch()
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    args = [backend, model, tmp_path / "out", *extra]
    p = start_script(str(script), args, log_path=str(log), env=env, sigint_default=True)
    try:
        deadline = time.monotonic() + 300
        while after not in log.read_text(errors="replace"):
            assert p.poll() is None, f"exited {p.returncode} before {after!r}:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"no {after!r} in 300 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.1)
        children = psutil.Process(p.pid).children(recursive=True)
        offset = log.stat().st_size  # written before the signal
        start = time.monotonic()
        p.send_signal(signal.SIGINT)
        rc = p.wait(120)
        elapsed = time.monotonic() - start
    finally:
        p.kill()
    output = log.read_text(errors="replace")
    with open(log, errors="replace") as f:
        f.seek(offset)
        after_signal = f.read()
    time.sleep(0.5)
    left = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    print(f"{backend}: exit {rc} {elapsed:.2f} s after SIGINT; after it:\n{after_signal}", file=sys.stderr)
    return rc, elapsed, output, after_signal, left


def _check_one_line(rc, output, after_signal, left):
    assert rc == 130, (rc, output[-4000:])
    lines = after_signal.strip().splitlines()
    assert len(lines) < 10, after_signal
    (line,) = [x for x in lines if x.startswith("training interrupted at step ")]
    assert "Traceback" not in after_signal and "[rank0]" not in after_signal, after_signal
    assert "NOT INTERRUPTED" not in output
    assert not left, left
    return line


def test_ctrl_c_with_the_hf_backend_prints_one_line_and_exits_130(tiny_model_path, tmp_path):
    rc, _, output, after_signal, left = _interrupt(tmp_path, tiny_model_path, "hf")
    line = _check_one_line(rc, output, after_signal, left)
    assert line.endswith("of 1000; no checkpoint (save_strategy='no')"), line


def test_grpo_async_debug_gives_the_traceback_back(tiny_model_path, tmp_path):
    rc, _, output, after_signal, left = _interrupt(tmp_path, tiny_model_path, "hf", env={"GRPO_ASYNC_DEBUG": "1"})
    assert rc == -signal.SIGINT, (rc, output[-4000:])  # the interpreter's own end for an uncaught KeyboardInterrupt
    assert "Traceback (most recent call last)" in after_signal
    assert "The above exception was the direct cause" in after_signal  # where the interrupt landed, chained
    assert "TrainingInterrupted: training interrupted at step " in after_signal
    assert not left, left


@pytest.mark.vllm
@pytest.mark.slow
def test_ctrl_c_with_the_in_process_vllm_engine_prints_one_line_and_exits_130(tiny_model_path, tmp_path):
    """The case that printed ~98 lines prefixed `[rank0]:` (the one-process torch.distributed group the engine makes
    wraps `sys.excepthook`) and took ~10 s: one line, exit 130, no engine process left."""
    rc, _, output, after_signal, left = _interrupt(tmp_path, tiny_model_path, "vllm")
    _check_one_line(rc, output, after_signal, left)
    # the engine's group no longer prefixes every traceback line with `[rank0]:` (e.g. a reward's error)
    assert "LOGGED 1 excepthook=excepthook" in output, output[-4000:]


# ------------------------------------------------------------------------------------------------ in this process
@pytest.fixture
def own_excepthook(monkeypatch):
    """`sys.excepthook` restored after the test (an interrupted `train()` installs the exit hook)."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.delenv("GRPO_ASYNC_DEBUG", raising=False)


def _ctrl_c_at(step: int):
    """A callback raising `KeyboardInterrupt` at the end of step `step`, before that step's checkpoint: SIGINT
    landing in the training loop."""
    from transformers import TrainerCallback

    class CtrlC(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                raise KeyboardInterrupt

    return CtrlC()


@pytest.mark.parametrize("case", ["plain", "checkpoint", "debug"])
def test_train_raises_training_interrupted_after_shutting_the_pipeline_down(
    tiny_model_path, tmp_path, own_excepthook, monkeypatch, capsys, case
):
    from grpo_async import (
        GRPOTrainer,
        TrainingInterrupted,  # exported
    )
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    if case == "debug":
        monkeypatch.setenv("GRPO_ASYNC_DEBUG", "1")
    save = dict(save_strategy="steps", save_steps=1) if case == "checkpoint" else {}
    hook, out = sys.excepthook, tmp_path / "out"
    args = tiny_config(out, max_steps=10, per_device_train_batch_size=4, gradient_accumulation_steps=1, **save)
    trainer = GRPOTrainer(tiny_model_path, letter_reward, args=args, train_dataset=make_dataset(64))
    trainer.add_callback(_ctrl_c_at(2))
    with pytest.raises(TrainingInterrupted) as e:
        trainer.train()
    assert isinstance(e.value, KeyboardInterrupt)  # a script's `except KeyboardInterrupt` still catches it
    checkpoint = str(out / "checkpoint-1") if case == "checkpoint" else None
    assert (e.value.step, e.value.max_steps, e.value.checkpoint) == (2, 10, checkpoint)
    where = (
        f"last checkpoint: {checkpoint} (resume_from_checkpoint=True resumes from it)"
        if checkpoint
        else "no checkpoint (save_strategy='no')"
    )
    assert str(e.value) == f"training interrupted at step 2 of 10; {where}"
    assert capsys.readouterr().err.strip().splitlines()[-1] == str(e.value)  # the one line, on standard error
    assert trainer.rounds.generator is None and trainer.engine.built is None  # generator thread and backend closed
    if case == "debug":  # the traceback of where the interrupt landed, and the interpreter's own hook
        assert type(e.value.__cause__) is KeyboardInterrupt and sys.excepthook is hook
    else:
        assert e.value.__suppress_context__ and getattr(sys.excepthook, "_grpo_async_exit_hook", False)


def test_the_exit_hook_passes_other_exceptions_on_and_spares_a_repl(monkeypatch):
    from grpo_async import interrupt

    seen = []
    hook = interrupt.exit_hook(lambda *a: seen.append(a[0]))
    hook(ValueError, ValueError("x"), None)
    assert seen == [ValueError]
    exits = []
    monkeypatch.setattr(interrupt, "exit_now", exits.append)
    err = interrupt.TrainingInterrupted("training interrupted at step 1 of 2; no checkpoint", 1, 2, None)
    hook(type(err), err, None)
    assert exits == [130] and seen == [ValueError]  # ended, not printed again
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    hook(type(err), err, None)
    assert exits == [130]  # an interactive session goes on
