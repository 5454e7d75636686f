"""Hardening (issue 22): the server refuses what would hurt it, and a killed or starved run fails clearly.

One real `grpo-async serve` (tiny model, engine in its own process; its API process forked from the warm interpreter)
is shared by the server tests of this module; it takes its key from `--api-key-file`. Its last test kills the API
process with SIGKILL, so it stays last. The other tests train the tiny model for a step or two with HF generation (no
server).
"""

import json
import logging
import math
import os
import signal
import socket
import sys
import threading

import psutil
import pytest
import requests
import torch
from support.warm_launch import run_script, start_server_command

from grpo_async.generation.server_process import CPU_ENV, TWO_PROCESS_ENV, wait_ready
from grpo_async.net import free_port
from grpo_async.testing import push_state_dict

KEY = "hardening-test-key"
HEADER_TIMEOUT_S = 3
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4"]
OK = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    """`python -m grpo_async.generation.serve` with `--api-key-file` (its API process forked from the warm interpreter:
    `warm_launch.start_server_command`, the command line, environment and session as here; what the server answers
    and how its engine process outlives it or not are the subjects, not how an interpreter starts)."""
    key_file = tmp_path_factory.mktemp("key") / "api_key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    args = [sys.executable, "-m", "grpo_async.generation.serve", "--model", str(tiny_model_path), "--port", str(port)]
    args += ["--api-key-file", str(key_file), "--header-timeout", str(HEADER_TIMEOUT_S), *SERVER_ARGS]
    env = {**CPU_ENV, **os.environ, **TWO_PROCESS_ENV}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env.pop("VLLM_API_KEY", None)
    s = start_server_command(args, env, port=port, api_key=KEY)
    try:
        wait_ready(s, timeout=300)
        yield s
    finally:
        s.stop()


def _complete(server, timeout: float = 60.0) -> requests.Response:
    body = {"model": server.args[server.args.index("--model") + 1], "prompt": [7, 8, 9], "max_tokens": 3}
    return requests.post(server.url + "/v1/completions", json=body, headers=OK, timeout=timeout)


# ---- 1. the key from a file guards every route; 10. OPTIONS too ----------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("method,path", [("GET", "/ws/info"), ("OPTIONS", "/ws/update"), ("OPTIONS", "/v1/models")])
def test_key_file_guards_every_route_and_method(server, method, path):
    r = requests.request(method, server.url + path, headers={"Origin": "http://evil.example"}, timeout=10)
    assert r.status_code == 401, (method, path, r.status_code, r.headers, r.text[:200])
    assert requests.get(server.url + "/ws/info", headers=OK, timeout=10).status_code == 200


# ---- 4. bodies are capped on every route ---------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions", "/ws/update", "/ws/logprobs", "/no/such/route"])
def test_a_body_over_the_cap_is_413_on_every_route(server, path):
    big = b'{"prompt": "' + b"a" * (9 * 2**20)  # 9 MiB over the default 8 (not even JSON: must not be parsed)
    r = requests.post(server.url + path, data=big, headers={**OK, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "--max-request-mb" in r.json()["error"], (path, r.status_code, r.text[:200])


@pytest.mark.vllm
def test_a_streamed_body_without_length_is_cut_at_the_cap(server):
    def chunks():  # chunked transfer encoding: no Content-Length to refuse up front
        for _ in range(10):
            yield b"a" * 2**20

    r = requests.post(server.url + "/tokenize", data=chunks(), headers=OK, timeout=60)
    assert r.status_code == 413, (r.status_code, r.text[:200])
    small = {"prompt": "abc"}
    assert requests.post(server.url + "/tokenize", json=small, headers=OK, timeout=30).status_code == 200


# ---- 10. a client that never finishes its headers is cut off -------------------------------------------------------
@pytest.mark.vllm
def test_a_client_that_never_finishes_its_headers_is_disconnected(server):
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line: headers never end
        sock.settimeout(HEADER_TIMEOUT_S + 60)  # generous: the server must close well before
        try:
            data = sock.recv(4096)
        except TimeoutError:
            pytest.fail(f"the server kept a connection with unfinished headers open > {HEADER_TIMEOUT_S + 60} s")
    assert data == b"", data
    # a normal client is unaffected, also on a kept-alive connection used again after the deadline
    with requests.Session() as s:
        assert s.get(server.url + "/health", headers=OK, timeout=10).status_code == 200
        assert s.get(server.url + "/health", headers=OK, timeout=10).status_code == 200


# ---- 6. /ws/init_broadcast: bounded values, and no stall of the engine ---------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize(
    "change,message",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": -5}, "timeout_s"),
        ({"timeout_s": 1e9}, "timeout_s"),
        ({"port": 0}, "port"),
        ({"port": 70000}, "port"),
        ({"world_size": 1}, "world_size"),
        ({"host": "no-such-host.invalid"}, "does not resolve"),
        ({"group_name": "x" * 500}, "group_name"),
        ({}, "no TCPStore answers"),  # a free port: nothing listens there
    ],
)
def test_init_broadcast_refuses_bad_values_with_400(server, change, message):
    body = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "timeout_s": 3, **change}
    r = requests.post(server.url + "/ws/init_broadcast", json=body, headers=OK, timeout=60)
    assert r.status_code == 400 and message in r.text, (change, r.status_code, r.text[:300])


