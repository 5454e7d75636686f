"""Training against a stock `vllm serve` (what `trl vllm-serve` starts), not `grpo-async serve`.

The server is vLLM's own `python -m vllm.entrypoints.openai.api_server`, started as vLLM documents its RL API
(`VLLM_SERVER_DEV_MODE=1`) with our weight-transfer engine (`--weight-transfer-config '{"backend": "grpo_async"}'`,
found through the `vllm.general_plugins` entry point of the installed `grpo_async`). The trainer detects the kind of
server by itself: the config is the one a `grpo-async serve` user writes.
"""

from __future__ import annotations

import copy
import random

import pytest
from transformers import TrainerCallback
from vllm_utils import ENGINE_FLAG, hf_logprobs, start_stock_server

from grpo_async import GRPOTrainer
from grpo_async.demo_task import make_dataset
from grpo_async.generation.stock_server import StockVLLMServerBackend, detect_server_kind
from grpo_async.net import ServerClient
from grpo_async.testing import tiny_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: prompt → completion pairs whose logprobs the server and the trainer must agree on after every push
SEQUENCES = [([7, 8, 9, 10, 11], [12, 40, 41, 3]), ([20, 21, 22], [23, 24, 60, 61, 62]), ([30, 31], [5])]


def sampler_logprobs(url: str, prompt: list[int], completion: list[int]) -> list[float]:
    """The server's logprob of each completion token given its prefix: `/v1/completions` with vLLM's
    `prompt_logprobs` over prompt + completion (one forward of the served weights)."""
    client = ServerClient(url, timeout=60)
    model = client.get("/v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": prompt + completion, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    out = client.post("/v1/completions", body)["choices"][0]["prompt_logprobs"]
    ids = prompt + completion
    return [out[i][str(ids[i])]["logprob"] for i in range(len(prompt), len(ids))]


def distinct_tokens(completions, completion_ids, **kw):
    """Distinct-token share plus seeded noise: varies within every group, so every step moves the weights (an
    untrained model's completions can tie on the share alone, and a group of equal rewards trains nothing)."""
    return [len(set(ids)) / max(len(ids), 1) + NOISE.random() for ids in completion_ids]


NOISE = random.Random(0)


class CheckStockServer(TrainerCallback):
    """After every step: the server reports the version the trainer pushed last, and its logprobs equal those of the
    trainer's model at that version (and differ from the version before: a missed push would show)."""

    def __init__(self, url: str):
        self.url, self.trainer, self.snapshots, self.checks = url, None, {}, []

    def snapshot(self, model, version: int) -> None:
        self.snapshots[version] = copy.deepcopy(model).eval()

    def check(self, after_step: int, version: int) -> None:
        def worst(model, served):
            return max(
                abs(a - b) for (p, c), got in zip(SEQUENCES, served) for a, b in zip(hf_logprobs(model, p, c), got)
            )

        served = [sampler_logprobs(self.url, p, c) for p, c in SEQUENCES]
        self.checks.append(
            {
                "after_step": after_step,
                "expected_version": str(version),
                "version": ServerClient(self.url).get("/weight_info")["weight_version"],
                "worst": worst(self.snapshots[version], served),
                "moved": worst(self.snapshots[version - 1], served) if version > 0 else None,
            }
        )

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.snapshot(self.trainer.accelerator.unwrap_model(model), 0)

    def on_step_end(self, args, state, control, model=None, **kw):
        self.check(state.global_step, state.global_step - 1)  # one round ahead: the weights of the step before
        self.snapshot(self.trainer.accelerator.unwrap_model(model), state.global_step)


@pytest.fixture(scope="module")
def stock_server(tiny_model_path):
    """One stock server with our engine for both transports (each trainer re-initializes the engine at start)."""
    server = start_stock_server(tiny_model_path, extra_args=ENGINE_FLAG)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_trains_three_steps_against_a_stock_vllm_server(stock_server, tiny_model_path, tmp_path, transport):
    server = stock_server
    assert detect_server_kind(server.url) == "stock"
    args = tiny_config(
        tmp_path / "out",
        max_steps=3,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_completion_length=6,
        num_batches_ahead=1,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.url,  # TRL's setting; nothing says "stock"
        weight_sync_transport=transport,
        vllm_server_timeout=60,
    )
    check = CheckStockServer(server.url)
    trainer = GRPOTrainer(
        model=tiny_model_path, reward_funcs=distinct_tokens, args=args, train_dataset=make_dataset(32)
    )
    trainer.add_callback(check)
    check.trainer = trainer
    try:
        trainer.train()
        assert isinstance(trainer.backend, StockVLLMServerBackend)
        assert trainer.backend.transport_name == {"broadcast": "broadcast", "ipc": "shm"}[transport]
        trainer.sync_weights()  # the final weights too
        check.check(trainer.state.global_step, trainer.state.global_step)
    finally:
        trainer.close()
    assert [c["after_step"] for c in check.checks] == [1, 2, 3, 3]
    for c in check.checks:
        assert c["version"] == c["expected_version"], check.checks
        assert c["worst"] < 1e-4, f"sampler and trainer log-probs differ: {check.checks}"
        if c["moved"] is not None:
            assert c["moved"] > 1e-3, f"the server still serves the previous version: {check.checks}"


@pytest.mark.parametrize(
    ("dev_mode", "extra", "names"),
    [
        (False, ENGINE_FLAG, ["VLLM_SERVER_DEV_MODE=1", "--weight-transfer-config"]),
        (True, [], ["--weight-transfer-config", '"backend": "grpo_async"']),
    ],
    ids=["no-dev-mode", "no-transfer-config"],
)
def test_a_stock_server_that_cannot_take_weights_is_refused(tiny_model_path, tmp_path, dev_mode, extra, names):
    server = start_stock_server(tiny_model_path, dev_mode=dev_mode, extra_args=extra)
    try:
        args = tiny_config(
            tmp_path / "out", max_steps=1, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url
        )
        trainer = GRPOTrainer(
            model=tiny_model_path, reward_funcs=distinct_tokens, args=args, train_dataset=make_dataset(8)
        )
        try:
            with pytest.raises(Exception) as e:
                trainer.train()
        finally:
            trainer.close()
        chain, err = [], e.value
        while err is not None:  # the error, and whatever it was raised from
            chain.append(f"{type(err).__name__}: {err}")
            err = err.__cause__ or err.__context__
        said = "\n".join(chain)
        for name in names:
            assert name in said, said
        assert "stopped answering" not in said and "HTTP 404" not in said, said
        assert server.alive  # refused before anything was sent: the server is untouched
    finally:
        server.stop()
