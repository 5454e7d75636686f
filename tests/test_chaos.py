"""Kill anything, any time, and end where an uninterrupted run ends (issue 22).

- `test_a_restarted_server_rejoins_the_rotation`: a `grpo-async serve` server SIGKILLed and started again on the
  same port is probed at the next weight push (`VLLMServerBackend.rejoin_interval`), receives that push, and serves
  again on the pushed weights.
- `test_chaos_run_ends_on_the_uninterrupted_weights` (slow): the tiny model trains with `seeded_generation` and
  `num_batches_ahead=1` against two servers, once without interruption and once while, after steps and at moments
  drawn from a seed, the trainer is SIGKILLed (then resumed from its latest checkpoint) or a server is SIGKILLed
  (then started again on its port, and let rejoin the rotation), in turn: 4 kills in 20 steps in `make test` (each
  server once, the trainer twice), 10 in 60 in the soak. The final weights equal the uninterrupted run's to float32
  round-off and `metrics.jsonl` has every step exactly once.

What makes that exact, and where it could not be:

- a trainer killed at any point resumes from the last complete checkpoint (written every step, renamed into place
  when complete); the round generated ahead at that checkpoint is restored as it was generated, from the older
  weights (`pipeline/checkpointing.py`), so it is not regenerated from the checkpoint's weights; metrics logged after
  the checkpoint are dropped from `metrics.jsonl` and logged again;
- a trainer killed in the middle of a weight push leaves a reload session open on the servers: the next trainer's
  push drops it (`begin` replaces a stale session, server side), so nothing of the half push is loaded;
- a server killed mid-round: its requests go to the other server with the same per-request seeds, on the same
  weights: the same tokens. The one thing that is not bit-exact is the float32 arithmetic of a different batch
  composition on a different engine (vLLM's CPU kernels are not batch-invariant): sampler log-probabilities can differ
  by ~1e-7, which reaches the loss only through the importance-sampling ratio (clipped, ~1); hence weights compared
  to float32 round-off (`ATOL`), not bit for bit. A sampled token could in principle flip on a near-tie under such a
  difference; a batch-invariant engine (one request per forward pass, or vLLM's batch-invariant mode on GPU) would
  make even that impossible.
- both servers down at once would end the run ("no vLLM server left in rotation"), by design: a server kill is only
  done while the other server is in rotation; when a server's turn comes while the other is still restarting,
  the trainer is killed instead (the log says so). The test sees the rotation from outside (a restarted server
  holds a pushed version), not the trainer's own view: a server that the trainer dropped for answering slowly looks
  in rotation from here. Hence `vllm_server_timeout=120`: at 30 s a weight push to the surviving server timed out
  once (31 s to finalize while the other server restarted on the same pinned core), it left the rotation, and the
  next server kill ended the run.
"""

import itertools
import json
import os
import random
import signal
import textwrap
import time
from urllib.parse import urlparse

import pytest
import requests
import torch
from support.warm_launch import start_script, start_server
from vllm_utils import API_KEY, PROMPTS, SERVER_ARGS, assert_matches_hf, perturbed_state_dict, running_servers

from grpo_async.generation.base import SamplingConfig
from grpo_async.generation.server_process import (
    TWO_PROCESS_ENV,
    group_shm,
    remove_orphan_shm,
    wait_ready,
)
from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.testing import push_state_dict

pytestmark = pytest.mark.vllm

SEED = 7  # draws the kill moments
# `make test` runs 4 kills in 20 steps, one turn of `TARGETS` (the trainer twice, each server once: every kind of kill
# and the rejoin of either server; 6 kills in 30 steps repeated the turn's first two); the soak of issue 22 is
# `GRPO_CHAOS_KILLS=10 GRPO_CHAOS_STEPS=60 pytest tests/test_chaos.py -k chaos_run` (~8 min)
KILLS = int(os.environ.get("GRPO_CHAOS_KILLS", "4"))
MAX_STEPS = int(os.environ.get("GRPO_CHAOS_STEPS", "20"))
TARGETS = ("trainer", "server 0", "trainer", "server 1")  # the kill targets, in turn
ATOL = 1e-5  # float32 round-off of 60 steps (see the module docstring)
DEADLINE_S = 60 + 36 * KILLS  # the whole chaos run, kills and restarts included (420 s for 10 kills)


