"""Delta weight sync (`GRPOConfig.weight_sync_delta`, `grpo_async/weight_sync/delta.py`).

The codec and the checksum alone (no vLLM); then a real `grpo-async serve` (the session's `tiny_server`, float32):
ten training steps of delta pushes leave the engine exactly where one full push of the trainer's weights does; a
push aborted midway (by the trainer, or by a server that fails mid-push) is followed by a full push; a server that
lost its copy (restarted, or whose weights another push replaced) refuses the delta and gets a full push in the same
publish; the backends that cannot take a delta refuse it at config time.

The policy is trained in bfloat16 while the engine runs float32, so the deltas are sparse (most bf16 values do not
move in a step: the situation of a float32 trainer and a bf16 engine, reversed) on the session's float32 server.
"""

import math

import pytest
import torch
from vllm_utils import API_KEY, PROMPTS, perturbed_state_dict

from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.net import ServerClient, ServerError
from grpo_async.testing import push_state_dict
from grpo_async.weight_sync.buckets import group_by_module
from grpo_async.weight_sync.delta import (
    DeltaPush,
    DeltaRefused,
    DeltaShadow,
    checksum,
    encode_tensor,
    is_refusal,
    pack_mask,
    unpack_mask,
    validate_delta_spec,
)
from grpo_async.weight_sync.transports import ShmTransport


# ---------------------------------------------------------------------------------------------- the codec (no vLLM)
def _apply(parts, base: torch.Tensor) -> torch.Tensor:
    shadow = DeltaShadow()
    shadow.tensors, shadow.id = {"w": base.clone()}, "b"
    shadow.begin({"mode": "delta", "base": "b", "id": "n"})
    shadow.take(parts, base.dtype, copy=True)
    return shadow.tensors["w"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "changed, kinds",
    [(0, []), (3, ["w:idx", "w:val"]), (400, ["w:mask", "w:val"]), (4000, ["w"])],
    ids=["unchanged", "sparse", "mask", "full"],
)
def test_codec_round_trip_is_bitwise_and_picks_the_smallest(dtype, changed, kinds):
    gen = torch.Generator().manual_seed(changed)
    base = torch.randn(4001, generator=gen).to(dtype)
    new = base.clone()
    where = torch.randperm(4001, generator=gen)[:changed]
    new[where] = torch.randn(changed, generator=gen).to(dtype) + 10.0
    kept = base.clone()
    parts, k = encode_tensor("w", new, kept)
    assert k == changed and [n for n, _ in parts] == kinds
    assert torch.equal(kept.view(torch.uint8), new.view(torch.uint8))  # the sender's baseline moved to `new`
    sent = sum(t.numel() * t.element_size() for _, t in parts)
    e, n = new.element_size(), new.numel()
    assert sent == min(changed * (4 + e), math.ceil(n / 8) + changed * e, n * e) or not changed
    assert torch.equal(_apply(parts, base).view(torch.uint8), new.view(torch.uint8))


