"""A run that finished exits 0, always (issue 21, items 1 and 2).

Each test runs real training (the tiny model, this file as the script: `python test_clean_exit.py MODE SPEC`) in a
subprocess and asserts the exit code is 0, stderr holds no `Aborted` / `terminate called` / traceback, and the
pipeline generated exactly the rounds the trainer trained (the reward's own call count, and the rounds the generator
started and interrupted, from the line it logs when it stops): no round past `max_steps` is generated and thrown
away.

The slow part is a reward that runs torch work for `slow_seconds` on the rounds chosen by `slow_from` (1-based
reward call number): rounds past the last step (the case of the issue: the interpreter exited under a torch thread
still scoring a round nobody would train) or the last trained round itself.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from mp_utils import ACCELERATE_2CPU  # noqa: E402
from support import json_records
from support.warm_launch import run_script

HERE = os.path.dirname(os.path.abspath(__file__))
BAD_SIGNS = ("Aborted", "terminate called", "Traceback", "still running after")


def _run(mode: str, model: str, out, timeout: float = 240, allow=(), **spec) -> tuple[dict, str]:
    """Run this file as a training script; returns the `RESULT {...}` line it printed and its stderr.

    The process is forked from the warm interpreter (`warm_launch.run_script`: the trainer's imports, ~8 CPU-s, are
    already done) and ends through the interpreter's whole finalization (`real_exit`: `Py_Exit`, as a fresh `python
    test_clean_exit.py` ends), so an abort at exit shows here as it would there (`tests/test_warm_launch.py`)."""
    env = {"PYTHONUNBUFFERED": "1"}
    for k, v in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1")):
        env[k] = os.environ.get(k, v)
    spec = {"model": str(model), "output_dir": str(out), **spec}
    args = [mode, json.dumps(spec)]
    p = run_script(os.path.abspath(__file__), args, env=env, timeout=timeout, real_exit=True, stderr_apart=True)
    tail = f"\n--- stdout ---\n{p.stdout[-3000:]}\n--- stderr ---\n{p.stderr[-6000:]}"
    assert p.returncode == 0, f"exit code {p.returncode}{tail}"
    for sign in BAD_SIGNS:
        assert sign in allow or sign not in p.stderr, f"{sign!r} in stderr{tail}"
    results = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"no RESULT line{tail}"
    return json.loads(results[-1][len("RESULT ") :]), p.stderr


def test_lora_generation_bound_run_exits_0_and_generates_no_round_past_max_steps(tiny_model_path, tmp_path):
    """Issue 21.1: LoRA, hf backend, one round ahead, rounds after the last step slow (20 s of torch work, twice
    the stop timeout): before the fix round 3 was generated and the process died with `Aborted` (134)."""
    start = time.perf_counter()
    result, _ = _run("train", tiny_model_path, tmp_path / "a", lora=True, max_steps=2, slow_from=3, slow_seconds=20)
    assert result["global_step"] == 2
    assert result["reward_calls"] == 2, result  # one round per optimizer step here: rounds 0 and 1, nothing ahead
    assert result["rounds_started"] == [0, 1], result
    assert result["threads"] == [], result  # no generator thread left behind
    assert time.perf_counter() - start < 200  # never waited out a slow round (generous: the machine is shared)


@pytest.mark.slow
@pytest.mark.parametrize(
    "geometry",
    [
        {"num_batches_ahead": 2},  # k = 2: two rounds would run past the end
        {"num_batches_ahead": 1, "num_iterations": 2, "max_steps": 4},  # μ = 2: a round is 2 optimizer steps
        {"num_batches_ahead": 1, "steps_per_generation": 4, "max_steps": 3},  # round of 2 steps, the last one half
    ],
    ids=["ahead2", "mu2", "half_round"],
)
def test_slow_last_round_exits_0_and_nothing_past_it(tiny_model_path, tmp_path, geometry):
    """Issue 21.1: the last trained round is slow (3 s), every round after it would be slower (20 s); the run
    waits for the last one, generates nothing after it and exits 0."""
    kw = {"max_steps": 2, **geometry}
    spg = kw.get("steps_per_generation", 2)  # GA is 2 in tiny_config; steps_per_generation defaults to it
    steps_per_round = spg * kw.get("num_iterations", 1) / 2
    rounds = -(-kw["max_steps"] // steps_per_round)  # rounds the trainer trains (the last one maybe in part)
    rounds = int(rounds)
    result, _ = _run("train", tiny_model_path, tmp_path / "b", slow_last=rounds, slow_seconds=3, **kw)
    assert result["global_step"] == kw["max_steps"]
    assert result["reward_calls"] == rounds, result
    assert result["rounds_started"] == list(range(rounds)), result


@pytest.mark.slow
def test_a_round_in_progress_at_shutdown_is_aborted_not_abandoned(tiny_model_path, tmp_path):
    """A callback stops training after step 1 of 4 while round 1 (legitimately ahead) is generating on the hf
    backend (8 calls of 160 forced tokens): `stop` aborts it at its next token (stopping criteria), its rewards are
    never computed, the thread exits within its bound, exit 0. A round trains 2 steps (`steps_per_generation=4`,
    GA 2): round 1, submitted when step 1 ends, is generated on the generator thread beside step 2 (a round fetched
    at the very next micro-step would be generated on the trainer's thread when fetched: `inline_waited_round`)."""
    kw = dict(max_steps=4, stop_at_step=1, stop_in_round=1, max_completion_length=160, rollout_micro_batch_size=4)
    kw["steps_per_generation"] = 4
    result, _ = _run("train", tiny_model_path, tmp_path / "e", gen_kwargs={"min_new_tokens": 160}, **kw)
    assert result["global_step"] == 1
    assert result["reward_calls"] == 1, result  # round 1 never scored
    assert result["rounds_started"] == [0, 1], result
    assert result["rounds_interrupted"] == [1], result  # aborted in progress, not finished and thrown away
    assert result["threads"] == [], result


@pytest.mark.slow
@pytest.mark.vllm
def test_a_round_in_progress_on_in_process_vllm_is_aborted(tiny_model_path, tmp_path):
    """As above on the in-process vLLM engine (forced 160-token completions, 8 calls a round): `stop` aborts the
    engine's requests between two steps; round 1 is never scored, exit 0. As above, a round trains 2 steps, so
    round 1 runs on the generator thread beside step 2 (rounds mode steps this engine on the calling thread too)."""
    kw = dict(max_steps=4, stop_at_step=1, stop_in_round=1, max_completion_length=160, rollout_micro_batch_size=4)
    kw.update(backend="vllm", steps_per_generation=4)
    result, _ = _run("train", tiny_model_path, tmp_path / "i", gen_kwargs={"min_tokens": 160}, **kw)
    assert result["global_step"] == 1
    assert result["reward_calls"] == 1, result
    assert result["rounds_started"] == [0, 1], result
    assert result["rounds_interrupted"] == [1], result
    assert result["threads"] == [], result


@pytest.mark.slow
def test_a_thread_stuck_in_a_reward_past_the_stop_timeout_is_joined_before_exit(tiny_model_path, tmp_path):
    """A callback stops training after step 1 while round 1 (legitimately ahead) is in its reward: torch work no
    backend can abort, which goes on until the interpreter begins to exit and 3 s past that. The generator abandons
    the call at once (its shutdown does not wait out a reward), and the reward's thread is joined at interpreter exit
    instead of being left running under it (before: `terminate called without an active exception`, exit 134). A
    round trains 2 steps (`steps_per_generation=4`, GA 2), so round 1 is generated on the generator thread beside
    step 2 (a round fetched at the very next micro-step would run on the trainer's thread: `inline_waited_round`)."""
    kw = dict(max_steps=4, stop_at_step=1, stop_in_reward_call=2, slow_from=2, slow_seconds=3, slow_until_exit=True)
    kw["steps_per_generation"] = 4
    result, stderr = _run("train", tiny_model_path, tmp_path / "h", **kw)
    assert result["global_step"] == 1
    assert result["threads"] == [], result  # the generator did not wait for the reward
    assert len(result["reward_threads"]) == 1, result  # still scoring when train() returned
    assert "at exit for reward-" in stderr  # the exit waited for it (and exited 0: `_run`)


@pytest.mark.slow
def test_resume_generates_no_round_past_the_new_max_steps(tiny_model_path, tmp_path):
    """Resumed from the step-2 checkpoint with max_steps=4 and one round ahead: rounds 2 and 3 only, exit 0."""
    result, _ = _run(
        "train", tiny_model_path, tmp_path / "f", max_steps=2, resume_max_steps=4, slow_from=5, slow_seconds=20
    )
    assert result["global_step"] == 4
    assert result["reward_calls"] == 4, result  # 2 in the first run, 2 after resuming
    assert result["rounds_started"] == [0, 1, 2, 3], result  # 0, 1 before the resume, 2, 3 after: none past step 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_agree_on_the_horizon(tiny_model_path, tmp_path):
    """2 processes (accelerate, gloo): every rank stops submitting at the same round (a mismatch would leave one rank
    waiting in the gather of `_submit`); the main process generated exactly the rounds trained; both exit 0."""
    import subprocess as sp

    spec = {"model": str(tiny_model_path), "output_dir": str(tmp_path / "g"), "max_steps": 2, "slow_from": 3}
    spec.update(num_batches_ahead=2, slow_seconds=20, per_device_train_batch_size=4)
    cmd = list(ACCELERATE_2CPU)
    cmd += [os.path.abspath(__file__), "train", json.dumps(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "PYTHONUNBUFFERED": "1"}
    p = sp.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    tail = f"\n--- stdout ---\n{p.stdout[-3000:]}\n--- stderr ---\n{p.stderr[-6000:]}"
    assert p.returncode == 0, f"exit code {p.returncode}{tail}"
    for sign in BAD_SIGNS:
        assert sign not in p.stderr, f"{sign!r} in stderr{tail}"
    results = json_records(p.stdout, "RESULT")  # the 2 ranks share the pipe: their lines can interleave
    assert sorted(r["rank"] for r in results) == [0, 1], tail
    main = next(r for r in results if r["rank"] == 0)
    assert all(r["global_step"] == 2 for r in results), results
    assert main["rounds_started"] == [0, 1] and main["reward_calls"] == 2, results


@pytest.mark.slow
@pytest.mark.vllm
def test_end_with_in_process_vllm_lora_and_a_second_close(tiny_model_path, tmp_path):
    """Issue 21.2: `trainer.end()` (TRL's script calls it on transformers >= 5.18) after training on the in-process
    vLLM engine, then `close()` again: no `Invalid process group specified` traceback, exit 0."""
    result, _ = _run(
        "end", tiny_model_path, tmp_path / "c", backend="vllm", lora=True, max_steps=2, slow_from=3, slow_seconds=20
    )
    assert result["global_step"] == 2
    assert result["reward_calls"] == 2 and result["rounds_started"] == [0, 1], result
    assert result["backend_after_end"] is None


def test_end_with_hf_backend_then_close_twice(tiny_model_path, tmp_path):
    result, _ = _run("end", tiny_model_path, tmp_path / "d", max_steps=1)
    assert result["global_step"] == 1
    assert result["backend_after_end"] is None


def test_server_backend_abort_stops_waiting_for_its_requests_and_closes_twice():
    """The HTTP backends' `abort()` (what `stop` calls at shutdown): a `generate` waiting on a server that has not
    answered (a real HTTP server on 127.0.0.1 that holds the request) raises `GenerationAborted` instead of waiting
    out the request timeout; `close()` twice is safe."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from grpo_async.generation.base import GenerationAborted, SamplingConfig
    from grpo_async.generation.openai_remote import OpenAIRemoteBackend

    release = threading.Event()
    received = threading.Event()

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            received.set()
            release.wait(60)  # a generation that takes long
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    backend = OpenAIRemoteBackend(f"http://127.0.0.1:{server.server_address[1]}", "m", timeout=60)
    outcome = []

    def generate():
        try:
            backend.generate([[1, 2, 3]], SamplingConfig(max_tokens=4))
            outcome.append("returned")
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            outcome.append(e)

    t = threading.Thread(target=generate)
    t.start()
    try:
        assert received.wait(30), "the request never reached the server"
        backend.abort()
        t.join(30)  # bounded; the request itself would wait 60 s
        assert not t.is_alive(), "generate still waiting after abort()"
        assert len(outcome) == 1 and isinstance(outcome[0], GenerationAborted), outcome
        backend.resume()
    finally:
        release.set()
        backend.close()
        backend.close()  # idempotent
        server.shutdown()
        t.join(30)


# ---- the training script ------------------------------------------------------------------------------------------
#: set by the first `atexit` handler of a script that asked for it (`slow_until_exit`): the interpreter is exiting
_EXITING = threading.Event()


def _slow_torch_work(seconds: float, until_exit: bool = False) -> None:
    """What a slow reward model does: torch ops, for `seconds` (`until_exit`: until the interpreter begins to exit,
    at most 120 s, then for `seconds` more)."""
    import torch

    a = torch.randn(256, 256)
    if until_exit:
        deadline = time.monotonic() + 120
        while not _EXITING.is_set() and time.monotonic() < deadline:
            a = torch.tanh(a @ a)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        a = torch.tanh(a @ a)


class GeneratorStops:
    """The rounds the generator started and interrupted, from the line the scheduler logs each time it stops it
    (`generator stopped; rounds started: [...], interrupted: [...]`): what a user reads in the log."""

    def __init__(self):
        import logging

        self.started: list[int] = []
        self.interrupted: list[int] = []
        owner = self

        class Handler(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if message.startswith("generator stopped; rounds started: "):
                    started, interrupted = message.split("rounds started: ", 1)[1].split(", interrupted: ")
                    owner.started += json.loads(started)
                    owner.interrupted += json.loads(interrupted)

        log = logging.getLogger("grpo_async.pipeline.scheduler")
        log.setLevel(logging.INFO)
        log.addHandler(Handler())


def main(mode: str, spec: dict) -> None:
    import threading

    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    calls = []

    def reward(prompts, completions, **kw):
        calls.append(len(completions))
        n = len(calls)
        slow = spec.get("slow_from") is not None and n >= spec["slow_from"]
        if spec.get("slow_last") is not None:
            slow = n >= spec["slow_last"]
            seconds = spec["slow_seconds"] if n == spec["slow_last"] else 20.0
        else:
            seconds = spec.get("slow_seconds", 0)
        if slow:
            _slow_torch_work(seconds, until_exit=spec.get("slow_until_exit", False))
        return letter_reward(prompts, completions, **kw)

    config = {"max_steps": spec.get("max_steps", 2), "num_batches_ahead": spec.get("num_batches_ahead", 1)}
    for key in (
        "num_iterations",
        "steps_per_generation",
        "max_completion_length",
        "rollout_micro_batch_size",
        "per_device_train_batch_size",
    ):
        if key in spec:
            config[key] = spec[key]
    if spec.get("gen_kwargs"):
        config["generation_kwargs"] = spec["gen_kwargs"]
    if spec.get("resume_max_steps"):
        config.update(save_strategy="steps", save_steps=spec["max_steps"])
    if spec.get("backend") == "vllm":
        config["generation_backend"] = "vllm"
    peft_config = None
    if spec.get("lora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == spec.get("stop_at_step"):
                # `stop_in_reward_call`: stop only once that reward call has begun (the round ahead is then in its
                # reward for sure, not still generating; without it the order is a race with the training step)
                deadline = time.monotonic() + 120
                while len(calls) < spec.get("stop_in_reward_call", 0) and time.monotonic() < deadline:
                    time.sleep(0.01)
                # `stop_in_round`: stop only once the generator thread has begun that round (the round ahead is
                # submitted at the end of the first step; the thread picks it up on its own: else a race with the stop)
                if spec.get("stop_in_round") is not None:
                    started = self.trainer.rounds.generator.started  # filled by the thread as it begins each round
                    while spec["stop_in_round"] not in started and time.monotonic() < deadline:
                        time.sleep(0.01)
                control.should_training_stop = True

    def make_trainer(**overrides):
        stop = StopAt()
        stop.trainer = GRPOTrainer(
            model=spec["model"],
            reward_funcs=reward,
            args=tiny_config(spec["output_dir"], **{**config, **overrides}),
            train_dataset=make_dataset(256),
            peft_config=peft_config,
            callbacks=[stop],
        )
        return stop.trainer

    stops = GeneratorStops()
    trainer = make_trainer()
    trainer.train()
    if spec.get("resume_max_steps"):
        trainer.close()
        trainer = make_trainer(max_steps=spec["resume_max_steps"])
        trainer.train(resume_from_checkpoint=True)
    trainer.save_model()
    result = {
        "rank": trainer.accelerator.process_index,
        "global_step": trainer.state.global_step,
        "reward_calls": len(calls),
        "rounds_started": stops.started,  # what the generator logged as it stopped (every train() of this process)
        "rounds_interrupted": stops.interrupted,
        "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("grpo-async-generator")),
        "reward_threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("reward-")),
    }
    if mode == "end":
        trainer.end()
        trainer.close()  # a second close after end(): safe
        result["backend_after_end"] = None if trainer.backend is None else type(trainer.backend).__name__
    print("RESULT " + json.dumps(result), flush=True)
    if spec.get("slow_until_exit"):
        import atexit

        atexit.register(_EXITING.set)  # registered last: the first handler to run at exit


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
