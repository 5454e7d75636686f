"""Mixture-of-experts models end to end (issue 45): a tiny Qwen3-MoE, and a tiny Mixtral, trained through the hf
backend, the in-process vLLM engine and a `grpo-async serve` server; the experts the trainer trained are the experts
the engine serves (its log-probs on fixed completions are the trainer model's within 1e-4, the dense tests' float32
tolerance).

Three things stood between a trained MoE model and its engine (docs/moe.md), each with a test here that fails without
its fix:

- names: transformers 5 keeps experts stacked at run time (`mlp.experts.gate_up_proj` `[E, 2I, H]`) and Mixtral's
  layers renamed (`mlp` for `block_sparse_moe`); vLLM's Mixtral loads neither. Pushes now send the checkpoint layout
  (`weight_sync/checkpoint_layout.py`): `test_checkpoint_layout_*`, and Mixtral in `test_colocate_*`.
- vLLM's CPU MoE kernel reads prepacked experts, and vLLM's weight-update path does not prepack them again
  (`weight_sync/moe_reload.py`): every `test_colocate_*` / server test (engine log-probs off by ~0.3 without it).
- a server refused a complete MoE push as incomplete (`PushCoverage` knew no expert stacks):
  `test_push_coverage_of_moe_experts`, `test_server_*`.

`test_router_replay_*`: the trainer side of router replay (`grpo_async/algo/router_replay.py`) on the hf model.
"""

from __future__ import annotations

import pytest
import torch
from recording import recorded_trainer
from vllm_utils import API_KEY, PROMPTS, hf_logprobs, running_servers

from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.generation.base import SamplingConfig
from grpo_async.testing import TinyMoESpec, build_tiny_moe, tiny_config

#: fixed (prompt, completion) pairs the engine scores (prompt log-probs) and the trainer's model scores
FIXED = [(PROMPTS[0], [40, 41, 42, 43, 44, 45]), (PROMPTS[1], [12, 13, 14, 15, 16]), (PROMPTS[2], [50, 51, 8, 9])]
ATOL = 1e-4  # as vllm_utils.assert_matches_hf (float32 engine and trainer)


@pytest.fixture(scope="module")
def qwen3_moe_path(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("qwen3_moe") / "model", TinyMoESpec(family="qwen3_moe"))