@pytest.mark.vllm
@pytest.mark.slow
def test_init_broadcast_to_a_silent_peer_does_not_stall_completions(server):
    """A peer that accepts the connection and never answers (what a dead or wrong store address looks like to the
    engine) must not block generation: the store is probed on the event loop with a deadline, before the engine is
    involved (the engine then joins on a thread). Order of events: the completion is answered while the
    init_broadcast request is still pending; then the init_broadcast is refused with 400."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted, connected = [], threading.Event()

    def accept():
        try:
            while True:
                conn, _ = listener.accept()
                accepted.append(conn)
                connected.set()
        except OSError:
            return

    threading.Thread(target=accept, daemon=True).start()
    # the probe's deadline: long enough for a completion on a loaded machine to be answered inside it (~1 s quiet)
    body = {"host": "127.0.0.1", "port": listener.getsockname()[1], "world_size": 2, "timeout_s": 10}
    answer = {}

    def join():
        try:
            answer["r"] = requests.post(server.url + "/ws/init_broadcast", json=body, headers=OK, timeout=300)
        except requests.RequestException as e:  # today's main: RemoteDisconnected
            answer["r"] = e

    joiner = threading.Thread(target=join)
    joiner.start()
    try:
        assert connected.wait(60), "the server never connected to the store address"
        r = _complete(server, timeout=20)
        assert r.status_code == 200 and joiner.is_alive(), (r.status_code, r.text[:200])
    finally:
        listener.close()
        for c in accepted:
            c.close()
        joiner.join(300)
    r = answer["r"]
    assert isinstance(r, requests.Response), r
    assert r.status_code == 400 and "no TCPStore answers" in r.text, r.text[:300]
    assert _complete(server).status_code == 200


# ---- 10. NaN weights are a server fault (500), not a client error ---------------------------------------------------
@pytest.mark.vllm
def test_logprobs_from_nan_weights_are_a_500_naming_the_weights(server, tiny_model_path):
    from transformers import AutoModelForCausalLM

    from grpo_async.generation.vllm_server import VLLMServerBackend

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    good = {k: v.detach().clone() for k, v in model.state_dict().items()}
    nan = {k: torch.full_like(v, math.nan) for k, v in good.items()}
    backend = VLLMServerBackend([server.url], api_key=KEY)
    body = {"sequences": [{"prompt_ids": [7, 8, 9], "completion_ids": [10, 11]}]}
    try:
        push_state_dict(backend, nan, 1)
        r = requests.post(server.url + "/ws/logprobs", json=body, headers=OK, timeout=60)
        assert r.status_code == 500 and "non-finite" in r.text and "weights" in r.text, (r.status_code, r.text[:300])
    finally:
        push_state_dict(backend, good, 2)
        backend.close()
    r = requests.post(server.url + "/ws/logprobs", json=body, headers=OK, timeout=60)
    assert r.status_code == 200 and all(math.isfinite(x) for x in r.json()["logprobs"][0])


# ---- 4. the engine exits when the API process dies (LAST: kills the module's server) --------------------------------
@pytest.mark.vllm
def test_engine_processes_exit_when_the_api_process_is_killed(server):
    api = psutil.Process(server.proc.pid)
    children = api.children(recursive=True)
    engines = [c for c in children if c.pid != api.pid]
    assert engines, "expected the engine in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1)"
    os.kill(server.proc.pid, signal.SIGKILL)  # the API process only, as the OOM killer does
    server.proc.wait(30)
    gone, alive = psutil.wait_procs(engines, timeout=60)
    assert not alive, f"engine processes outlived their API process by 60 s: {[(p.pid, p.name()) for p in alive]}"


# ---- 8. a torn last metrics line does not block resume --------------------------------------------------------------
def test_a_torn_last_metrics_line_is_dropped_with_a_warning_naming_the_file(tmp_path, caplog):
    from grpo_async.logging_utils import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 0.1 * s}) + "\n" for s in (1, 2, 3)]
    path.write_text("".join(lines) + '{"step": 4, "lo')  # killed while appending step 4
    with caplog.at_level(logging.WARNING):
        assert truncate_metrics(str(path), 2) == 2  # step 3 and the torn line
    assert path.read_text() == "".join(lines[:2])
    assert str(path) in caplog.text and "torn" in caplog.text
    path.write_text(lines[0] + "garbage\n" + lines[1])  # not a torn append: refuse, naming file and line
    with pytest.raises(ValueError, match=rf"{path} line 2"):
        truncate_metrics(str(path), 2)


# ---- 8. disk full while saving names the folder and the errno; the previous checkpoint stays ------------------------
DISK_FULL_SCRIPT = """
import resource, signal, sys
from transformers import TrainerCallback
from grpo_async import GRPOTrainer
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.testing import tiny_config

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us

