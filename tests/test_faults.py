"""Faults in a training process: SIGINT during generation and during a weight sync, SIGKILL during a checkpoint save.

Each test runs `faults_worker.py` (a real GRPOTrainer on the tiny model) in a subprocess, waits for the marker line
of the moment to hit, injects the fault, and checks what the user is left with: a prompt exit, no process or thread
left behind, and checkpoints that resume.
"""

import contextlib
import os
import queue
import signal
import tempfile
import threading
import time

import psutil
import pytest
from support.warm_launch import start_script

from grpo_async.net import free_port

HERE = os.path.dirname(__file__)


class Proc:
    """`python SCRIPT ARGS` forked from the warm interpreter (`warm_launch.start_script`: the trainer's imports are
    done, the process ends through the interpreter's whole finalization as a fresh one does), SIGINT at its default
    as under a terminal's Ctrl-C whatever this process inherited (a suite started as a background job of a
    non-interactive shell has SIGINT ignored); its output lines (standard error too) read from its log by a thread, so
    waiting for a marker never blocks forever."""

    def __init__(self, args, env=None):
        self.lines: list[str] = []
        self.q: queue.Queue[str] = queue.Queue()
        fd, self.log = tempfile.mkstemp(prefix="faults_", suffix=".log")
        os.close(fd)
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.p = start_script(args[0], args[1:], log_path=self.log, env=env, sigint_default=True)
        self.drained = threading.Event()  # the process ended and every line it wrote is read
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        with open(self.log, errors="replace") as f:
            partial = ""
            while True:
                ended = self.p.poll() is not None  # before reading: what it wrote before it ended is read next
                partial += f.read()
                *lines, partial = partial.split("\n")
                for line in lines:
                    self.lines.append(line + "\n")
                    self.q.put(line + "\n")
                if ended:
                    break
                time.sleep(0.05)
        if partial:
            self.lines.append(partial)
            self.q.put(partial)
        self.drained.set()

    def wait_for(self, marker: str, timeout: float = 240) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.q.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                if self.drained.is_set() and self.q.empty():
                    break
                continue
            if marker in line:
                return line
        raise AssertionError(f"no {marker!r} line; output:\n{self.output[-4000:]}")

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)
        self.drained.wait(5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.log)


def _worker(mode, model, out, *extra):
    return Proc([os.path.join(HERE, "faults_worker.py"), mode, str(model), str(out), *extra])


def _interrupt_and_check(proc: Proc) -> str:
    """SIGINT; the process must exit within 10 s with 130 and leave no child process behind."""
    children = psutil.Process(proc.p.pid).children(recursive=True)
    start = time.monotonic()
    proc.p.send_signal(signal.SIGINT)
    try:
        rc = proc.p.wait(30)
    finally:
        proc.kill()
    elapsed = time.monotonic() - start
    assert rc == 130, (rc, proc.output[-4000:])
    assert elapsed <= 10, f"exit took {elapsed:.1f}s after SIGINT"
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], children
    (line,) = [x for x in proc.lines if x.startswith("INTERRUPTED")]
    return line


def test_sigint_during_generation_exits_promptly_and_stops_the_generator_thread(tiny_model_path, tmp_path):
    proc = _worker("sigint", tiny_model_path, tmp_path / "out")
    try:
        proc.wait_for("GENERATING")
    except BaseException:
        proc.kill()
        raise
    line = _interrupt_and_check(proc)
    assert "grpo-async-generator" not in line, line  # the thread was stopped, not left running
    assert "training interrupted at step " in proc.output  # the one line `train()` prints (grpo_async/interrupt.py)


def test_sigint_during_a_weight_sync_exits_promptly(tiny_model_path, tmp_path):
    port = free_port()
    peer = Proc([os.path.join(HERE, "faults_helpers.py"), "peer", str(port), "stuck_on_update"])
    proc = None
    try:
        peer.wait_for("PEER ready", 60)
        proc = _worker("sigint", tiny_model_path, tmp_path / "out", f"http://127.0.0.1:{port}")
        peer.wait_for("PEER got /ws/update")  # the trainer is broadcasting weights to a server that never receives
        time.sleep(0.5)
        _interrupt_and_check(proc)
    finally:
        if proc is not None:
            proc.kill()
        peer.kill()


