"""vLLM generation backends against real engines: in-process LLM, two `grpo-async serve` servers on 127.0.0.1.

Order matters at the end of this module: the last two tests kill the servers (one mid-run, then the other).
"""

import json
import logging
import math
import pickle
import threading
import time

import pytest
import requests
from vllm_utils import (
    API_KEY,
    PROMPTS,
    assert_matches_hf,
    hf_greedy,
    hf_logprobs,
    perturbed_state_dict,
    running_servers,
)

from grpo_async.generation.base import GenerationBackend, SamplingConfig
from grpo_async.generation.openai_remote import OpenAIRemoteBackend
from grpo_async.generation.vllm_colocate import VLLMColocateBackend
from grpo_async.generation.vllm_common import to_completions_body, validate_sampling
from grpo_async.generation.vllm_server import CompletionsRouter, VLLMServerBackend
from grpo_async.net import ServerClient
from grpo_async.testing import push_state_dict

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype="float32").eval()


@pytest.fixture(scope="module")
def servers(tiny_model_path):
    with running_servers(tiny_model_path, 2) as ss:
        yield ss


# ---------------------------------------------------------------------------------------------- pure checks
@pytest.mark.parametrize(
    "field, value",
    [("n", 0), ("max_tokens", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_k", -1), ("min_p", 1.5), ("stop", "x")],
)
def test_sampling_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingConfig.{field}"):
        validate_sampling(SamplingConfig(**{field: value}))


def test_router_picks_least_outstanding_and_refuses_when_empty():
    clients = [ServerClient(f"http://127.0.0.1:{p}") for p in (1, 2, 3)]
    r = CompletionsRouter(clients, "m", 1, "t")
    r.outstanding.update({clients[0].url: 2, clients[1].url: 0, clients[2].url: 1})
    assert r.pick() is clients[1]  # 0 outstanding → now 1; ties go to the first listed
    assert r.pick() is clients[1]  # counts [2, 1, 1] → first of the two at 1
    assert r.outstanding[clients[1].url] == 2
    for c in clients:
        r.mark_dead(c, RuntimeError("gone"))
    with pytest.raises(RuntimeError, match="no vLLM server left"):
        r.pick()
    r.close()


@pytest.mark.parametrize("mode", ["broadcast", "shm", "cuda_ipc", "nccl"])
def test_remote_refuses_ipc_and_broadcast_sync(mode):
    with pytest.raises(ValueError, match="cannot sync weights"):
        OpenAIRemoteBackend("http://127.0.0.1:9", "m", weight_sync=mode)
    with pytest.raises(ValueError, match="checkpoint_dir"):
        OpenAIRemoteBackend("http://127.0.0.1:9", "m", weight_sync="checkpoint_dir")


# ---------------------------------------------------------------------------------------------- colocate
@pytest.fixture(scope="module")
def colocate(tiny_model_path):
    backend = VLLMColocateBackend(tiny_model_path, max_model_len=256)
    yield backend
    backend.close()


def test_colocate_generate_shape_and_processed_logprobs(colocate, hf_model):
    backend = colocate
    if True:
        assert isinstance(backend, GenerationBackend)
        s = SamplingConfig(n=3, max_tokens=6, temperature=0.7, seed=1)
        out = backend.generate(PROMPTS, s)
        assert len(out) == len(PROMPTS) * 3
        for i, c in enumerate(out):
            assert 1 <= len(c.completion_ids) <= 6 and len(c.logprobs) == len(c.completion_ids)
            # temperature applied: logprobs are those of log_softmax(logits / 0.7), not of the raw logits
            assert_matches_hf(hf_model, PROMPTS[i // 3], c.completion_ids, c.logprobs, temperature=0.7)
        # top_k=1 means greedy on every backend: the greedy path, each token with probability 1
        for prompt, c in zip(PROMPTS, backend.generate(PROMPTS, SamplingConfig(max_tokens=6, top_k=1))):
            assert c.completion_ids == hf_greedy(hf_model, prompt, 6)
            assert all(abs(lp) < 1e-5 for lp in c.logprobs)


# ---------------------------------------------------------------------------------------------- servers
def test_api_key_guards_every_endpoint(servers):
    url = servers[0].url
    for method, path in [
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("GET", "/ws/info"),
        ("POST", "/ws/update"),
        ("POST", "/ws/init_broadcast"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.request(method, url + path, json={}, headers=headers, timeout=10)
            assert r.status_code == 401, (method, path, headers, r.status_code)
    ok = {"Authorization": f"Bearer {API_KEY}"}
    assert requests.get(url + "/health", headers=ok, timeout=10).status_code == 200
    for path in ("/collective_rpc", "/pause", "/reset_prefix_cache", "/sleep"):  # vLLM dev routes never exposed
        assert requests.post(url + path, json={}, headers=ok, timeout=10).status_code == 404


def test_weight_endpoint_refuses_pickled_payload(servers):
    url = servers[0].url
    payload = pickle.dumps({"transport": "shm", "buckets": [], "segments": []})
    for ctype in ("application/octet-stream", "application/json", "application/python-pickle"):
        r = requests.post(
            url + "/ws/update",
            data=payload,
            timeout=10,
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": ctype},
        )
        assert r.status_code == 415 and "pickle" in r.text.lower(), (ctype, r.text)


def test_server_backend_generate_matches_hf(servers, hf_model):
    backend = VLLMServerBackend([servers[0].url], api_key=API_KEY, timeout=60)
    try:
        s = SamplingConfig(n=2, max_tokens=6, temperature=0.8, seed=3)
        out = backend.generate(PROMPTS, s)
        assert len(out) == len(PROMPTS) * 2
        for i, c in enumerate(out):
            assert_matches_hf(hf_model, PROMPTS[i // 2], c.completion_ids, c.logprobs, temperature=0.8)
        for prompt, c in zip(PROMPTS, backend.generate(PROMPTS, SamplingConfig(max_tokens=6, top_k=1))):
            assert c.completion_ids == hf_greedy(hf_model, prompt, 6)
            assert all(abs(lp) < 1e-5 for lp in c.logprobs)
        stopped = backend.generate([PROMPTS[0]], SamplingConfig(max_tokens=3, temperature=0.0))
        assert stopped[0].finish_reason in ("length", "stop") and len(stopped[0].completion_ids) <= 3
    finally:
        backend.close()


def test_sampling_params_mean_the_same_on_colocate_and_server(colocate, servers, tiny_model_path):
    from grpo_async.testing import build_tokenizer

    server = VLLMServerBackend([servers[0].url], api_key=API_KEY, timeout=60)
    remote = OpenAIRemoteBackend(servers[0].url, tiny_model_path, api_key=API_KEY)
    try:
        long = colocate.generate([PROMPTS[0]], SamplingConfig(max_tokens=12, temperature=0.0))[0]
        stop = build_tokenizer().decode([long.completion_ids[4]])
        configs = [
            SamplingConfig(max_tokens=12, temperature=0.0, stop=[stop]),
            SamplingConfig(n=2, max_tokens=8, temperature=1.3, top_p=0.8, min_p=0.05, top_k=20, seed=7),
        ]
        for s in configs:
            a = colocate.generate(PROMPTS, s)
            for other in (server, remote):
                b = other.generate(PROMPTS, s)
                assert [c.completion_ids for c in a] == [c.completion_ids for c in b], s
                assert [c.finish_reason for c in a] == [c.finish_reason for c in b], s
                for x, y in zip(a, b):
                    assert max((abs(p - q) for p, q in zip(x.logprobs, y.logprobs)), default=0) < 1e-4
        stopped = colocate.generate([PROMPTS[0]], configs[0])[0]
        assert stopped.finish_reason == "stop" and len(stopped.completion_ids) < 12
    finally:
        server.close()
        remote.close()


def test_openai_remote_backend_generates_and_checkpoint_sync(servers, tiny_model_path, tmp_path):
    remote = OpenAIRemoteBackend(servers[0].url + "/v1", tiny_model_path, api_key=API_KEY)
    try:
        out = remote.generate(PROMPTS[:2], SamplingConfig(n=2, max_tokens=4))
        assert len(out) == 4 and all(len(c.logprobs) == len(c.completion_ids) for c in out)
        with pytest.raises(RuntimeError, match="generation-only"):
            push_state_dict(remote, {}, 1)
    finally:
        remote.close()
    ckpt = OpenAIRemoteBackend(
        servers[0].url, tiny_model_path, api_key=API_KEY, weight_sync="checkpoint_dir", checkpoint_dir=str(tmp_path)
    )
    _, sd = perturbed_state_dict(tiny_model_path, 5)
    push_state_dict(ckpt, sd, 7)
    from safetensors.torch import load_file

    assert (tmp_path / "latest").read_text().strip() == "version-7"
    folder = tmp_path / "version-7"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(sd)
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):  # streamed: one shard per bucket
        loaded.update(load_file(str(folder / shard)))
    assert set(loaded) == set(sd) and all(loaded[k].equal(v) for k, v in sd.items())
    ckpt.close()


def test_two_servers_share_load_and_both_receive_weights(servers, tiny_model_path):
    urls = [s.url for s in servers]
    backend = VLLMServerBackend(urls, api_key=API_KEY, timeout=60, max_concurrency=4)
    try:
        out = backend.generate(PROMPTS * 4, SamplingConfig(n=2, max_tokens=8))
        assert len(out) == 24
        served = backend.router.served
        assert served[urls[0]] > 0 and served[urls[1]] > 0, served
        hf_model, sd = perturbed_state_dict(tiny_model_path, 50)
        push_state_dict(backend, sd, version=50)
        for u in urls:
            c = ServerClient(u, api_key=API_KEY)
            assert c.get("/ws/info")["version"] == 50
            body = {
                "model": tiny_model_path,
                "prompt": PROMPTS[0],
                "max_tokens": 6,
                "temperature": 0.0,
                "return_token_ids": True,
            }
            assert c.post("/v1/completions", body)["choices"][0]["token_ids"] == hf_greedy(hf_model, PROMPTS[0], 6)
    finally:
        backend.close()


def _stream_completion(url: str, body: dict, progress: list, i: int) -> tuple[list[int], list[float]]:
    """One streamed `/v1/completions` request: token ids and logprobs as they arrive; `progress[i]` counts tokens."""
    ids, logprobs = [], []
    with requests.post(
        f"{url}/v1/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        stream=True,
        timeout=120,
    ) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                lp = choice.get("logprobs") or {}
                ids += [int(t.split(":", 1)[1]) for t in lp.get("tokens") or []]
                logprobs += lp.get("token_logprobs") or []
                progress[i] = len(ids)
    return ids, logprobs


def test_inflight_update_lands_while_requests_are_running(servers, tiny_model_path):
    """With in-flight updates the push does not wait for the running requests (vLLM pause mode "keep"): they go on
    decoding on the new weights. Without it (mode "wait") they finish on the old weights before the load.

    No clock is compared. The requests are streamed, so "running" is seen from their tokens arriving, and every
    returned token's logprob is checked against the old weights with HF: requests that finished on the old weights
    match them token for token; in-flight, every request that had not received its last tokens when the push returned
    (more than `left` still to come: the client may lag the server by a few) stops matching. A push that only returned
    once every request was (nearly) done proves nothing either way: the scenario is run again (3 tries; a push that
    waited for the requests, the bug, fails all 3)."""
    url = servers[0].url
    client = ServerClient(url, api_key=API_KEY, timeout=120)
    model = client.get("/v1/models")["data"][0]["id"]
    old_model, old_sd = perturbed_state_dict(tiny_model_path, 59)
    k, max_tokens, left = 16, 240, 40  # k = the server's --max-num-seqs: all decode together
    for inflight, seed in ((True, 60), (False, 61)):
        new_model, new_sd = perturbed_state_dict(tiny_model_path, seed)
        backend = VLLMServerBackend([url], api_key=API_KEY, timeout=120, inflight_updates=inflight)
        try:
            for attempt in range(3):
                version = 100 * seed + 2 * attempt  # increasing over the tries
                results: list = [None] * k
                progress = [0] * k

                def ask(i):
                    body = to_completions_body(model, PROMPTS[i % 3], SamplingConfig(max_tokens=max_tokens, seed=i))
                    body["ignore_eos"] = True  # every request decodes all its tokens
                    results[i] = _stream_completion(url, body, progress, i)  # noqa: B023

                push_state_dict(backend, old_sd, version=version)  # known weights, pushed while the server is idle
                threads = [threading.Thread(target=ask, args=(i,)) for i in range(k)]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 120
                while min(progress) < 2:  # every request is decoding
                    assert time.monotonic() < deadline, f"the requests did not all start decoding: {progress}"
                    time.sleep(0.005)
                push_state_dict(backend, new_sd, version=version + 1)
                running = [i for i, n in enumerate(list(progress)) if n < max_tokens - left]  # when the push returned
                for t in threads:
                    t.join(timeout=120)
                assert all(r is not None and len(r[0]) == max_tokens for r in results), progress
                departed = []  # per request: does some token's logprob leave the old weights' value?
                for i, (ids, logprobs) in enumerate(results):
                    ref = hf_logprobs(old_model, PROMPTS[i % 3], ids)
                    diffs = [abs(a - b) for a, b in zip(ref, logprobs)]
                    assert max(diffs[:2]) < 1e-3, "the first tokens were decoded before the push, on the old weights"
                    departed.append(max(diffs) > 1e-2)
                if inflight and not running:
                    continue  # every request was (nearly) done when the push returned: run the scenario again
                if inflight:  # the new weights took over while those requests were still decoding
                    assert all(departed[i] for i in running), f"in-flight: running {running}, departed {departed}"
                else:  # the push waited: every token of every request came from the old weights
                    assert not any(departed), f"wait mode: running requests saw the new weights: {departed}"
                break
            else:
                pytest.fail("in-flight mode: in 3 tries the push never returned while a request was still decoding")
            assert client.get("/ws/info")["version"] == version + 1
            (c,) = backend.generate(PROMPTS[:1], SamplingConfig(max_tokens=6, top_k=1))
            assert c.completion_ids == hf_greedy(new_model, PROMPTS[0], 6)
        finally:
            backend.close()


def test_killing_one_of_two_servers_mid_run_is_survived(servers, caplog):
    urls = [s.url for s in servers]
    backend = VLLMServerBackend(urls, api_key=API_KEY, timeout=60, max_concurrency=4)
    result = {}

    def run():
        try:
            result["out"] = backend.generate(PROMPTS * 16, SamplingConfig(n=2, max_tokens=48))
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    try:
        with caplog.at_level(logging.WARNING, logger="grpo_async.generation"):
            t = threading.Thread(target=run)
            t.start()
            deadline = time.monotonic() + 60
            while sum(backend.router.served.values()) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert t.is_alive()  # the run is still going when the server dies
            assert backend.router.outstanding[urls[1]] > 0  # ... and has requests in flight on it
            servers[1].kill()
            t.join(timeout=180)
            assert not t.is_alive()
        assert "error" not in result, result.get("error")
        assert len(result["out"]) == len(PROMPTS) * 16 * 2
        assert backend.live_urls == [urls[0]]
        assert any(urls[1] in r.getMessage() and "out of rotation" in r.getMessage() for r in caplog.records)
    finally:
        backend.close()


def test_killing_the_only_server_gives_clear_error_within_timeout(servers):
    timeout = 5.0
    backend = VLLMServerBackend([servers[0].url], api_key=API_KEY, timeout=timeout)
    try:
        servers[0].kill()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="no vLLM server left"):
            backend.generate(PROMPTS, SamplingConfig(max_tokens=4))
        assert time.monotonic() - t0 < 3 * timeout
        with pytest.raises(RuntimeError, match="no vLLM server left in rotation while pushing weights version 99"):
            push_state_dict(backend, {"model.norm.weight": __import__("torch").ones(64)}, 99)
    finally:
        backend.close()
    assert math.isfinite(timeout)
