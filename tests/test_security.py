"""Security defaults: loopback bind, the API key on every route, no pickles on weight routes, no remote code.

One `grpo-async serve` (`python -m grpo_async.generation.serve`, its API process forked from the warm interpreter) is
started here WITHOUT `--host` (the defaults are what is under test), its key given only through the `VLLM_API_KEY`
variable (vLLM alone would guard `/v1` with it and leave the weight routes open). The routes and the pickle refusal
on `/ws/update` with `--api-key` are also checked in tests/test_vllm_backends.py, the key from `--api-key-file` in
tests/test_hardening.py; this file covers the rest.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys

import psutil
import pytest
import requests
from support.warm_launch import start_server_command

from grpo_async.generation.server_process import CPU_ENV, TWO_PROCESS_ENV, wait_ready
from grpo_async.net import free_port

KEY = "security-test-key"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    """`python -m grpo_async.generation.serve` without `--host`, the key in `VLLM_API_KEY` only (its API process forked
    from the warm interpreter: `warm_launch.start_server_command`, the command line and environment as here)."""
    port = free_port()
    args = [sys.executable, "-m", "grpo_async.generation.serve", "--model", str(tiny_model_path)]
    args += ["--port", str(port), *SERVER_ARGS]  # no --host: the default is under test
    env = {**CPU_ENV, **os.environ, **TWO_PROCESS_ENV, "VLLM_API_KEY": KEY}  # the key only in the variable
    env.pop("VLLM_SERVER_DEV_MODE", None)
    s = start_server_command(args, env, port=port, api_key=KEY)
    try:
        wait_ready(s, timeout=300)
        yield s
    finally:
        s.stop()


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.mark.vllm
def test_server_listens_on_loopback_only_by_default(server):
    tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
    listening = [
        c.laddr
        for p in tree
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == _port(server)
    ]
    assert listening and all(a.ip == "127.0.0.1" for a in listening), listening


@pytest.mark.vllm
@pytest.mark.parametrize(
    "method,path",
    [
        ("POST", "/ws/close_broadcast"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("GET", "/version"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/no/such/route"),
    ],
)
def test_api_key_guards_the_remaining_routes(server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):  # no "Bearer ": refused too
        r = requests.request(method, server.url + path, json={}, headers=headers, timeout=10)
        assert r.status_code == 401, (method, path, headers, r.status_code)


@pytest.mark.vllm
@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/ws/update", {"transport": "shm", "buckets": [], "segments": []}),
        ("POST", "/ws/logprobs", {"sequences": [{"prompt_ids": [7], "completion_ids": [8]}]}),
        ("POST", "/ws/init_broadcast", {"host": "127.0.0.1", "port": 1, "world_size": 2}),
        ("GET", "/ws/info", None),
        ("POST", "/tokenize", {"prompt": "abc"}),
        ("GET", "/metrics", None),
        ("GET", "/docs", None),
        ("GET", "/health", None),
        ("OPTIONS", "/ws/update", None),
        ("OPTIONS", "/v1/completions", None),
    ],
)
def test_a_key_from_vllm_api_key_guards_the_weight_routes_too(server, method, path, body):
    cors = {"Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"}
    for headers in ({}, {"Authorization": "Bearer wrong"}, cors):
        r = requests.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:200])


def test_the_key_comes_from_the_flag_then_the_file_then_the_variable(tmp_path):
    from grpo_async.generation.serve import make_parser, resolve_api_key

    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    env = {"VLLM_API_KEY": "from-env"}
    parse = make_parser().parse_args
    both = ["--model", "m", "--api-key", "flag", "--api-key-file", str(key_file)]
    assert resolve_api_key(parse(both), env) == "flag"
    assert resolve_api_key(parse(["--model", "m", "--api-key-file", str(key_file)]), env) == "from-file"
    assert resolve_api_key(parse(["--model", "m"]), env) == "from-env"
    assert resolve_api_key(parse(["--model", "m"]), {}) is None
    key_file.write_text("\n")
    with pytest.raises(SystemExit, match=f"{key_file} is empty"):
        resolve_api_key(parse(["--model", "m", "--api-key-file", str(key_file)]), {})
    with pytest.raises(SystemExit, match="cannot read --api-key-file"):
        resolve_api_key(parse(["--model", "m", "--api-key-file", str(tmp_path / "missing")]), {})


@pytest.mark.parametrize("host", ["0.0.0.0"])
def test_a_non_loopback_host_without_a_key_is_refused_before_the_engine_starts(tiny_model_path, host):
    """`grpo-async serve --host 0.0.0.0` without a key exits naming the fix; its API process is a fork of the warm
    interpreter (`start_server_command`: the same module, command line and environment), which the refusal ends."""
    env = {**CPU_ENV, **os.environ, **TWO_PROCESS_ENV}
    env.pop("VLLM_API_KEY", None)
    port = free_port()
    cmd = [sys.executable, "-m", "grpo_async.generation.serve", "--model", str(tiny_model_path), "--host", host]
    cmd += ["--port", str(port), *SERVER_ARGS]
    server = start_server_command(cmd, env, port=port, api_key=None)
    try:
        code = server.proc.wait(timeout=120)  # today's main starts a server open to the network: never returns
    except subprocess.TimeoutExpired:
        pytest.fail(f"grpo-async serve --host {host} without a key started instead of refusing")
    finally:
        server.stop()
    with open(server.log_path, "rb") as f:
        out = f.read()
    assert code != 0 and b"without an API key" in out and b"--api-key-file" in out, out[-2000:]


@pytest.mark.vllm
def test_the_right_key_opens_the_routes(server):
    ok = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(server.url + "/v1/models", headers=ok, timeout=10).status_code == 200
    assert requests.get(server.url + "/version", headers=ok, timeout=10).status_code == 200


class _Exploit:
    """Unpickling this runs a shell command that creates a file: a server that unpickled it would be owned."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.vllm
