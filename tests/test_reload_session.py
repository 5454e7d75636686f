"""Weight reload sessions on a real `grpo-async serve` (issue 22 items 2 and 3, and `/health` telling the truth).

One server (tiny model, engine in its own process, `--reload-idle-timeout 6`) is shared by the module; its last test
kills its engine, so it stays last. Pushes go over shared memory (`ShmTransport`), as a trainer on this machine sends
them; a "trainer" that dies mid-push is a real subprocess SIGKILLed after its first buckets.
"""

import os
import shutil
import tempfile
import time

import pytest
import requests
import torch
from support.warm_launch import start_server

from grpo_async.generation.server_process import TWO_PROCESS_ENV, wait_ready
from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.net import ServerClient, ServerError
from grpo_async.weight_sync.transports import make_transport

KEY = "reload-session-test-key"
IDLE_TIMEOUT_S = 6
OK = {"Authorization": f"Bearer {KEY}"}
SEQS = {"sequences": [{"prompt_ids": [5, 9, 13, 21], "completion_ids": [30, 11, 7, 19, 3]}]}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    args = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "4"]
    args += ["--reload-idle-timeout", str(IDLE_TIMEOUT_S)]
    s = wait_ready(start_server(tiny_model_path, api_key=KEY, extra_args=args, env=TWO_PROCESS_ENV), timeout=300)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def groups(state: dict, upto: str | None = None) -> list:
    """`(module, [(name, tensor)])` per tensor in model order, stopping after `upto` (included) when given."""
    out = []
    for name, t in state.items():
        out.append((name.rsplit(".", 1)[0], [(name, t)]))
        if name == upto:
            break
    return out


