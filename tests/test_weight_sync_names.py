"""One vocabulary for weight-sync transports (`grpo_async.weight_sync.names`): the config, the backend registry, the
server backends and the wire all use its names, and `"none"` means no sync wherever it is given."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from faults_helpers import FakeServer, models_routes, reply_json

from grpo_async import GRPOConfig
from grpo_async.generation import backend_spec, make_backend, registered_backends
from grpo_async.generation.openai_remote import OpenAIRemoteBackend
from grpo_async.generation.stock_server import StockVLLMServerBackend
from grpo_async.generation.vllm_server import VLLMServerBackend
from grpo_async.weight_sync.names import SYNC_SETTINGS, WIRE_TRANSPORTS, server_transport
from grpo_async.weight_sync.requests import validate_update_request
from grpo_async.weight_sync.transports import TRANSPORTS

BASE = dict(
    output_dir="/tmp/grpo-async-names", use_cpu=True, report_to=[], per_device_train_batch_size=4, num_generations=2
)


def test_every_layer_speaks_the_same_names():
    field = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "weight_sync_transport")
    assert typing.get_args(field.type) == SYNC_SETTINGS
    assert all(set(backend_spec(n).weight_sync) <= set(SYNC_SETTINGS) for n in registered_backends())
    assert tuple(TRANSPORTS) == WIRE_TRANSPORTS  # the trainer end of the wire
    for name in WIRE_TRANSPORTS:  # the server end accepts each (transport fields aside)
        extra = {"broadcast": {}, "shm": {"segments": []}, "cuda_ipc": {"handles": []}}[name]
        validate_update_request({"transport": name, "buckets": [], **extra})
    with pytest.raises(ValueError, match="'transport' must be one of"):
        validate_update_request({"transport": "ipc", "buckets": []})  # a config word, not a wire one


@pytest.mark.parametrize(
    "setting, urls, cuda, wire",
    [
        ("auto", ["http://127.0.0.1:8000"], False, "shm"),
        ("auto", ["http://127.0.0.1:8000"], True, "cuda_ipc"),
        ("auto", ["http://127.0.0.1:8000", "http://10.0.0.3:8000"], False, "broadcast"),
        ("ipc", ["http://10.0.0.3:8000"], False, "shm"),
        ("broadcast", ["http://127.0.0.1:8000"], True, "broadcast"),
        ("none", ["http://127.0.0.1:8000"], False, "none"),
    ],
)
def test_server_transport_resolves_config_words_to_wire_words(setting, urls, cuda, wire):
    assert server_transport(setting, urls, cuda=cuda) == wire


def test_server_transport_refuses_what_a_server_cannot_take():
    with pytest.raises(ValueError, match="weight_sync_transport for a server must be one of"):
        server_transport("checkpoint_dir", ["http://127.0.0.1:8000"], cuda=False)


def test_config_refuses_a_wire_word():
    with pytest.raises(ValueError, match="weight_sync_transport"):
        GRPOConfig(**BASE, weight_sync_transport="shm")


@pytest.mark.parametrize("cls", [VLLMServerBackend, StockVLLMServerBackend])
def test_none_builds_a_generation_only_server_backend_that_refuses_weights(cls):
    """'none' is not built as a broadcast: nothing of weight sync is asked of the server, and a push is refused."""
    server = FakeServer(models_routes())
    try:
        backend = cls([server.url], transport="none")
        with pytest.raises(RuntimeError, match="transport='none'.*generates only"):
            backend.load_weights([("lm_head", [("lm_head.weight", torch.zeros(2, 2))])], 1)
        backend.close()
        assert not [h for h in server.hits if "/ws/" in h or "weight" in h], server.hits
    finally:
        server.close()


def test_weight_sync_none_for_vllm_server_reaches_the_backend_as_none():
    server = FakeServer({**models_routes(), "GET /ws/info": lambda _: reply_json({"world_size": 1})})
    try:
        args = GRPOConfig(
            **BASE, generation_backend="vllm_server", vllm_server_urls=[server.url], weight_sync_transport="none"
        )
        backend = make_backend(args, None, None, "tiny")
        assert isinstance(backend, VLLMServerBackend) and backend.transport_name == "none"
        backend.close()
        assert server.hits.count("GET /ws/info") == 1  # the server-kind probe only: no group, no push
    finally:
        server.close()


def test_openai_backend_takes_the_same_none():
    backend = OpenAIRemoteBackend("http://127.0.0.1:9", "m", weight_sync="none")
    with pytest.raises(RuntimeError, match="weight_sync='none'"):
        backend.load_weights([], 1)
    backend.close()
    with pytest.raises(ValueError, match="cannot sync weights"):
        OpenAIRemoteBackend("http://127.0.0.1:9", "m", weight_sync=None)
