"""Ctrl-C during `GRPOTrainer.train()`: one line, exit status 130, no process left behind.

On `KeyboardInterrupt` (SIGINT) `train()` stops the generator thread and shuts the generation backend down (an
in-process vLLM engine, or the children of one in a process of its own), prints one line on the main process, e.g.

```txt
training interrupted at step 5 of 1000; last checkpoint: out/checkpoint-4 (resume_from_checkpoint=True resumes from it)
```

and raises `TrainingInterrupted`, a `KeyboardInterrupt`: a script may catch it as any Ctrl-C. Left uncaught, the
interpreter would print a traceback of the trainer's and torch's frames (prefixed `[rank0]:` when torch.distributed
is initialized) and then spend seconds tearing down the modules of torch, transformers and vLLM before ending by
SIGINT. Instead `exit_hook` (installed as `sys.excepthook` when the interrupt reaches `train()`, wrapping the hook
in place) does what the interpreter does before that teardown, in its order: wait for the non-daemon threads (a
second Ctrl-C stops waiting), run the `atexit` handlers, flush the standard streams; then it ends the process with
exit status 130 (128 + SIGINT, what a shell reports for Ctrl-C). Any other exception goes to the wrapped hook; in an
interactive interpreter (`python -i`, the REPL) the session goes on.

`GRPO_ASYNC_DEBUG=1` in the environment: no hook, the `TrainingInterrupted` chains the original `KeyboardInterrupt`,
and the interpreter prints the full traceback of where the interrupt landed and ends as it would by itself.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

#: exit status of a process ended by Ctrl-C: 128 + SIGINT, as a shell reports it
EXIT_INTERRUPTED = 130


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped `GRPOTrainer.train()`; the pipeline and the generation backend are shut down.

    Attributes:
        step (`int`): optimizer steps done (`state.global_step`).
        max_steps (`int`): the steps the run was to train.
        checkpoint (`str` or `None`): the newest `checkpoint-N` folder in `output_dir`, if any.
    """

    def __init__(self, message: str, step: int, max_steps: int, checkpoint: str | None):
        super().__init__(message)
        self.step, self.max_steps, self.checkpoint = step, max_steps, checkpoint


def debug_enabled() -> bool:
    """`GRPO_ASYNC_DEBUG` set to anything but empty, `0`, `false` or `no`: full tracebacks on Ctrl-C."""
    return os.environ.get("GRPO_ASYNC_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def last_checkpoint(output_dir: str | None) -> str | None:
    """The newest complete `checkpoint-N` folder of `output_dir` (what `resume_from_checkpoint=True` resumes)."""
    from transformers.trainer_utils import get_last_checkpoint

    if not output_dir or not os.path.isdir(output_dir):
        return None
    try:
        return get_last_checkpoint(output_dir)
    except OSError:
        return None


def interrupted(step: int, max_steps: int, output_dir: str | None, save_strategy: str) -> TrainingInterrupted:
    """The exception `train()` raises on Ctrl-C; its message is the one line printed."""
    checkpoint = last_checkpoint(output_dir)
    if checkpoint is not None:
        where = f"last checkpoint: {checkpoint} (resume_from_checkpoint=True resumes from it)"
    elif str(save_strategy) in ("no", "SaveStrategy.NO"):
        where = "no checkpoint (save_strategy='no')"
    else:
        where = f"no checkpoint saved yet in {output_dir}"
    return TrainingInterrupted(
        f"training interrupted at step {step} of {max_steps}; {where}", step, max_steps, checkpoint
    )


def install_exit_hook() -> None:
    """Make an uncaught `TrainingInterrupted` end the process at once with exit status 130 (see the module); once."""
    if not getattr(sys.excepthook, "_grpo_async_exit_hook", False):
        sys.excepthook = exit_hook(sys.excepthook)


def exit_hook(previous):
    """A `sys.excepthook` that ends the process for an uncaught `TrainingInterrupted` (its line is already printed)
    and hands every other exception to `previous`."""

    def hook(exc_type, exc, tb):
        if not (isinstance(exc_type, type) and issubclass(exc_type, TrainingInterrupted)):
            return previous(exc_type, exc, tb)
        if hasattr(sys, "ps1") or sys.flags.interactive:  # a REPL: it goes on
            return None
        exit_now(EXIT_INTERRUPTED)

    hook._grpo_async_exit_hook = True
    return hook


def exit_now(code: int) -> None:
    """End the process with `code` after what the interpreter does before its module teardown: join the non-daemon
    threads (a second Ctrl-C stops waiting), run the `atexit` handlers, flush the standard streams. The teardown
    itself (seconds of freeing torch's, transformers' and vLLM's objects) is skipped."""
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()
    except KeyboardInterrupt:
        pass
    try:
        atexit._run_exitfuncs()
    except KeyboardInterrupt:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001, S110 - a closed or broken stream: nothing to flush
            pass
    os._exit(code)
