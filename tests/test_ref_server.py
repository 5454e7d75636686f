"""Reference logprobs from a frozen `grpo-async serve` server (`GRPOConfig.ref_server_url`): the route, the client
against the in-process reference model, and a training run that loads no reference copy."""

import pytest
import torch
from recording import recorded_trainer
from transformers import AutoModelForCausalLM
from vllm_utils import API_KEY, running_servers

from grpo_async import GRPOConfig
from grpo_async.algo.logprobs import completion_logps
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.generation.ref_client import RefLogpsClient
from grpo_async.net import ServerClient, ServerError
from grpo_async.testing import tiny_config

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(tiny_model_path):
    # --max-logprobs -1: temperatures other than 1 need every token's prompt logprob; --frozen: no weight updates
    with running_servers(tiny_model_path, 1, extra_args=["--max-logprobs", "-1", "--frozen"]) as (s,):
        yield s


def _rows(B=6, P=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 60, (B, P + T), generator=g)
    mask = torch.zeros(B, P + T, dtype=torch.long)
    for i in range(B):
        mask[i, P - 1 - i % P : P + 1 + (i * 3) % T] = 1  # skewed prompt and completion lengths
    return ids.masked_fill(mask == 0, 0), mask, T


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_server_ref_logps_equal_in_process_reference(server, tiny_model_path, temperature):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    ids, mask, T = _rows()
    with torch.no_grad():
        local = completion_logps(model, ids, mask, T, temperature)  # [B, T]
    remote = RefLogpsClient(server.url, API_KEY).completion_logps(ids, mask, T, temperature)  # [B, T]
    cm = mask[:, -T:].bool()
    assert remote.shape == local.shape
    assert (remote[cm] - local[cm]).abs().max().item() < 1e-4
    assert (remote[~cm] == 0).all()
    # and the temperature was applied: the T=1 answer would be far off at 0.7
    if temperature != 1.0:
        raw = RefLogpsClient(server.url, API_KEY).completion_logps(ids, mask, T, 1.0)
        assert (raw[cm] - local[cm]).abs().max().item() > 1e-2


def test_logprobs_route_refuses_bad_requests(server):
    good = {"sequences": [{"prompt_ids": [7, 8], "completion_ids": [9]}], "temperature": 1.0}
    with pytest.raises(ServerError, match="401"):
        ServerClient(server.url, api_key="wrong").post("/ws/logprobs", good)
    client = ServerClient(server.url, API_KEY)
    assert len(client.post("/ws/logprobs", good)["logprobs"][0]) == 1
    for bad in (
        {"sequences": [{"prompt_ids": [], "completion_ids": [9]}]},  # nothing to condition on
        {"sequences": [{"prompt_ids": [7], "completion_ids": ["x"]}]},
        {"sequences": good["sequences"], "temperature": 0},
        {"sequences": good["sequences"], "extra": 1},
    ):
        with pytest.raises(ServerError, match="400"):
            client.post("/ws/logprobs", bad)
    # a frozen server refuses weight updates
    for path in ("/ws/update", "/ws/init_broadcast"):
        with pytest.raises(ServerError, match="403.*frozen"):
            client.post(path, {})


def test_ref_server_url_needs_beta(tmp_path):
    with pytest.raises(ValueError, match="GRPOConfig.ref_server_url"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, ref_server_url="http://127.0.0.1:1", beta=0.0)
    with pytest.raises(ValueError, match="GRPOConfig.ref_server_url"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, ref_server_url="127.0.0.1:1", beta=0.1)


def test_training_with_ref_server_logs_kl_and_holds_no_reference(server, tiny_model_path, tmp_path):
    args = tiny_config(tmp_path / "out", temperature=0.9, beta=0.1, ref_server_url=server.url, vllm_api_key=API_KEY)
    t, seen = recorded_trainer(
        model=tiny_model_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32)
    )
    assert t.ref_model is None and t.ref_client is not None
    t.train()
    kls = [h["kl"] for h in t.state.log_history if "kl" in h]
    assert len(kls) == 3 and all(k >= 0 for k in kls) and kls[-1] > 0  # the policy moved away from the reference
    # the ref logps the trainer used are the initial weights' (the server is frozen), at the trainer's temperature
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    for batch in seen:
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        T = batch["completion_ids"].size(1)
        with torch.no_grad():
            local = completion_logps(ref, ids, mask, T, 0.9)
        cm = batch["completion_mask"].bool()
        assert (batch["ref_logps"][cm] - local[cm]).abs().max().item() < 1e-4


def test_ref_server_cannot_be_a_generation_server(tmp_path):
    url = "http://127.0.0.1:8000"
    with pytest.raises(ValueError, match="GRPOConfig.ref_server_url.*frozen reference"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, beta=0.1, ref_server_url=url + "/", vllm_server_urls=[url])