def test_kill_during_checkpoint_save_keeps_the_previous_checkpoint_resumable(tiny_model_path, tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    out = tmp_path / "out"
    proc = _worker("checkpoint", tiny_model_path, out)
    try:
        proc.wait_for("SAVING 2")
    finally:
        proc.kill()  # SIGKILL half-way through writing checkpoint-2
    assert sorted(p for p in os.listdir(out) if p.startswith("checkpoint-")) == ["checkpoint-1"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-1")  # the partial checkpoint-2 is invisible
    assert os.path.exists(out / "checkpoint-1" / "grpo_async_state.json")

    resumed = _worker("resume", tiny_model_path, out)
    try:
        assert resumed.wait_for("RESUMED FROM").strip().endswith("checkpoint-1")
        assert resumed.wait_for("DONE").split() == ["DONE", "4"]
        assert resumed.p.wait(60) == 0, resumed.output[-3000:]
    finally:
        resumed.kill()
    # save_total_limit=1: old checkpoints went only after the new one was complete; no staging folder is left
    assert not os.path.exists(out / "_grpo_async_saving")
    assert [p for p in os.listdir(out) if p.startswith("checkpoint-")] == ["checkpoint-4"]


@pytest.mark.parametrize("mode", ["left", "error"])
def test_prompts_longer_than_max_prompt_length(tiny_model_path, tmp_path, mode):
    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_metrics_plot=False,  # the end-of-training plot is not this run's subject (~1.3 CPU-s)
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_prompt_length=5,  # every chat-formatted prompt is longer
        prompt_truncation=mode,
    )
    t = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(16))
    if mode == "error":
        with pytest.raises(RuntimeError, match=r"tokens > max_prompt_length=5"):
            t.train()
        return
    t.train()
    (log,) = [h for h in t.state.log_history if "prompts/truncated" in h]
    assert log["prompts/truncated"] == 2  # 8 rows / G=4 = 2 prompts per round, both cut to their last 5 tokens


# ---------------------------------------------------------------------------------------------- bad input
# More refused configurations; tests/test_config.py has the others (batch/G divisibility, staleness < 0, ...).
@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"rollout_micro_batch_size": 3}, "GRPOConfig.rollout_micro_batch_size"),  # 4-row round in chunks of 3
        ({"ref_logps_micro_batch_size": 0}, "GRPOConfig.ref_logps_micro_batch_size"),
        ({"steps_per_generation": 0}, "GRPOConfig.steps_per_generation"),
        ({"use_vllm": True, "vllm_mode": "remote"}, "GRPOConfig.vllm_mode"),
        ({"min_p": 1.0}, "GRPOConfig.min_p"),
        ({"temperature": -1.0}, "GRPOConfig.temperature"),
        ({"max_prompt_length": 0}, "GRPOConfig.max_prompt_length"),
        ({"weight_sync_bucket_mb": 0}, "GRPOConfig.weight_sync_bucket_mb"),
        ({"reuse_order": "random"}, "GRPOConfig.reuse_order"),
        ({"generation_backend": "openai"}, "GRPOConfig.openai_base_url"),
        ({"importance_sampling_clip_min": -1.0}, "GRPOConfig.importance_sampling_clip_max"),
    ],
)
def test_more_invalid_configs_are_refused_naming_the_field(overrides, message):
    from grpo_async import GRPOConfig

    base = dict(output_dir="/tmp/grpo-async-faults", use_cpu=True, report_to=[], per_device_train_batch_size=4)
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**{**base, "num_generations": 4, **overrides})


@pytest.mark.vllm
@pytest.mark.parametrize("hidden,heads", [(64, 4), (96, 2)])  # head_dim 16 and 48: not served by vLLM on CPU
def test_model_whose_head_size_vllm_cannot_serve_is_refused_at_construction(tiny_model_path, tmp_path, hidden, heads):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    if torch.cuda.is_available():
        pytest.skip("the head-size list checked here is vLLM's CPU attention's")
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.hidden_size, config.num_attention_heads, config.num_key_value_heads = hidden, heads, heads
    config.head_dim = hidden // heads
    model = AutoModelForCausalLM.from_config(config)
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4,
        use_vllm=True, max_completion_length=16,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match=rf"head size is {hidden // heads}.*supports head sizes \[32, 64"):
        GRPOTrainer(model, letter_reward, args=args, train_dataset=make_dataset(8), processing_class=tok)
    # the tiny model's head size (32) is accepted: construction does not start an engine
    GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8))
