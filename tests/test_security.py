"""Security defaults: loopback bind, the API key on every route, no pickles on weight routes, no remote code.

One real `grpo-async serve` is started here WITHOUT `--host` (the defaults are what is under test). The routes and the
pickle refusal on `/ws/update` are also checked in tests/test_vllm_backends.py; this file covers the rest.
"""

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import psutil
import pytest
import requests

from grpo_async.generation.server_process import CPU_ENV, SERVER_ENV, ServerProcess, _shm_names, wait_ready
from grpo_async.weight_sync.transports import free_port

KEY = "security-test-key"
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    port = free_port()
    args = [sys.executable, "-m", "grpo_async.generation.serve", "--model", str(tiny_model_path)]
    args += ["--port", str(port), "--api-key", KEY, *SERVER_ARGS]  # no --host: the default is under test
    env = {**CPU_ENV, **os.environ, **SERVER_ENV}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    fd, log_path = tempfile.mkstemp(prefix="grpo_security_", suffix=".log")
    before = frozenset(_shm_names())
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    s = ServerProcess(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, api_key=KEY, args=args)
    s.shm_before = before
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