@pytest.mark.parametrize("path", ["/ws/update", "/ws/init_broadcast", "/ws/close_broadcast"])
@pytest.mark.parametrize("ctype", ["application/octet-stream", "application/json", "application/python-pickle"])
def test_crafted_pickle_is_refused_and_never_unpickled(server, tmp_path, path, ctype):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"transport": "shm", "buckets": [_Exploit(marker)], "segments": []})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": ctype}
    r = requests.post(server.url + path, data=payload, headers=headers, timeout=10)
    assert r.status_code == 415 and "pickle" in r.text.lower(), (path, ctype, r.status_code, r.text)
    assert not marker.exists()
    assert server.alive


@pytest.mark.vllm
def test_trust_remote_code_is_off_by_default_everywhere():
    import inspect

    from vllm import LLM

    from grpo_async import GRPOConfig
    from grpo_async.generation.serve import make_parser

    assert GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to=[]).trust_remote_code is False
    served = make_parser().parse_args(["--model", "m"])
    assert served.trust_remote_code is False and served.host == "127.0.0.1"
    assert inspect.signature(LLM.__init__).parameters["trust_remote_code"].default is False


def test_model_with_custom_code_is_refused_and_its_code_never_runs(tiny_model_path, tmp_path):
    from grpo_async import GRPOConfig, GRPOTrainer
    from grpo_async.demo_task import letter_reward, make_dataset

    folder = tmp_path / "custom"
    shutil.copytree(tiny_model_path, folder)
    marker = tmp_path / "custom_code_ran"
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\nfrom transformers import LlamaConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil_llama", auto_map={"AutoConfig": "evil.LlamaConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=4
    )
    with pytest.raises(ValueError, match="trust_remote_code"):
        GRPOTrainer(model=str(folder), reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8))
    assert not marker.exists()
