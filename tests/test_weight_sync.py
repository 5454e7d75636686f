"""Weight sync into real vLLM: every transport delivers every tensor bit-identically, and afterwards the engine's
greedy output and logprobs are those of the HF model holding the same weights (no stale prefix cache)."""

import json
import pickle

import pytest
import requests
from vllm_utils import API_KEY, PROMPTS, assert_matches_hf, digests, hf_greedy, perturbed_state_dict, running_servers

from grpo_async.net import ServerClient
from grpo_async.testing import push_state_dict
from grpo_async.weight_sync.buckets import group_by_module
from grpo_async.weight_sync.transports import BroadcastTransport, ShmTransport

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def client(tiny_server):  # the session's server: every test here pushes the weights it checks
    c = ServerClient(tiny_server.url, api_key=API_KEY, timeout=120)
    yield c
    c.close()


def server_greedy(client, model_path, prompt):
    body = {
        "model": model_path,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }
    choice = client.post("/v1/completions", body)["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def check_engine_matches(client, model_path, hf_model):
    for prompt in PROMPTS:
        ids, lps = server_greedy(client, model_path, prompt)
        assert ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert_matches_hf(hf_model, prompt, ids, lps)


@pytest.mark.parametrize(
    "transport, bucket_mb, seed",
    [("broadcast", 64, 1), ("shm", 64, 2), ("shm", 0.01, 4), ("broadcast", 0.01, 5)],
    ids=["broadcast-bucketed", "shm-bucketed", "shm-tiny-buckets", "broadcast-tiny-buckets"],
)
def test_server_transport_bit_identical_then_engine_matches_hf(client, tiny_model_path, transport, bucket_mb, seed):
    # Prime the prefix cache with the current weights: a missing cache reset after the sync would replay it.
    server_greedy(client, tiny_model_path, PROMPTS[0])
    hf_model, sd = perturbed_state_dict(tiny_model_path, seed)
    cls = {"broadcast": BroadcastTransport, "shm": ShmTransport}[transport]
    tr = cls(client, bucket_mb)
    try:
        out = tr.push(group_by_module(sd), version=seed, digests=True)
    finally:
        tr.close()
    assert out["tensors"] == len(sd)
    assert out["digests"] == digests(sd)  # every tensor arrived bit-identical
    assert client.get("/ws/info")["version"] == seed
    check_engine_matches(client, tiny_model_path, hf_model)


def test_transport_only_mode_leaves_weights_alone(client, tiny_model_path):
    hf_model, sd = perturbed_state_dict(tiny_model_path, 10)
    tr = ShmTransport(client, 64)
    try:
        tr.push(group_by_module(sd), version=10)
        _, other = perturbed_state_dict(tiny_model_path, 11)
        out = tr.push(group_by_module(other), version=11, digests=True, load=False)
    finally:
        tr.close()
    assert out["digests"] == digests(other)
    check_engine_matches(client, tiny_model_path, hf_model)  # still version 10's weights


def test_failed_update_finalizes_and_keeps_serving(client, tiny_model_path):
    hf_model, sd = perturbed_state_dict(tiny_model_path, 20)
    tr = ShmTransport(client, 64)
    try:
        tr.push(group_by_module(sd), version=20)
    finally:
        tr.close()
    layout = {
        "buffers": {"float32": 16},
        "tensors": [{"name": "model.norm.weight", "dtype": "float32", "shape": [4], "offset": 0, "nbytes": 16}],
    }
    body = {"transport": "shm", "buckets": [layout], "segments": [{"float32": "grpo_async_no_such_segment"}]}
    r = requests.post(
        client.url + "/ws/update",
        data=json.dumps(body),
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 500 and "FileNotFoundError" in r.text
    assert client.get("/ws/info")["workers"][0]["reload_open"] is False
    check_engine_matches(client, tiny_model_path, hf_model)  # model finalized back, not left on meta


def test_update_request_validation_and_pickle_refused(client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    bad_layout = {"transport": "broadcast", "buckets": [{"buffers": {"complex64": 8}, "tensors": []}]}
    r = requests.post(client.url + "/ws/update", json=bad_layout, headers=headers, timeout=30)
    assert r.status_code == 400 and "complex64" in r.text
    r = requests.post(
        client.url + "/ws/update", json={"transport": "carrier-pigeon", "buckets": []}, headers=headers, timeout=30
    )
    assert r.status_code == 400 and "transport" in r.text
    payload = pickle.dumps({"transport": "shm", "buckets": []})
    for ctype in ("application/octet-stream", "application/json"):
        r = requests.post(
            client.url + "/ws/update", data=payload, timeout=30, headers={**headers, "Content-Type": ctype}
        )
        assert r.status_code == 415 and "pickle" in r.text.lower()
    assert requests.get(client.url + "/health", headers=headers, timeout=10).status_code == 200


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["cuda_ipc", "broadcast"])
def test_publisher_streams_a_cuda_model_into_a_server(tiny_model_path, transport):  # pragma: no cover - needs a GPU
    """What users run on a GPU: the trainer's publish path (`PolicyPublisher` → `iter_full_params` of the live CUDA
    model → bucket → CUDA IPC handles or an NCCL broadcast); the engine then matches HF holding the same weights."""
    pytest.importorskip("vllm", reason="the server end needs vLLM built for CUDA")
    from grpo_async.generation.shared import SharedBackend
    from grpo_async.generation.vllm_server import VLLMServerBackend
    from grpo_async.pipeline.publisher import PolicyPublisher

    with running_servers(tiny_model_path, 1) as (s,):
        hf_model, _ = perturbed_state_dict(tiny_model_path, 30)
        backend = VLLMServerBackend([s.url], api_key=API_KEY, transport=transport, bucket_mb=0.05)
        shared = SharedBackend(lambda: backend)
        try:
            PolicyPublisher(shared).publish(hf_model.cuda(), version=30)
            c = ServerClient(s.url, api_key=API_KEY)
            assert c.get("/ws/info")["version"] == 30
            check_engine_matches(c, tiny_model_path, hf_model.cpu())
        finally:
            shared.close()


def test_colocate_transport_bit_identical_then_engine_matches_hf(tiny_model_path):
    from grpo_async.generation.base import SamplingConfig
    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    backend = VLLMColocateBackend(tiny_model_path, max_model_len=256, bucket_mb=0.01)
    try:
        greedy = SamplingConfig(n=1, max_tokens=MAX_TOKENS, temperature=0.0)
        backend.generate(PROMPTS, greedy)  # prime the prefix cache
        hf_model, sd = perturbed_state_dict(tiny_model_path, 40)
        out = backend.transport.push(group_by_module(sd), version=40, digests=True)
        assert out["digests"] == digests(sd)
        for prompt, c in zip(PROMPTS, backend.generate(PROMPTS, greedy)):
            assert c.completion_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)
            assert_matches_hf(hf_model, prompt, c.completion_ids, c.logprobs)
        _, sd2 = perturbed_state_dict(tiny_model_path, 41)
        push_state_dict(backend, sd2, version=41)  # the protocol entry point
        assert backend.version == 41
    finally:
        backend.close()
