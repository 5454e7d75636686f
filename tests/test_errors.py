"""Errors a user can act on: reward values, model loading, length budgets, API keys, `grpo-async serve --help`."""

import asyncio
import socket
import threading

import numpy as np
import pytest
import torch

from grpo_async.loading import check_lengths, load_model, load_tokenizer
from grpo_async.rewards import prepare_reward_funcs, score_completions

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]
IDS = [[1], [2, 2], [3, 3, 3]]


def _score(func):
    funcs, names = prepare_reward_funcs(func)
    return score_completions(funcs, names, PROMPTS, COMPLETIONS, IDS, {})


# ------------------------------------------------------------------------------------------------ reward values
def test_a_string_reward_is_an_error_naming_the_function_and_the_value():
    def stringly(prompts, completions, **kw):
        return [1.0, "1.0", 0.0]

    with pytest.raises(ValueError, match=r"reward function 'stringly' returned '1\.0' at index 1 \(a str\)"):
        _score(stringly)


@pytest.mark.parametrize(
    "output",
    [
        np.array([0.5, 1.0, 0.0]),
        [np.float32(0.5), np.float64(1.0), np.int64(0)],
        torch.tensor([0.5, 1.0, 0.0]),
        [torch.tensor(0.5), torch.tensor(1.0), torch.tensor(0.0)],
    ],
    ids=["numpy-array", "numpy-scalars", "torch-tensor", "0d-tensors"],
)
def test_numpy_and_torch_rewards_are_accepted(output):
    def arr(prompts, completions, **kw):
        return output

    assert _score(arr)[:, 0].tolist() == [0.5, 1.0, 0.0]


def test_a_2d_array_is_still_an_error():
    def two_d(prompts, completions, **kw):
        return np.zeros((3, 2))

    with pytest.raises(ValueError, match="'two_d' returned ndarray for 3 completions"):
        _score(two_d)


# ------------------------------------------------------------------------------------------------ model loading
def test_a_missing_local_folder_says_it_does_not_exist(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"model folder '.*no-such-model' does not exist"):
        load_model(str(missing))
    with pytest.raises(FileNotFoundError, match="tokenizer folder './nope/model' does not exist"):
        load_tokenizer("./nope/model")


def test_an_uncached_hub_id_fails_at_once_when_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"model 'Qwen/Qwen2.5-0.5B-Instrukt' .* we are offline \(HF_HUB_OFFLINE=1\)"):
        load_model("Qwen/Qwen2.5-0.5B-Instrukt")


def test_an_uncached_hub_id_fails_at_once_when_the_hub_is_unreachable(monkeypatch):
    with socket.socket() as s:  # a port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(
        OSError, match=rf"'someone/misspelled-model' .* offline \(http://127.0.0.1:{port} is unreachable"
    ):
        load_tokenizer("someone/misspelled-model")


def test_a_local_model_still_loads(tiny_model_path):
    assert load_model(tiny_model_path).config.model_type == "llama"
    assert load_tokenizer(tiny_model_path).eos_token == "<|end|>"


# ------------------------------------------------------------------------------------------------ length budget
def test_a_budget_beyond_the_model_positions_is_an_error_naming_every_number(tiny_model_path):
    from transformers import AutoConfig

    from grpo_async import GRPOConfig

    model_config = AutoConfig.from_pretrained(tiny_model_path)  # max_position_embeddings=256
    args = GRPOConfig(
        output_dir="/tmp/x", use_cpu=True, report_to=[], max_prompt_length=128, max_completion_length=200
    )
    with pytest.raises(ValueError) as e:
        check_lengths(args, model_config)
    for part in ("max_prompt_length=128", "max_completion_length=200", "max_position_embeddings=256"):
        assert part in str(e.value)
    args = GRPOConfig(output_dir="/tmp/x", use_cpu=True, report_to=[], max_prompt_length=64, max_completion_length=64)
    check_lengths(args, model_config)  # fits: no error


# ------------------------------------------------------------------------------------------------ API key
@pytest.fixture
def guarded_server():
    """A real uvicorn server behind `grpo-async serve`'s GuardMiddleware (key "right"), answering /health."""
    import uvicorn

    from grpo_async.generation.serve import GuardMiddleware

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b""})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(GuardMiddleware(app, ["right"]), port=port, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_a_wrong_api_key_is_reported_as_refused_with_the_url(guarded_server):
    from grpo_async.generation.vllm_server import VLLMServerBackend
    from grpo_async.net import ServerAuthError, ServerClient

    with pytest.raises(ServerAuthError, match=rf"the server at {guarded_server} is running but refused the API key"):
        ServerClient(guarded_server, api_key="wrong").get("/health")
    with pytest.raises(ServerAuthError, match="needs an API key"):
        ServerClient(guarded_server).get("/health")
    with pytest.raises(RuntimeError) as e:
        VLLMServerBackend([guarded_server], api_key="wrong", transport="shm")
    assert f"{guarded_server} refused the API key (HTTP 401)" in str(e.value)
    assert "not answering" not in str(e.value)
    assert ServerClient(guarded_server, api_key="right").get("/health") is None  # the right key passes


# ------------------------------------------------------------------------------------------------ serve --help
def test_serve_help_describes_our_flags_before_vllms(capsys):
    from grpo_async.cli import main

    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    ours, _, engine = out.partition("vLLM engine options:")
    assert engine, "no 'vLLM engine options:' section"
    for flag in ("--frozen", "--api-key", "--host", "--gpu-memory-utilization", "/ws/update", "/ws/logprobs"):
        assert flag in ours, f"{flag} is not described before vLLM's options"
    assert "EVERY route" in ours and "--kv-cache-memory-bytes" in ours  # the CPU KV cache sizing (issue 22.9)
    assert "--max-model-len" in engine


def test_cpu_memory_default_is_half_the_free_memory():
    from grpo_async.generation.vllm_cpu import cpu_memory_utilization

    gib = 1 << 30
    assert cpu_memory_utilization(int(18.9 * gib), int(22.59 * gib)) == 0.41  # the machine where 0.92 failed
    assert cpu_memory_utilization(100 * gib, 100 * gib) == 0.5
    assert cpu_memory_utilization(1 * gib, 100 * gib) == 0.05