@pytest.fixture(scope="module")
def mixtral_path(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("mixtral") / "model", TinyMoESpec(family="mixtral"))


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _train(path, tmp_path, **kw):
    """Train 4 steps (rounds sampled with versions 0, 1, 2: one round ahead); every parameter (every expert, the
    routers) must have moved. Returns the trainer and the micro-batches it trained."""
    args = tiny_config(tmp_path / "out", **{"max_steps": 4, "num_batches_ahead": 1, **kw})
    t, seen = recorded_trainer(model=path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(64))
    before = {n: p.detach().clone() for n, p in t.model.named_parameters()}
    t.train()
    changed = {n for n, p in t.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed == set(before), f"parameters left unchanged: {sorted(set(before) - changed)}"
    assert any(".experts." in n for n in changed) and any(n.endswith("mlp.gate.weight") for n in changed)
    assert len([h for h in t.state.log_history if "reward" in h]) == args.max_steps
    return t, seen


def _first_round_logps_match(trainer, seen, model_path):
    """Round 0 was sampled from the initial weights: its rollout log-probs are the initial model's (as
    test_vllm_training's check of the dense model)."""
    from grpo_async.algo.logprobs import completion_logps

    batch = next(b for b in seen if int(b["round_id"][0]) == 0)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    am = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        ref = completion_logps(_load(model_path), ids, am, batch["completion_ids"].size(1), trainer.args.temperature)
    mask = batch["completion_mask"].bool()
    worst = (ref - batch["rollout_logps"])[mask].abs().max().item()
    assert worst < ATOL, f"sampler and trainer log-probs differ by {worst:.2e} on the on-policy round"


def _assert_engine_matches(trainer, engine_logprobs, model_path) -> None:
    """After `sync_weights()`: the engine's log-probs of the fixed completions are the trained model's, and they are
    not the initial weights' (so the comparison would see stale experts)."""
    initial = _load(model_path)
    trainer.sync_weights()
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    moved = 0.0
    for prompt, completion in FIXED:
        served = engine_logprobs(prompt, completion)
        ref = hf_logprobs(model, prompt, completion)
        worst = max(abs(a - b) for a, b in zip(served, ref))
        assert worst < ATOL, f"engine log-probs differ from the trainer's by {worst:.2e}: {served} vs {ref}"
        moved = max(moved, max(abs(a - b) for a, b in zip(served, hf_logprobs(initial, prompt, completion))))
    assert moved > 1e-3, f"training moved no fixed log-prob by more than {moved:.1e}: a stale push would pass"


# ---------------------------------------------------------------------------------------------- no engine
def test_checkpoint_layout_sends_experts_as_save_pretrained_writes_them(qwen3_moe_path, mixtral_path, tiny_model_path):
    """The names a push sends are the checkpoint's (what vLLM loads), the tensors the trained model's own."""
    from safetensors import safe_open

    from grpo_async.weight_sync.checkpoint_layout import checkpoint_layout
    from grpo_async.weight_sync.collect import iter_full_params

    assert checkpoint_layout(_load(tiny_model_path)) is None  # a dense model goes out untouched
    for path in (qwen3_moe_path, mixtral_path):
        model = _load(path)
        sent = {n: t for _, group in iter_full_params(model) for n, t in group}
        with safe_open(f"{path}/model.safetensors", "pt") as f:
            assert set(sent) == set(f.keys())  # exactly save_pretrained's names
            for name in sent:
                torch.testing.assert_close(sent[name], f.get_tensor(name), atol=0, rtol=0, msg=name)
    # the expert tensors are the live stacks' slices: expert 1's gate (Mixtral: w1) is gate_up_proj[1, :I]
    stack = model.model.layers[0].mlp.experts.gate_up_proj
    expert = sent["model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    torch.testing.assert_close(expert, stack[1, : stack.shape[1] // 2], atol=0, rtol=0)


@pytest.mark.vllm
def test_push_coverage_of_moe_experts():
    """`PushCoverage` on a vLLM MoE layer (its expert mapping built by vLLM's own function): per-expert and stacked
    checkpoint names both cover it, and a missing expert is named."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from grpo_async.weight_sync.requests import PushCoverage

    class Experts(torch.nn.Module):  # what PushCoverage reads of vLLM's RoutedExperts
        layer_name = "model.layers.0.mlp.experts"

        def __init__(self):
            super().__init__()
            self.w13_weight = torch.nn.Parameter(torch.zeros(4, 8, 4))
            self.w2_weight = torch.nn.Parameter(torch.zeros(4, 4, 4))

        def get_expert_mapping(self, include_fused=False):
            names = ("gate_proj", "down_proj", "up_proj")
            return RoutedExperts.build_expert_params_mapping(
                *names, num_experts=4, routed_experts_prefix="", include_fused=include_fused
            )

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.gate = torch.nn.Linear(4, 4, bias=False)
    model.model.layers[0].mlp.experts = torch.nn.Module()
    model.model.layers[0].mlp.experts.routed_experts = Experts()
    served = "model.layers.0.mlp.experts.routed_experts"
    prefix = "model.layers.0.mlp"
    gate = f"{prefix}.gate.weight"
    per_expert = [f"{prefix}.experts.{e}.{p}.weight" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    stacked = [f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"]

    cov = PushCoverage(model)
    assert cov.missing([gate, *per_expert]) == []
    assert cov.missing([gate, *stacked]) == []
    assert cov.missing([gate, *[n for n in per_expert if n != f"{prefix}.experts.3.up_proj.weight"]]) == [
        f"{served}.w13_weight (shard 'expert 3 w3' missing)"
    ]
    assert cov.missing([gate, stacked[0]]) == [
        f"{served}.w2_weight",
    ]
    missing = cov.missing([gate, stacked[1], *[n for n in per_expert if ".experts.0." in n]])
    shards = "'expert 1 w1', 'expert 1 w3', 'expert 2 w1', 'expert 2 w3' and 2 more"
    assert missing == [f"{served}.w13_weight (shard {shards} missing)"]


def test_hf_backend_trains_the_moe_model(qwen3_moe_path, tmp_path):
    t, _ = _train(qwen3_moe_path, tmp_path, generation_backend="hf", max_steps=2)
    assert t.objective.router is not None  # the MoE load-balancing loss is on (TRL's rule)


# ---------------------------------------------------------------------------------------------- router replay (hf)
def _experts_run(model):
    """A pre-hook on every MoE layer's experts module: `runs[i][layer]` the expert indices it ran in forward `i`."""
    runs: list[list[torch.Tensor]] = []
    handles = []
    for layer, block in enumerate(m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")):

        def seen(module, args, layer=layer):
            if layer == 0:
                runs.append([])
            runs[-1].append(args[1].detach().clone())

        handles.append(block.experts.register_forward_pre_hook(seen))
    return runs, handles


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_replay_runs_the_recorded_experts(family, request):
    """Replaying a forward's own routing changes nothing; after the routers move, the experts run are the recorded
    ones at every layer with replay on and differ with it off; unreplayed tokens keep the router's choice; the
    router still gets a gradient."""
    from grpo_async.algo.router_replay import capture_routing, replay_routing

    model = _load(request.getfixturevalue(f"{family}_path"))
    ids = torch.tensor([[7, 8, 9, 10, 11, 40, 41, 42], [20, 21, 22, 50, 51, 52, 53, 54]])
    with torch.no_grad(), capture_routing(model) as calls:
        plain = model(ids).logits
    recorded = torch.stack(calls[0], 1)  # [16 tokens, 2 layers, top-2]
    everything = torch.ones(len(recorded), dtype=torch.bool)
    with torch.no_grad(), replay_routing(model, recorded, everything):
        assert torch.equal(model(ids).logits, plain)

    with torch.no_grad():  # a trainer whose routers disagree with the sampler's
        gen = torch.Generator().manual_seed(0)
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.add_(torch.randn(m.weight.shape, generator=gen) * 2.0)
    runs, handles = _experts_run(model)
    try:
        with torch.no_grad():
            model(ids)
        off = torch.stack(runs[-1], 1)
        completion = torch.zeros(2, 8, dtype=torch.bool)
        completion[:, 5:] = True  # replay the completion tokens only
        mask = completion.reshape(-1)
        assert not torch.equal(off[mask].sort(-1).values, recorded[mask].sort(-1).values), "the routers agree"
        with replay_routing(model, recorded, mask):
            out = model(ids).logits
        on = torch.stack(runs[-1], 1)
        assert torch.equal(on[mask], recorded[mask])  # every layer, every replayed token
        assert torch.equal(on[~mask][:, 0], off[~mask][:, 0])  # layer 0's other tokens: the router's own choice
        out[:, 5:].logsumexp(-1).sum().backward()
        assert all(r.weight.grad.abs().sum() > 0 for r in model.modules() if type(r).__name__.endswith("TopKRouter"))
    finally:
        for h in handles:
            h.remove()


def test_router_replay_refuses_a_router_it_cannot_drive():
    from grpo_async.algo.router_replay import moe_routers

    class Deepseekish(torch.nn.Module):
        config = type("Config", (), {"n_routed_experts": 64})()

    with pytest.raises(ValueError, match="Deepseekish is a mixture-of-experts model whose router"):
        moe_routers(Deepseekish())
    assert moe_routers(torch.nn.Linear(2, 2)) == []  # a dense model: nothing to replay


# ---------------------------------------------------------------------------------------------- in-process engine
@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_colocate_trains_moe_and_the_engine_serves_the_trained_experts(family, request, tmp_path):
    path = request.getfixturevalue(f"{family}_path")
    t, seen = _train(path, tmp_path, generation_backend="vllm")
    try:
        _first_round_logps_match(t, seen, path)
        assert {int(b["policy_version"][0]) for b in seen} == {0, 1, 2}  # rounds 1, 2 sampled from pushed experts
        llm = t.backend.llm

        def engine_logprobs(prompt, completion):
            from vllm import SamplingParams

            params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
            out = llm.generate([{"prompt_token_ids": prompt + completion}], params, use_tqdm=False)[0]
            return [out.prompt_logprobs[len(prompt) + j][tok].logprob for j, tok in enumerate(completion)]

        _assert_engine_matches(t, engine_logprobs, path)
        sampled = t.backend.generate(PROMPTS, SamplingConfig(n=2, max_tokens=6, seed=3))  # and what it samples
        model = t.accelerator.unwrap_model(t.model).eval()
        for i, c in enumerate(sampled):
            ref = hf_logprobs(model, PROMPTS[i // 2], c.completion_ids)
            assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < ATOL
    finally:
        t.close()


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_colocate_push_reaches_the_experts_of(family, tmp_path):
    """The other two families vLLM serves on CPU (Qwen2-MoE with its shared expert): a push of perturbed weights, the
    way the trainer publishes (`iter_full_params`), is what the engine then serves."""
    from vllm_utils import perturbed_state_dict

    from grpo_async.generation.vllm_colocate import VLLMColocateBackend
    from grpo_async.weight_sync.collect import iter_full_params

    path = build_tiny_moe(tmp_path / family, TinyMoESpec(family=family))
    backend = VLLMColocateBackend(path, max_model_len=256)
    try:
        initial = _load(path)
        model, _ = perturbed_state_dict(path, seed=1)
        backend.load_weights(iter_full_params(model), 1)
        moved = 0.0
        for i, c in enumerate(backend.generate(PROMPTS, SamplingConfig(n=2, max_tokens=8, seed=1))):
            ref = hf_logprobs(model, PROMPTS[i // 2], c.completion_ids)
            assert max(abs(a - b) for a, b in zip(ref, c.logprobs)) < ATOL
            old = hf_logprobs(initial, PROMPTS[i // 2], c.completion_ids)
            moved = max(moved, max(abs(a - b) for a, b in zip(old, c.logprobs)))
        assert moved > 0.05
    finally:
        backend.close()


@pytest.mark.vllm
def test_a_moe_engine_beside_a_dense_one_in_the_same_process(qwen3_moe_path, tiny_model_path, tmp_path):
    """vLLM makes its parallel groups once per process, with the first engine, and keeps them until that engine shuts
    down; a dense model's engine makes no expert-parallel group, and an in-process MoE engine built while it lives
    used to fail in its model's constructor ("expert parallel group is not initialized"; a CI run met it by test
    order). A process of its own, so the dense engine really comes first: a fork of the warm interpreter
    (`run_script`: vLLM imported, no engine built, no group made yet). The MoE engine then generates, and records its
    routing."""
    from support.warm_launch import run_script

    script = tmp_path / "moe_after_dense.py"
    script.write_text(
        "import sys, torch\n"
        "from grpo_async.generation.base import SamplingConfig\n"
        "from grpo_async.generation.vllm_colocate import VLLMColocateBackend\n"
        "assert not torch.distributed.is_initialized()  # the fork starts as a fresh process would\n"
        "dense = VLLMColocateBackend(sys.argv[1], max_model_len=128)\n"
        "moe = VLLMColocateBackend(sys.argv[2], max_model_len=128, record_routing=True)\n"
        "out = moe.generate([[5, 6, 7]], SamplingConfig(n=2, max_tokens=4, seed=0))\n"
        "assert all(c.routed_experts is not None and len(c.completion_ids) for c in out), out\n"
        "moe.close()\n"
        "dense.close()\n"
        "print('MOE_AFTER_DENSE_OK')\n"
    )
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    run = run_script(str(script), [tiny_model_path, qwen3_moe_path], env=env, timeout=240)
    assert run.returncode == 0 and "MOE_AFTER_DENSE_OK" in run.stdout, run.stdout[-3000:]


# ---------------------------------------------------------------------------------------------- server
@pytest.fixture(scope="module")
def moe_server(qwen3_moe_path):
    with running_servers(qwen3_moe_path, 1) as (server,):
        yield server


@pytest.mark.vllm
@pytest.mark.slow
def test_server_trains_moe_and_serves_the_trained_experts(moe_server, qwen3_moe_path, tmp_path):
    """`grpo-async serve`, shared-memory pushes (staged: the server checks the push covers every expert first)."""
    from grpo_async.net import ServerClient

    client = ServerClient(moe_server.url, api_key=API_KEY, timeout=120)
    t, seen = _train(
        qwen3_moe_path,
        tmp_path,
        generation_backend="vllm_server",
        vllm_server_urls=[moe_server.url],
        vllm_api_key=API_KEY,
        weight_sync_transport="ipc",
    )
    try:
        assert t.backend.transport_name == "shm"
        _first_round_logps_match(t, seen, qwen3_moe_path)

        def engine_logprobs(prompt, completion):
            body = {"sequences": [{"prompt_ids": prompt, "completion_ids": completion}]}
            return client.post("/ws/logprobs", body)["logprobs"][0]

        _assert_engine_matches(t, engine_logprobs, qwen3_moe_path)
        assert client.get("/ws/info")["version"] == t.state.global_step
    finally:
        t.close()
        client.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_server_refuses_a_push_missing_an_expert(moe_server, qwen3_moe_path):
    """A push without one expert's up projection is refused by name; the served weights and version stay."""
    from grpo_async.net import ServerClient, ServerError
    from grpo_async.weight_sync.collect import iter_full_params
    from grpo_async.weight_sync.transports import make_transport

    client = ServerClient(moe_server.url, api_key=API_KEY, timeout=120)
    tr = make_transport("shm", client, bucket_mb=0.01)
    try:
        version = client.get("/ws/info")["version"]
        model = _load(qwen3_moe_path)
        lost = "model.layers.1.mlp.experts.2.up_proj.weight"
        groups = [(m, [(n, x) for n, x in g if n != lost]) for m, g in iter_full_params(model)]
        with pytest.raises(ServerError) as e:
            tr.push(groups, 99)
        assert e.value.status == 409 and "expert 2 w3" in str(e.value), str(e.value)
        assert client.get("/ws/info")["version"] == version
    finally:
        tr.close()
        client.close()
