"""LoRA adapter-only weight sync (`GRPOConfig.vllm_lora_sync`): only the adapter's tensors reach vLLM, which serves
base + LoRA with a new adapter per policy version; the base weights never move. The merged path stays an option."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm_utils import API_KEY, PROMPTS, assert_matches_hf, hf_greedy, hf_logprobs, running_servers

from grpo_async import GRPOTrainer
from grpo_async.demo_task import make_dataset
from grpo_async.generation.base import SamplingConfig
from grpo_async.generation.shared import SharedBackend
from grpo_async.net import ServerClient
from grpo_async.pipeline.publisher import PolicyPublisher
from grpo_async.testing import tiny_config
from grpo_async.weight_sync.lora import (
    LORA_ID_BASE,
    adapter_config,
    adapter_problem,
    adapter_spec,
    iter_adapter_params,
    lora_sync_mode,
    vllm_max_lora_rank,
)
from grpo_async.weight_sync.requests import validate_update_request

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": TARGETS, **kw})


def _peft(path, **kw):
    from peft import get_peft_model

    return get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), _lora(**kw))


def _adapter_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


# ---------------------------------------------------------------------------------------------- no engine
class AdapterReceiver:
    """A sampler that records what it is handed: `load_adapter` (adapter sync) or `load_weights` (full)."""

    def __init__(self):
        self.adapters, self.full = [], []

    def load_adapter(self, groups, config, version):
        self.adapters.append(({n: t.clone() for _, ts in groups for n, t in ts}, config, version))

    def load_weights(self, groups, version):
        self.full.append({n: t.clone() for _, ts in groups for n, t in ts})

    def close(self):
        pass


def test_adapter_publish_sends_only_the_lora_tensors(tiny_model_path):
    model = _peft(tiny_model_path, init_lora_weights=False)  # non-zero B: the adapter is visible
    receiver = AdapterReceiver()
    publisher = PolicyPublisher(SharedBackend(lambda: receiver), adapter=True)
    publisher.publish(model, version=5)
    tensors, config, version = receiver.adapters[0]
    live = _adapter_params(model)
    assert not receiver.full and version == 5 and len(tensors) == len(live) == 2 * 7 * 2  # A, B × 7 modules × 2 layers
    # PEFT's saved-adapter names (what vLLM reads from adapter_model.safetensors), the live values
    expected = {n.replace(".default.", "."): p for n, p in live.items()}
    assert set(tensors) == set(expected)
    assert all(torch.equal(tensors[n], p.detach()) for n, p in expected.items())
    assert config["r"] == 8 and config["lora_alpha"] == 16 and sorted(config["target_modules"]) == sorted(TARGETS)
    assert publisher.last["mode"] == "adapter" and publisher.last["tensors"] == len(live)
    assert publisher.last["bytes"] == sum(p.numel() * p.element_size() for p in live.values())
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in live)
    assert publisher.last["bytes"] < base_bytes / 4  # r=8 on a hidden-64 model; on SmolLM2 r=16: ~1/30
    # the merged path (adapter=False) still pushes every full weight under its base name
    merged = PolicyPublisher(SharedBackend(lambda: receiver))
    merged.publish(model, version=6)
    assert merged.last["mode"] == "full" and not any("lora" in n for n in receiver.full[0])
    assert len(receiver.full[0]) == len(list(AutoModelForCausalLM.from_pretrained(tiny_model_path).parameters()))


def test_merged_publish_through_buckets_sends_merged_weights(tiny_model_path):
    """Regression: the merge is undone once the last group is handed out, which is before a bucketing consumer sends
    its final bucket (for a small model: every tensor); the weights merged into must arrive merged anyway."""
    from grpo_async.weight_sync.buckets import iter_buckets

    class Bucketing(AdapterReceiver):
        def load_weights(self, groups, version):
            self.full.append({n: t.clone() for bucket in iter_buckets(groups, 64.0) for n, t in bucket})

    model = _peft(tiny_model_path, init_lora_weights=False)
    receiver = Bucketing()
    PolicyPublisher(SharedBackend(lambda: receiver)).publish(model, version=1)
    for name, p in model.merge_and_unload().named_parameters():
        torch.testing.assert_close(receiver.full[0][name], p.detach(), atol=1e-6, rtol=0)


def test_adapter_groups_keep_a_and_b_of_a_module_together(tiny_model_path):
    groups = list(iter_adapter_params(_peft(tiny_model_path)))
    for module, tensors in groups:
        assert sorted(n.removeprefix(module + ".") for n, _ in tensors) == ["lora_A.weight", "lora_B.weight"]


def test_lora_sync_mode_resolution(tiny_model_path, tmp_path):
    model = _peft(tiny_model_path)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)

    def mode(m, **kw):
        return lora_sync_mode(tiny_config(tmp_path, **kw), m)

    assert mode(model, generation_backend="vllm") == "adapter"  # auto, in-process engine
    assert mode(model, generation_backend="vllm", vllm_lora_sync="merged") == "merged"
    assert mode(model, generation_backend="hf") == "merged"
    servers = {"generation_backend": "vllm_server", "vllm_server_urls": ["http://127.0.0.1:1"]}
    assert mode(model, **servers) == "merged"  # a server's LoRA support is its operator's choice: ask for it
    assert mode(model, vllm_lora_sync="adapter", **servers) == "adapter"
    assert mode(plain, generation_backend="vllm") is None
    with pytest.raises(ValueError, match="needs a PEFT LoRA model"):
        mode(plain, generation_backend="vllm", vllm_lora_sync="adapter")
    dora = _peft(tiny_model_path, use_dora=True)
    assert "DoRA" in adapter_problem(dora) and mode(dora, generation_backend="vllm") == "merged"
    with pytest.raises(ValueError, match="DoRA"):
        mode(dora, generation_backend="vllm", vllm_lora_sync="adapter")
    assert "modules_to_save" in adapter_problem(_peft(tiny_model_path, modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="vllm_lora_sync"):
        tiny_config(tmp_path, vllm_lora_sync="adapter")  # the hf backend cannot take an adapter
    with pytest.raises(ValueError, match="vllm_lora_sync"):
        tiny_config(tmp_path, generation_backend="vllm", vllm_lora_sync="delta")
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 64)] == [1, 8, 8, 16, 64]


def test_update_request_lora_spec_is_validated(tiny_model_path):
    spec = adapter_spec(3, adapter_config(_peft(tiny_model_path)))
    assert spec["name"] == "policy-v3" and spec["id"] == LORA_ID_BASE + 3
    body = {"transport": "shm", "buckets": [], "segments": [], "lora": spec}
    assert validate_update_request(body)["lora"] == spec
    for bad in ({**spec, "id": 0}, {**spec, "name": ""}, {"name": "x", "id": 1}, {**spec, "path": "/tmp"}):
        with pytest.raises(ValueError, match="lora"):
            validate_update_request({**body, "lora": bad})


# ---------------------------------------------------------------------------------------------- real vLLM
def _varied(prompts, completions, completion_ids, **kw):
    """A reward that differs between any two different completions: every group has advantages, so every step has a
    gradient (the letter task's reward was 0 for all 16 completions of both steps in some full-suite runs, and the
    adapter never moved: what this file tests is the adapter's sync, not the task)."""
    return [float(sum(ids) % 7) + 0.01 * len(ids) for ids in completion_ids]


def _train(args, model, **kw):
    """Train; every adapter parameter must have moved (so the syncs after step 0 carry a new adapter)."""
    t = GRPOTrainer(model=model, reward_funcs=_varied, args=args, train_dataset=make_dataset(64), **kw)
    before = {n: p.detach().clone() for n, p in _adapter_params(t.model).items()}
    t.train()
    unchanged = [n for n, p in _adapter_params(t.model).items() if torch.equal(before[n], p.detach())]
    assert before and not unchanged, f"adapter parameters left unchanged: {unchanged[:4]} ({t.state.log_history})"
    return t


def _assert_sampler_is_the_policy(t):
    """After a sync the sampler's greedy tokens and sampled logprobs equal the trainer's PEFT model's."""
    t.sync_weights()
    model = t.accelerator.unwrap_model(t.model).eval()
    for prompt, c in zip(PROMPTS, t.backend.generate(PROMPTS, SamplingConfig(max_tokens=6, top_k=1))):
        assert c.completion_ids == hf_greedy(model, prompt, 6)
    sampled = t.backend.generate(PROMPTS, SamplingConfig(n=2, max_tokens=6, temperature=t.args.temperature))
    for i, c in enumerate(sampled):
        assert_matches_hf(model, PROMPTS[i // 2], c.completion_ids, c.logprobs, temperature=t.args.temperature)
    return model


@pytest.mark.vllm
def test_colocate_adapter_sync_trains_and_sampler_matches_trainer(tiny_model_path, tmp_path):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():  # a base that differs from the folder's: the engine must serve this one (saved for it)
        for p in base.parameters():
            p.mul_(1.25)
    args = tiny_config(tmp_path / "out", generation_backend="vllm", max_steps=2, temperature=0.9)
    t = _train(args, base, peft_config=_lora(init_lora_weights=False))  # non-zero B: the adapter matters from v0
    try:
        assert t.publisher.adapter and t.backend.llm.llm_engine.vllm_config.lora_config is not None
        # on-policy first round: sampler and trainer logprobs agree (the bound of the full-weight tests)
        assert t.state.log_history[0]["sampling/logp_diff/max"] < 1e-4
        model = _assert_sampler_is_the_policy(t)
        live = _adapter_params(model)
        # every sync sent the adapter only: no base weight
        assert t.publisher.last["mode"] == "adapter" and t.publisher.last["tensors"] == len(live) == 28
        assert t.publisher.last["bytes"] == sum(p.numel() * p.element_size() for p in live.values())
        lora = t.backend.lora_request
        assert lora.lora_name == f"policy-v{t.state.global_step}" and lora.lora_int_id == LORA_ID_BASE + 2
        info = t.backend.llm.collective_rpc("ws_info")[0]["lora"]
        assert info["adapters"][-1] == lora.lora_int_id and len(info["adapters"]) <= 2
        # the engine's base weights never moved: without the adapter it serves the (perturbed) base model
        t.backend.lora_request = None
        with model.disable_adapter():
            for prompt, c in zip(PROMPTS, t.backend.generate(PROMPTS, SamplingConfig(max_tokens=6, temperature=1.0))):
                worst = max(abs(a - b) for a, b in zip(hf_logprobs(model, prompt, c.completion_ids), c.logprobs))
                assert worst < 1e-4, worst
    finally:
        t.close()


@pytest.mark.vllm
def test_colocate_merged_sync_is_still_an_option(tiny_model_path, tmp_path):
    args = tiny_config(tmp_path / "out", generation_backend="vllm", max_steps=2, vllm_lora_sync="merged")
    t = _train(args, tiny_model_path, peft_config=_lora(init_lora_weights=False))
    try:
        assert not t.publisher.adapter and t.backend.llm.llm_engine.vllm_config.lora_config is None
        assert t.state.log_history[0]["sampling/logp_diff/max"] < 1e-4
        _assert_sampler_is_the_policy(t)
        plain = AutoModelForCausalLM.from_pretrained(tiny_model_path)  # every base weight, under its HF name
        assert t.publisher.last["mode"] == "full" and t.publisher.last["tensors"] == len(list(plain.parameters()))
    finally:
        t.close()


@pytest.mark.vllm
def test_server_adapter_sync_over_shared_memory(tiny_model_path, tmp_path):
    lora_args = ["--enable-lora", "--max-lora-rank", "8", "--max-cpu-loras", "2"]
    with running_servers(tiny_model_path, 1, extra_args=lora_args) as (server,):
        args = tiny_config(
            tmp_path / "out",
            generation_backend="vllm_server",
            vllm_server_urls=[server.url],
            vllm_api_key=API_KEY,
            vllm_lora_sync="adapter",
            weight_sync_transport="ipc",
            max_steps=2,
        )
        t = _train(args, tiny_model_path, peft_config=_lora(init_lora_weights=False))
        try:
            assert t.state.log_history[0]["sampling/logp_diff/max"] < 1e-4
            _assert_sampler_is_the_policy(t)
            assert t.publisher.last["mode"] == "adapter" and t.publisher.last["tensors"] == 28
            client = ServerClient(server.url, api_key=API_KEY)
            served = [m["id"] for m in client.get("/v1/models")["data"]]
            assert t.backend.router.model == f"policy-v{t.state.global_step}" in served
            assert len([m for m in served if m.startswith("policy-v")]) <= 2  # older adapters are dropped
            assert client.get("/ws/info")["workers"][0]["lora"]["adapters"][-1] == LORA_ID_BASE + 2
        finally:
            t.close()