class FileSizeLimit(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 2:  # before step 2's checkpoint is written
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))

args = tiny_config(sys.argv[2], per_device_train_batch_size=4, max_steps=2, save_strategy="steps", save_steps=1)
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64),
                      callbacks=[FileSizeLimit()])
trainer.train()
"""


@pytest.mark.parametrize("fails_at", ["model.safetensors", "optimizer.pt"])
def test_disk_full_while_saving_names_the_folder_and_errno_and_keeps_the_last_checkpoint(
    tiny_model_path, tmp_path, fails_at
):
    """The weights (safetensors: `SafetensorError ... os error 27`) or the optimizer (torch.save: `RuntimeError:
    [enforce fail at inline_container.cc] unexpected pos`) fail to write: both must name the folder and the errno."""
    out = tmp_path / "run"
    weights = os.path.getsize(os.path.join(tiny_model_path, "model.safetensors"))
    # below the weights file (but above the metrics and state files), or between it and the optimizer's (2x: Adam)
    limit = 64 * 1024 if fails_at == "model.safetensors" else weights + 64 * 1024
    assert weights > 64 * 1024
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL_SCRIPT)
    # a fork of the warm interpreter (its own process: the file-size limit and SIGXFSZ are its own)
    proc = run_script(str(script), [tiny_model_path, out, limit], env=CPU_ENV, timeout=600, stderr_apart=True)
    assert proc.returncode != 0, proc.stdout[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "OSError" in last and "checkpoint-2" in last and "errno 27 EFBIG" in last, proc.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoint-1"))  # intact, and the only checkpoint
    from transformers.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-1")
    assert not (out / "_grpo_async_saving" / "checkpoint-2").exists()  # the partial folder gave its space back


# ---- 5. the API keys are in no saved file ---------------------------------------------------------------------------
def test_api_keys_are_in_no_checkpoint_or_tensorboard_file(tiny_model_path, tmp_path):
    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset
    from grpo_async.testing import tiny_config

    secret, ref_secret = "sk-vllm-0123456789abcdef", "sk-ref-fedcba9876543210"
    args = tiny_config(
        tmp_path / "run",
        per_device_train_batch_size=4,
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to=["tensorboard"],
        vllm_api_key=secret,
        ref_server_api_key=ref_secret,
    )
    trainer = GRPOTrainer(model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32))
    trainer.train()
    assert args.vllm_api_key == secret  # the live config keeps its keys
    saved = torch.load(tmp_path / "run" / "checkpoint-1" / "training_args.bin", weights_only=False)
    assert saved.vllm_api_key == "<VLLM_API_KEY>" and saved.ref_server_api_key == "<REF_SERVER_API_KEY>"
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "run") for f in fs]
    assert any("tfevents" in f for f in files), files
    for f in files:
        data = open(f, "rb").read()
        assert secret.encode() not in data and ref_secret.encode() not in data, f"an API key is in {f}"
    assert secret not in repr(args) and secret not in args.to_json_string()