def _server_version(url: str) -> int | None:
    """The weights version a server holds (`/ws/info`), None when it has none pushed or does not answer."""
    try:
        r = requests.get(url + "/ws/info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=2)
        return r.json().get("version") if r.status_code == 200 else None
    except (requests.RequestException, ValueError):
        return None


def _restart(server, model: str):
    """Start a server again on the port of `server` (killed); returns the new `ServerProcess` (not waited for)."""
    port = urlparse(server.url).port
    return start_server(model, port=port, api_key=API_KEY, extra_args=SERVER_ARGS, env=TWO_PROCESS_ENV)


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    """Two servers for this file's tests, in a list that a test updates in place when it starts a killed server
    again (the list's servers are stopped at the end). Whatever weights a test leaves, the next one does not start
    from them: the rejoin test pushes its own, and a training run publishes its version 0 before its first round."""
    with running_servers(tiny_model_path, 2) as started:
        yield started


def test_a_restarted_server_rejoins_the_rotation(tiny_model_path, servers):
    model_2, sd_2 = perturbed_state_dict(tiny_model_path, seed=2)
    _, sd_1 = perturbed_state_dict(tiny_model_path, seed=1)
    a, b = servers
    backend = VLLMServerBackend(
        [a.url, b.url], api_key=API_KEY, timeout=30, transport="shm", max_concurrency=4, rejoin_interval=0
    )
    try:
        push_state_dict(backend, sd_1, version=1)
        a.kill()
        sampling = SamplingConfig(max_tokens=4, temperature=1.0, seed=0)
        backend.generate(PROMPTS * 2, sampling)  # a's requests fail over to b, a leaves the rotation
        assert backend.live_urls == [b.url]
        servers[0] = a = wait_ready(_restart(a, tiny_model_path), timeout=300)  # same url, base weights
        assert _server_version(a.url) is None
        push_state_dict(backend, sd_2, version=2)  # a answers /health again: it gets this push, then rejoins
        assert backend.live_urls == [a.url, b.url]
        assert _server_version(a.url) == 2 and _server_version(b.url) == 2
        before = dict(backend.router.served)
        completions = backend.generate(PROMPTS * 4, SamplingConfig(max_tokens=4, temperature=1.0, seed=3))
        assert backend.router.served[a.url] > before[a.url], "the rejoined server was not sent any request"
        for prompt, c in zip(PROMPTS * 4, completions, strict=True):  # every answer on the pushed weights
            assert_matches_hf(model_2, prompt, c.completion_ids, c.logprobs)
    finally:
        backend.close()


TRAIN_SCRIPT = textwrap.dedent(
    """
    import os, sys
    from transformers.trainer_utils import get_last_checkpoint
    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    model, out, urls, key, max_steps = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4], int(sys.argv[5])
    args = GRPOConfig(
        output_dir=out, use_cpu=True, report_to=[], save_metrics_plot=False, per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6, max_steps=max_steps, save_strategy="steps", save_steps=1, save_total_limit=2,
        learning_rate=1e-2, logging_steps=1, disable_tqdm=True, num_batches_ahead=1, seed=0, seeded_generation=True,
        use_vllm=True, vllm_mode="server", vllm_server_urls=urls, vllm_api_key=key, vllm_server_timeout=120,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(128))
    resume = get_last_checkpoint(out) if os.path.isdir(out) else None
    print("resuming from", resume, flush=True)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(out, "final"))
    trainer.end()
    print("done", flush=True)
    """
)


class _Trainer:
    """One trainer process (its own process group, so a SIGKILL takes all of it), forked from the warm interpreter
    (`warm_launch.start_script`: `python train.py ...` with the trainer's imports done, ending as a fresh interpreter
    does); its output in `log_path`."""

    def __init__(self, script: str, model: str, out: str, urls: list[str], log_path: str):
        self.out = out
        self.log_path = log_path
        self.shm_before = frozenset(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else frozenset()
        args = [model, out, ",".join(urls), API_KEY, str(MAX_STEPS)]
        self.proc = start_script(script, args, log_path=log_path, new_session=True)

    def log_tail(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]

    def kill(self) -> None:
        owned = group_shm(self.proc.pid)  # its weight-sync segments: unlinked once it is dead
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        remove_orphan_shm(self.shm_before, owned)


def _logged_steps(out: str) -> list[int]:
    """Optimizer steps with a training log line in `metrics.jsonl`, in file order (a torn last line is skipped)."""
    steps = []
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if "loss" in row:
                    steps.append(int(row["step"]))
    except FileNotFoundError:
        pass
    return steps


def _final_weights(out: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "final", "model.safetensors"))


@pytest.mark.slow
def test_chaos_run_ends_on_the_uninterrupted_weights(tiny_model_path, servers, tmp_path):
    script = str(tmp_path / "train.py")
    with open(script, "w") as f:
        f.write(TRAIN_SCRIPT)
    logs = (str(tmp_path / f"trainer{n}.log") for n in itertools.count())  # one per trainer process
    kill_log: list[str] = []
    for i, s in enumerate(servers):  # the rejoin test may have left one starting again: both must be up
        if not s.alive:
            servers[i] = _restart(s, tiny_model_path)
        wait_ready(servers[i], timeout=300)
    urls = [s.url for s in servers]
    straight = _Trainer(script, tiny_model_path, str(tmp_path / "straight"), urls, next(logs))
    assert straight.proc.wait(timeout=240) == 0, straight.log_tail()

    out = str(tmp_path / "chaos")
    rng = random.Random(SEED)
    # the step after which each kill comes, drawn from the seed, the last one 4 steps before the end: a run that is
    # fast (servers up again in seconds) still takes every kill, and a kill never lands after the run's last step
    kill_steps = sorted(rng.sample(range(2, MAX_STEPS - 3), KILLS))
    start = time.monotonic()
    deadline = start + DEADLINE_S
    trainer = _Trainer(script, tiny_model_path, out, urls, next(logs))
    restarting: dict[int, object] = {}  # server index -> the new process, until it has rejoined

    def note(what: str) -> None:
        steps = _logged_steps(out)
        kill_log.append(f"{time.monotonic() - start:6.1f} s  step {steps[-1] if steps else 0:2d}  {what}")

    def rejoined(i: int) -> bool:
        if i not in restarting:
            return True
        if _server_version(servers[i].url) is not None:  # it received a push: back in rotation
            del restarting[i]
            note(f"server {i} rejoined the rotation")
            return True
        return False

    def kills() -> int:
        return sum("SIGKILL" in k for k in kill_log)

    try:
        while kills() < KILLS:
            assert time.monotonic() < deadline, "chaos run over its time budget:\n" + "\n".join(kill_log)
            at = kill_steps[kills()]
            while max(_logged_steps(out), default=0) < at and trainer.proc.poll() is None:  # it trains (again)
                assert time.monotonic() < deadline, "the trainer made no progress:\n" + "\n".join(kill_log)
                for i in list(restarting):
                    rejoined(i)
                time.sleep(0.2)
            assert trainer.proc.poll() is None, f"the run ended after {len(kill_log)} events:\n" + "\n".join(kill_log)
            time.sleep(rng.uniform(0.0, 0.5))  # a moment of the step drawn from the seed (save, push, next round)
            target = TARGETS[kills() % len(TARGETS)]
            if target.startswith("server"):
                i = int(target[-1])
                if not rejoined(1 - i) or i in restarting:
                    note(f"(drawn: {target}; server {1 - i if i not in restarting else i} not in rotation yet)")
                    target = "trainer"
            if target == "trainer":
                trainer.kill()
                note("SIGKILL trainer; resumed from its latest checkpoint")
                trainer = _Trainer(script, tiny_model_path, out, urls, next(logs))
            else:
                servers[i].kill()
                note(f"SIGKILL server {i} ({servers[i].url}); started again on its port")
                servers[i] = restarting[i] = _restart(servers[i], tiny_model_path)
        code = trainer.proc.wait(timeout=max(10.0, deadline - time.monotonic()))
        assert code == 0, trainer.log_tail()
        for i in list(restarting):  # started, whether or not it rejoined before the end
            wait_ready(servers[i], timeout=max(10.0, deadline - time.monotonic()))
    finally:
        if trainer.proc.poll() is None:
            trainer.kill()
        print(f"kill log (seed {SEED}):\n" + "\n".join(kill_log))

    steps = _logged_steps(out)
    assert sorted(steps) == list(range(1, MAX_STEPS + 1)), f"steps logged: {steps}"  # every step exactly once
    assert _logged_steps(str(tmp_path / "straight")) == list(range(1, MAX_STEPS + 1))
    ref, got = _final_weights(str(tmp_path / "straight")), _final_weights(out)
    worst = max((ref[k] - got[k]).abs().max().item() for k in ref)
    print(f"final weights: max |chaos - uninterrupted| = {worst:.3e} over {len(ref)} tensors (atol {ATOL})")
    assert worst <= ATOL