def test_codec_compares_bit_patterns_not_values():
    base = torch.tensor([0.0, float("nan"), 1.0, 2.0] * 8, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0  # equal as a float, not as bits
    new[2] = 1.0
    parts, k = encode_tensor("w", new, base.clone())
    assert k == 1  # a NaN equals itself (same bits), -0.0 differs from +0.0
    assert torch.equal(_apply(parts, base).view(torch.int16), new.view(torch.int16))


def test_mask_packing_round_trip():
    bits = torch.rand(1001, generator=torch.Generator().manual_seed(0)) < 0.3
    packed = pack_mask(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 126
    assert torch.equal(unpack_mask(packed, 1001), bits)
    assert packed[0].item() == sum(1 << i for i in range(8) if bits[i])  # element i in bit i % 8


def test_checksum_follows_values_names_and_not_order():
    a, b = torch.arange(10.0), torch.ones(3, dtype=torch.bfloat16)
    assert checksum({"a": a, "b": b}) == checksum({"b": b, "a": a})
    assert checksum({"a": a, "b": b}) != checksum({"a": b, "b": a})
    moved = a.clone()
    moved[7] = torch.nextafter(moved[7], torch.tensor(100.0))  # one ulp
    assert checksum({"a": moved}) != checksum({"a": a})
    assert checksum({"a": a[1:]}) != checksum({"a": a[:-1]})  # an unaligned view sums its own bytes


def test_shadow_refuses_a_delta_on_other_weights_and_a_wrong_checksum():
    shadow = DeltaShadow()
    with pytest.raises(DeltaRefused, match="holds no copy"):
        shadow.begin({"mode": "delta", "base": "x-1", "id": "x-2"})
    shadow.begin({"mode": "full", "id": "x-1"})
    shadow.take([("w", torch.ones(4))], torch.float32, copy=True)
    shadow.commit(shadow.verify(checksum({"w": torch.ones(4)})))
    with pytest.raises(DeltaRefused, match="'x-1'"):
        shadow.begin({"mode": "delta", "base": "y-1", "id": "y-2"})
    shadow.begin({"mode": "delta", "base": "x-1", "id": "x-2"})
    shadow.take([("w:idx", torch.tensor([0], dtype=torch.int32)), ("w:val", torch.tensor([5.0]))], torch.float32, True)
    with pytest.raises(DeltaRefused, match="checksum"):
        shadow.verify(checksum({"w": torch.ones(4)}))
    shadow.abort()  # the copy was changed in place by the dropped push: it goes
    assert shadow.info() == {"id": None, "checksum": None, "tensors": 0}


def test_delta_request_validation():
    ok = {"transport": "shm", "buckets": []}
    assert validate_delta_spec({"mode": "delta", "base": "a", "id": "b"}, ok)
    for spec, why in [
        ({"mode": "delta", "id": "b"}, "base"),
        ({"mode": "full", "base": "a", "id": "b"}, "base"),
        ({"mode": "both", "id": "b"}, "mode"),
        ({"mode": "full", "id": ""}, "id"),
        ({"mode": "full", "id": "b", "extra": 1}, "keys"),
    ]:
        with pytest.raises(ValueError, match=why):
            validate_delta_spec(spec, ok)
    with pytest.raises(ValueError, match="load"):
        validate_delta_spec({"mode": "full", "id": "b"}, {**ok, "load": False})


def test_refusal_is_told_from_other_errors():
    assert is_refusal(ServerError("... HTTP 409: DeltaRefused: a delta on weights 'x'", 409))
    assert not is_refusal(ServerError("... HTTP 409: IncompletePushError: ...", 409))
    assert not is_refusal(ServerError("... HTTP 500: DeltaRefused", 500))


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "backend, why",
    [
        ({}, "'hf'.*by reference"),
        ({"use_vllm": True, "vllm_mode": "colocate"}, "'vllm'.*by reference"),
        ({"generation_backend": "openai", "openai_base_url": "http://x:1"}, "'openai'.*takes no delta"),
        (
            {"generation_backend": "vllm_server", "vllm_server_urls": ["http://s:1"], "weight_sync_transport": "none"},
            "sends no weights",
        ),
    ],
    ids=["hf", "vllm", "openai", "server-without-sync"],
)
def test_config_refuses_delta_where_nothing_takes_it(backend, why):
    from grpo_async import GRPOConfig

    kw = dict(output_dir="/tmp/grpo-async-delta", use_cpu=True, report_to=[], per_device_train_batch_size=4)
    with pytest.raises(ValueError, match=f"GRPOConfig.weight_sync_delta: .*{why}"):
        GRPOConfig(**kw, num_generations=2, weight_sync_delta=True, **backend)
    server = {"generation_backend": "vllm_server", "vllm_server_urls": ["http://s:1"]}
    assert GRPOConfig(**kw, num_generations=2, weight_sync_delta=True, **server).weight_sync_delta_full_every == 50


def test_stock_server_backend_refuses_delta_before_connecting():
    from grpo_async.generation.stock_server import StockVLLMServerBackend

    with pytest.raises(ValueError, match="weight_sync_delta: StockVLLMServerBackend .*stock vLLM"):
        StockVLLMServerBackend(["http://127.0.0.1:9"], transport="shm", delta=True)


# ---------------------------------------------------------------------------------------------- a real server
@pytest.fixture
def pushes(monkeypatch):
    """Every delta push's statistics (`DeltaSync.last`), in order."""
    seen = []
    finish = DeltaPush.finish

    def recording(self):
        seen.append(finish(self))
        return seen[-1]

    monkeypatch.setattr(DeltaPush, "finish", recording)
    return seen


@pytest.fixture(scope="module")
def client(tiny_server):
    c = ServerClient(tiny_server.url, api_key=API_KEY, timeout=120)
    yield c
    c.close()


def greedy_logprobs(client, model_path):
    out = []
    for prompt in PROMPTS:
        body = {"model": model_path, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 0}
        choice = client.post("/v1/completions", {**body, "return_token_ids": True})["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def assert_engine_holds(client, model_path, state_dict):
    """The server's copy is `state_dict` in the engine's dtype (float32), and its engine answers exactly as after a
    full push of `state_dict` without delta (greedy tokens and log-probs bitwise)."""
    copy = client.get("/ws/info")["workers"][0]["delta"]
    assert copy["checksum"] == checksum({n: t.to(torch.float32) for n, t in state_dict.items()})
    assert copy["tensors"] == len(state_dict)
    after_deltas = greedy_logprobs(client, model_path)
    plain = ShmTransport(client, 64)
    try:
        plain.push(group_by_module(state_dict), version=999)
    finally:
        plain.close()
    assert greedy_logprobs(client, model_path) == after_deltas
    assert client.get("/ws/info")["workers"][0]["delta"]["id"] is None  # a push without delta: the copy is gone


def sparse_steps(sd: dict, steps: int, seed: int) -> list[dict]:
    """`steps` successive state dicts, each moving ~1 % of the previous one's elements."""
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        sd = {k: v.clone() for k, v in sd.items()}
        for v in sd.values():
            flat = v.view(-1)
            where = torch.rand(flat.numel(), generator=gen) < 0.01
            flat[where] += 0.01
        out.append(sd)
    return out


def _backend(url, **kw):
    return VLLMServerBackend([url], api_key=API_KEY, timeout=60, transport="shm", bucket_mb=0.05, delta=True, **kw)


def parity_reward(completion_ids, **kwargs) -> list[float]:
    """1 for a completion whose first token id is even: rewards that differ within a group, so every step moves."""
    return [float(ids[0] % 2 == 0) if len(ids) else 0.0 for ids in completion_ids]


@pytest.mark.vllm
def test_ten_training_steps_of_delta_pushes_equal_a_full_push(client, tiny_server, tiny_model_path, tmp_path, pushes):
    from transformers import AutoModelForCausalLM

    from grpo_async import GRPOTrainer
    from grpo_async.demo_task import make_dataset
    from grpo_async.testing import tiny_config
    from grpo_async.weight_sync.collect import collect_state_dict

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    args = tiny_config(
        tmp_path / "out",
        generation_backend="vllm_server",
        vllm_server_urls=[tiny_server.url],
        vllm_api_key=API_KEY,
        weight_sync_delta=True,
        weight_sync_bucket_mb=0.05,  # several buckets, some of them unchanged
        max_steps=10,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=1,
        max_completion_length=4,
        learning_rate=1e-5,  # in bf16: moves the weights below ~2.6e-3 in magnitude, ~10 % of them
    )
    t = GRPOTrainer(model=model, reward_funcs=parity_reward, args=args, train_dataset=make_dataset(64))
    try:
        t.train()
        t.sync_weights()  # the final step's weights
        assert t.backend.transport_name == "shm"
        modes = [next(iter(p["modes"].values())) for p in pushes]
        assert modes[0] == "full" and modes[1:] == ["delta"] * (len(pushes) - 1) and len(pushes) >= 10, modes
        sent = [next(iter(p["bytes"].values())) for p in pushes]
        full = pushes[0]["full_bytes"]
        assert sent[0] == full and all(s < full for s in sent[1:])
        assert any(0 < p["changed"] < p["elements"] for p in pushes[1:])  # sparse: some values moved, most did not
        assert ServerClient(tiny_server.url, api_key=API_KEY).get("/ws/info")["version"] == t.state.global_step
        weights = collect_state_dict(t.accelerator.unwrap_model(t.model))
        assert pushes[-1]["checksum"] == checksum({n: w.float() for n, w in weights.items()})
        assert_engine_holds(client, tiny_model_path, weights)
    finally:
        t.close()


@pytest.mark.vllm
def test_a_push_aborted_midway_is_followed_by_a_full_push(client, tiny_server, tiny_model_path, pushes):
    _, sd = perturbed_state_dict(tiny_model_path, seed=60)
    states = sparse_steps(sd, 4, seed=60)
    backend = _backend(tiny_server.url)
    try:
        push_state_dict(backend, sd, version=1)
        push_state_dict(backend, states[0], version=2)

        def cut_off(groups):  # the trainer gives up after two modules (an error, a Ctrl-C)
            for i, group in enumerate(groups):
                if i == 2:
                    raise RuntimeError("publish interrupted")
                yield group

        with pytest.raises(RuntimeError, match="publish interrupted"):
            backend.load_weights(cut_off(group_by_module(states[1])), version=3)
        push_state_dict(backend, states[2], version=4)
        push_state_dict(backend, states[3], version=5)
        assert [next(iter(p["modes"].values())) for p in pushes] == ["full", "delta", "full", "delta"]
        assert_engine_holds(client, tiny_model_path, states[3])
    finally:
        backend.close()


@pytest.mark.vllm
def test_a_server_failing_mid_push_gets_a_full_push_when_it_rejoins(client, tiny_server, tiny_model_path, pushes):
    _, sd = perturbed_state_dict(tiny_model_path, seed=61)
    states = sparse_steps(sd, 3, seed=61)
    backend = _backend(tiny_server.url, rejoin_interval=0)
    make = backend._new_transport
    failing = {"sends": None}

    def flaky(client_, device):  # its stream fails at the second bucket of the armed push
        tr = make(client_, device)
        stream = tr.stream

        def armed(*a, **kw):
            s = stream(*a, **kw)
            if failing["sends"] is not None:
                send = s.send

                def send_or_fail(bucket):
                    failing["sends"] += 1
                    if failing["sends"] == 2:
                        raise ServerError("injected: the server stopped answering mid-push")
                    send(bucket)

                s.send = send_or_fail
            return s

        tr.stream = armed
        return tr

    backend.sink.make_transport = flaky
    try:
        push_state_dict(backend, sd, version=1)
        push_state_dict(backend, states[0], version=2)
        failing["sends"] = 0
        with pytest.raises(RuntimeError, match="no vLLM server left"):
            push_state_dict(backend, states[1], version=3)
        failing["sends"] = None
        push_state_dict(backend, states[2], version=4)  # answers /health again: this push, whole, then it rejoins
        assert backend.live_urls == [tiny_server.url]
        assert [next(iter(p["modes"].values())) for p in pushes] == ["full", "delta", "delta", "full"]
        assert [p["acked"] for p in pushes] == [[tiny_server.url], [tiny_server.url], [], [tiny_server.url]]
        assert_engine_holds(client, tiny_model_path, states[2])
    finally:
        backend.close()


@pytest.mark.vllm
@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_a_server_that_lost_its_copy_refuses_the_delta_and_gets_a_full_push(
    client, tiny_server, tiny_model_path, pushes, transport
):
    """What a restarted server looks like to the trainer: it answers as before, but holds no copy (here another
    writer's push without delta replaced its weights, which drops the copy, as a restart does)."""
    _, sd = perturbed_state_dict(tiny_model_path, seed=62)
    states = sparse_steps(sd, 3, seed=62)
    backend = _backend(tiny_server.url)
    backend.transport_name = transport
    try:
        push_state_dict(backend, sd, version=1)
        push_state_dict(backend, states[0], version=2)
        other = ShmTransport(client, 64)
        try:
            other.push(group_by_module(states[1]), version=50)  # not a delta push: the server's copy is dropped
        finally:
            other.close()
        assert client.get("/ws/info")["workers"][0]["delta"]["id"] is None
        push_state_dict(backend, states[1], version=3)  # refused at begin, then the trainer's copy, whole
        push_state_dict(backend, states[2], version=4)
        modes = [next(iter(p["modes"].values())) for p in pushes]
        assert modes == ["full", "delta", "full", "delta"] and pushes[2]["retried"] == [tiny_server.url]
        assert client.get("/ws/info")["version"] == 4
        assert_engine_holds(client, tiny_model_path, states[2])
    finally:
        backend.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_a_restarted_server_gets_a_full_push(tiny_model_path, pushes):
    """A server SIGKILLed and started again on its port between two pushes: the trainer sees no error (shared memory
    needs no connection), its delta is refused (the new server holds no copy) and the same publish sends it whole."""
    from urllib.parse import urlparse

    from support.warm_launch import start_server
    from vllm_utils import SERVER_ARGS, running_servers

    from grpo_async.generation.server_process import TWO_PROCESS_ENV, wait_ready

    _, sd = perturbed_state_dict(tiny_model_path, seed=63)
    states = sparse_steps(sd, 2, seed=63)
    with running_servers(tiny_model_path, 1) as started:
        server = started[0]
        backend = _backend(server.url)
        try:
            push_state_dict(backend, sd, version=1)
            push_state_dict(backend, states[0], version=2)
            server.kill()
            port = urlparse(server.url).port
            started[0] = server = start_server(
                tiny_model_path, port=port, api_key=API_KEY, extra_args=SERVER_ARGS, env=TWO_PROCESS_ENV
            )
            wait_ready(server, timeout=300)
            restarted = ServerClient(server.url, api_key=API_KEY, timeout=60)
            assert restarted.get("/ws/info")["workers"][0]["delta"]["id"] is None
            push_state_dict(backend, states[1], version=3)
            assert [next(iter(p["modes"].values())) for p in pushes] == ["full", "delta", "full"]
            assert pushes[2]["retried"] == [server.url] and pushes[2]["acked"] == [server.url]
            assert restarted.get("/ws/info")["version"] == 3
            assert_engine_holds(restarted, tiny_model_path, states[1])
        finally:
            backend.close()