def noisy(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def logprobs(server) -> list[float]:
    r = requests.post(server.url + "/ws/logprobs", json=SEQS, headers=OK, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()["logprobs"][0]


def info(server) -> dict:
    r = requests.get(server.url + "/ws/info", headers=OK, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def complete(server, timeout: float = 60.0) -> requests.Response:
    body = {"model": server.args[server.args.index("--model") + 1], "prompt": [7, 8, 9], "max_tokens": 3}
    return requests.post(server.url + "/v1/completions", json=body, headers=OK, timeout=timeout)


def push(server, state: dict, version: int, **kwargs) -> dict:
    tr = make_transport("shm", ServerClient(server.url, api_key=KEY, timeout=120), bucket_mb=0.01)
    try:
        return tr.push(groups(state, **kwargs), version)
    finally:
        tr.close()


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) <= tol


# ---- what "complete" means, and the session clock (no server) ----------------------------------------------------
VLLM_NAMES = [  # vLLM's parameters of a 1-layer Llama: q/k/v and gate/up fused, the LM head tied (listed once)
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
]


class _FusedLlama:
    """What `PushCoverage` reads of a vLLM model: its parameters and packed modules (no mapper: older models)."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def named_parameters(self):
        return [(n, torch.nn.Parameter(torch.zeros(1))) for n in VLLM_NAMES]


HF_NAMES = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
]


def test_push_coverage_names_every_missing_parameter_and_shard():
    from grpo_async.weight_sync.requests import PushCoverage

    cov = PushCoverage(_FusedLlama())
    assert list(cov.needed) == VLLM_NAMES
    assert cov.missing(HF_NAMES) == []
    without_k = [n for n in HF_NAMES if "k_proj" not in n]
    assert cov.missing(without_k) == ["model.layers.0.self_attn.qkv_proj.weight (shard 'k_proj' missing)"]
    only_q = ["model.layers.0.self_attn.q_proj.weight"]  # the single-q_proj push
    missing = cov.missing(only_q)
    assert len(missing) == 6
    assert "model.layers.0.self_attn.qkv_proj.weight (shard 'k_proj', 'v_proj' missing)" in missing


def test_session_tracker_reports_a_stuck_session_from_half_the_timeout():
    from grpo_async.weight_sync.reload_session import SessionTracker

    t = SessionTracker(idle_timeout=10)
    assert t.problem() is None and t.info() is None
    s = t.open()
    s.last -= 4  # idle 4 s of 10: fine
    assert t.problem() is None and not t.expired(s.id)
    s.last -= 2  # idle 6 s: over half, reported
    assert s.id in t.problem() and "after 10 s idle (--reload-idle-timeout)" in t.problem() and not t.expired(s.id)
    t.busy_since = s.last  # a request in the engine: not idle (unless it runs over the timeout)
    assert t.idle() == 0.0 and t.problem() is None
    t.busy_since -= 20
    assert "running in the engine" in t.problem()
    t.busy_since = None
    s.last -= 5  # idle 11 s: dropped by the watchdog
    assert t.expired(s.id) and not t.expired("another")
    t.close()
    assert t.problem() is None


# ---- 3. a partial push of a fused layer is refused, the previous weights stay --------------------------------------
@pytest.mark.vllm
def test_a_push_missing_part_of_a_fused_layer_is_refused_and_the_weights_stay(server, weights):
    base = push(server, weights, 1)["version"]
    before, version = logprobs(server), info(server)["version"]
    assert base == version == 1
    # today's main: 200, version 2, log-probs moved by 0.218 (k and v of layer 0 lost at finalisation)
    with pytest.raises(ServerError) as e:
        push(server, {"model.layers.0.self_attn.q_proj.weight": weights["model.layers.0.self_attn.q_proj.weight"]}, 2)
    assert e.value.status == 409 and "qkv_proj" in str(e.value) and "'k'" in str(e.value), str(e.value)
    assert close(logprobs(server), before, 0.0) and info(server)["version"] == 1
    # a push that stops right after q_proj of layer 0 (the rest of the model missing) is refused the same way
    with pytest.raises(ServerError, match="incomplete"):
        push(server, noisy(weights, 0), 3, upto="model.layers.0.self_attn.q_proj.weight")
    assert close(logprobs(server), before, 0.0) and info(server)["version"] == 1
    moved = noisy(weights, 1)
    assert push(server, moved, 4)["version"] == 4  # a complete push lands, and versions go up
    assert not close(logprobs(server), before, 1e-3)
    assert push(server, weights, 5)["version"] == 5
    assert close(logprobs(server), before) and not info(server)["workers"][0]["reload_open"]


@pytest.mark.vllm
def test_an_aborted_push_loads_nothing(server, weights):
    push(server, weights, 10)
    before = logprobs(server)
    tr = make_transport("shm", ServerClient(server.url, api_key=KEY, timeout=120), bucket_mb=0.01)
    try:
        stream = tr.stream(11)
        for _, bucket in groups(noisy(weights, 2), upto="model.layers.0.self_attn.q_proj.weight"):
            stream.send(bucket)
        assert info(server)["workers"][0]["reload_open"]
        stream.abort()  # what the trainer does on a mid-push error; today's main: log-probs moved by 0.121
    finally:
        tr.close()
    now = info(server)
    assert now["version"] == 10 and not now["workers"][0]["reload_open"] and now["session"] is None
    assert close(logprobs(server), before, 0.0)


@pytest.mark.vllm
def test_a_shm_push_of_n_buckets_is_n_requests_the_last_bucket_riding_on_the_closing_one(server, weights):
    """The closing request (the one generation waits for) carries the last bucket: no request of its own for `end`."""

    class Counting(ServerClient):
        def post(self, path, body, timeout=None):
            if path == "/ws/update":
                sent.append((len(body["buckets"]), body["begin"], body["end"]))
            return super().post(path, body, timeout=timeout)

    moved = noisy(weights, 3)
    push(server, moved, 30)
    expect = logprobs(server)
    push(server, weights, 31)
    for bucket_mb, version in ((0.01, 32), (1000.0, 33)):  # one bucket a tensor; the whole model in one bucket
        sent = []
        tr = make_transport("shm", Counting(server.url, api_key=KEY, timeout=120), bucket_mb=bucket_mb)
        try:
            out = tr.push(groups(moved), version)
        finally:
            tr.close()
        n = out["buckets"]
        assert len(sent) == n and (n > 3 if bucket_mb < 1 else n == 1), (n, sent)  # main before: n + 1 requests
        assert sent[0][1] and sent[-1][2] and all(b == 1 for b, _, _ in sent), sent
        assert [b for _, b, _ in sent[1:]] == [False] * (n - 1) and not any(e for _, _, e in sent[:-1]), sent
        assert info(server)["version"] == version and close(logprobs(server), expect, 0.0)
    assert close(logprobs(server), expect, 0.0)


# ---- 2. a trainer SIGKILLed mid-push: generation goes on, the next trainer pushes ----------------------------------
KILLED_TRAINER = """
import sys, time, torch
from transformers import AutoModelForCausalLM
from grpo_async.net import ServerClient
from grpo_async.weight_sync.transports import make_transport
url, key, model, upto = sys.argv[1:5]
state = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
tr = make_transport("shm", ServerClient(url, api_key=key), bucket_mb=0.01)
stream = tr.stream(99)
for name, t in state.items():
    stream.send([(name, t + 0.5)])
    if name == upto:
        break
print("SENT", stream.session, flush=True)
time.sleep(600)  # SIGKILLed here, mid-push
"""


def start_killed_trainer(server, tiny_model_path) -> str:
    """Run a trainer-like process (forked from the warm interpreter: `test_faults.Proc`) that sends the first buckets
    of a push, SIGKILL it; return its session id."""
    from test_faults import Proc  # tests/ is on sys.path

    upto = "model.layers.0.mlp.gate_proj.weight"
    folder = tempfile.mkdtemp(prefix="grpo_killed_trainer_")
    script = os.path.join(folder, "trainer.py")
    with open(script, "w") as f:
        f.write(KILLED_TRAINER)
    proc = Proc([script, server.url, KEY, str(tiny_model_path), upto])
    try:
        line = proc.wait_for("SENT", timeout=120)
    finally:
        proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
    return line.split()[1]


@pytest.mark.vllm
def test_a_trainer_killed_mid_push_neither_stalls_generation_nor_blocks_the_next_trainer(
    server, weights, tiny_model_path
):
    push(server, weights, 20)
    before = logprobs(server)
    stale = start_killed_trainer(server, tiny_model_path)
    now = info(server)
    assert now["workers"][0]["reload_open"] and now["session"]["id"] == stale, now
    # generation goes on while the dead trainer's session is open (today's main: paused until `end`, never sent)
    r = complete(server, timeout=30)
    assert r.status_code == 200, r.text[:300]
    # the next trainer's first push replaces the stale session (today's main: HTTP 500 "already open")
    assert push(server, weights, 21)["version"] == 21
    assert close(logprobs(server), before)  # nothing of the killed trainer's +0.5 half-push landed
    # a late request of the dead session is refused, never mixed into another push
    body = {"transport": "shm", "buckets": [], "segments": [], "begin": False, "end": True, "session": stale}
    r = requests.post(server.url + "/ws/update", json=body, headers=OK, timeout=30)
    assert r.status_code == 409 and "not open" in r.text, r.text[:300]
    assert info(server)["version"] == 21


@pytest.mark.vllm
def test_a_stuck_session_is_reported_by_health_then_dropped(server, weights, tiny_model_path):
    push(server, weights, 30)
    before = logprobs(server)
    stale = start_killed_trainer(server, tiny_model_path)
    seen = []  # /health answers in order: 200 while fresh, 503 naming the session once idle, 200 after the drop
    backend_urls = None
    deadline = time.monotonic() + 20 * IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        r = requests.get(server.url + "/health", headers=OK, timeout=30)
        code = r.status_code
        if not seen or seen[-1][0] != code:
            seen.append((code, r.text))
        if code == 503:
            assert complete(server, timeout=30).status_code == 200  # stuck, but generation still works
            if backend_urls is None:  # a trainer starting now keeps the server: its first push drops the session
                backend = VLLMServerBackend([server.url], api_key=KEY, transport="shm")
                backend_urls = backend.live_urls
                backend.close()
        if code == 200 and len(seen) >= 2:
            break
        time.sleep(0.2)
    codes = [c for c, _ in seen]
    assert 503 in codes and codes[-1] == 200, seen
    assert backend_urls == [server.url]
    reason = dict(seen)[503]
    assert stale in reason and "no request" in reason and "--reload-idle-timeout" in reason, reason
    now = info(server)
    assert now["session"] is None and not now["workers"][0]["reload_open"] and now["version"] == 30
    assert close(logprobs(server), before)
    assert push(server, weights, 31)["version"] == 31


# ---- /health: a dead engine is a 503 with its reason (LAST: kills the module's engine) ----------------------------
@pytest.mark.vllm
def test_health_names_a_dead_engine(server):
    import psutil

    assert requests.get(server.url + "/health", headers=OK, timeout=30).status_code == 200
    engines = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if "EngineCore" in p.name()]
    assert engines, [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
    for p in engines:
        p.kill()
    answers = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.alive:  # vLLM shuts the API process down a few seconds later
        try:
            r = requests.get(server.url + "/health", headers=OK, timeout=10)
        except requests.RequestException:
            break
        answers.append((r.status_code, r.text))
        if r.status_code != 200:
            break
        time.sleep(0.1)
    assert answers and answers[-1][0] == 503, answers[-3:]
    assert "engine is dead" in answers[-1][1], answers[-1]
