"""Router replay end to end (issue 45, second half; docs/moe.md "Router replay"): the sampler records the experts each
generated token ran (`hf`: a hook on its copy's routers; in-process vLLM: a hook on the engine worker's routers,
`generation/routing_capture.py`), the rows carry them (`MicroBatch.routed_experts`: slicing, joining, trimming,
padding, checkpoints), and with `GRPOConfig.router_replay="rollout"` the old-logps and training forward passes run
the completion tokens through them (padded rows, padding-free bins, prompt-sharing trees).

The training-forward tests perturb the trainer's routers before every micro-batch (so they disagree with the
sampler's) and watch which experts each MoE layer runs during the real training forward (a pre-hook on every experts
module): with replay every recorded (token, layer) runs the recorded experts; with `"record"` (recorded, not
replayed) they differ, so the check can fail.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from vllm_utils import PROMPTS

from grpo_async import GRPOCallback, GRPOTrainer
from grpo_async.algo.router_replay import routed, unrouted
from grpo_async.demo_task import letter_reward, make_dataset
from grpo_async.generation.base import SamplingConfig
from grpo_async.testing import TinyMoESpec, build_tiny_moe, tiny_config


@pytest.fixture(scope="module")
def qwen3_moe_path(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("qwen3_moe") / "model", TinyMoESpec(family="qwen3_moe"))


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def _perturb_routers(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in _routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=gen) * 2.0)


def _own_routing(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """`[T, L, k]` the experts `model` routes the completion tokens to, the sequence run alone."""
    from grpo_async.algo.router_replay import capture_routing

    with torch.no_grad(), capture_routing(model) as calls:
        model(torch.tensor([prompt + completion]))
    return torch.stack(calls[0], 1)[len(prompt) :]


def _same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[..., L, k]` × 2 → `[..., L]`: the same expert set."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


# ---------------------------------------------------------------------------------------------- the training forward
class ExpertsWatch(GRPOCallback):
    """Before every training micro-batch: perturb the trainer's routers (seeded) and keep the micro-batch; during the
    forward passes with gradient (the training forward; the old-logps pass runs before the micro-batch is handed
    out, without gradient): the experts each MoE layer's experts module ran, `[N, k]` per layer."""

    def __init__(self, model):
        self.model = model
        self.seen: list[tuple[dict, list[list[torch.Tensor]]]] = []  # (micro-batch, forwards × layers)
        self.handles = []
        blocks = [m for m in model.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
        for layer, block in enumerate(blocks):
            self.handles.append(block.experts.register_forward_pre_hook(self._hook(layer)))

    def _hook(self, layer: int):
        def ran(module, args):
            if not torch.is_grad_enabled() or not self.seen:
                return
            forwards = self.seen[-1][1]
            if layer == 0:
                forwards.append([])
            forwards[-1].append(args[1].detach().cpu().clone())

        return ran

    def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
        _perturb_routers(self.model, seed=len(self.seen))
        self.seen.append(({n: v.detach().cpu().clone() for n, v in micro_batch.tensors().items()}, []))

    def close(self):
        for h in self.handles:
            h.remove()


def _train_watched(path, tmp_path, **kw) -> tuple[GRPOTrainer, ExpertsWatch]:
    args = tiny_config(tmp_path / "out", **{"max_steps": 2, "padding_free": False, **kw})
    t = GRPOTrainer(model=path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(32))
    watch = ExpertsWatch(t.model)
    t.add_callback(watch)
    try:
        t.train()
    finally:
        watch.close()
    return t, watch


def _training_forward_agreement(watch: ExpertsWatch) -> torch.Tensor:
    """Over every trained micro-batch: `[n]` bool per recorded (completion token, MoE layer): the training forward
    ran the recorded experts. The padded forward runs `[B, P+T]` rows flattened row-major, completion token `(b, t)`
    at `b·(P+T) + P + t`."""
    out = []
    for mb, forwards in watch.seen:
        assert len(forwards) == 1, f"{len(forwards)} training forwards for one micro-batch"
        routing = mb["routed_experts"]  # [B, T, L, k]
        B, T, L, k = routing.shape
        P = mb["prompt_ids"].size(1)
        ran = torch.stack(forwards[0], 1).view(B, P + T, L, k)[:, P:]  # [B, T, L, k]
        recorded = routed(routing) & mb["completion_mask"].bool()  # [B, T]
        assert recorded.sum() > 0
        out.append(_same_sets(ran, routing)[recorded].flatten())
    return torch.cat(out)


@pytest.mark.parametrize("mode", ["rollout", "record"])
def test_training_forward_runs_the_recorded_experts(mode, qwen3_moe_path, tmp_path):
    """hf backend, rounds mode, one round ahead (old-logps pass on): with replay every recorded (token, layer) of the
    training forward runs the sampler's experts although the routers were just perturbed; recorded only, they run
    the routers' own choice, which differs. The old-logps pass logs how often the routers disagree."""
    t, watch = _train_watched(qwen3_moe_path, tmp_path, router_replay=mode, num_batches_ahead=1)
    try:
        agree = _training_forward_agreement(watch)
        if mode == "rollout":
            assert agree.all(), f"{int((~agree).sum())} of {agree.numel()} (token, layer) pairs ran other experts"
        else:
            assert agree.float().mean() < 0.9, "the perturbed routers still chose the recorded experts"
        logged = [h for h in t.state.log_history if "routing/mismatch_tokens" in h]
        assert len(logged) == 2 and all(0.0 <= h["routing/mismatch_pairs"] <= 1.0 for h in logged)
    finally:
        t.close()


def test_replay_off_carries_no_experts(qwen3_moe_path, tmp_path):
    args = tiny_config(tmp_path / "out", max_steps=1)
    t = GRPOTrainer(model=qwen3_moe_path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(16))
    seen = []

    class Seen(GRPOCallback):
        def on_micro_batch(self, args, state, control, micro_batch=None, **kwargs):
            seen.append(micro_batch)

    t.add_callback(Seen())
    try:
        t.train()
    finally:
        t.close()
    assert seen and all(mb.routed_experts is None for mb in seen)
    assert not any("routing/mismatch_tokens" in h for h in t.state.log_history)


# ---------------------------------------------------------------------------------------------- the layouts
def test_packed_and_shared_passes_replay_as_the_padded_rows(qwen3_moe_path):
    """`score_tokens` on a perturbed model with the unperturbed model's routing: the padded pass, padding-free bins and
    prompt-sharing trees give the same log-probs (each lays the recorded experts out where its tokens are), which
    are not the perturbed routers' own; replaying a model's own routing changes nothing; `replay=False` only
    counts."""
    from grpo_async.algo.logprobs import score_tokens
    from grpo_async.algo.prefix_sharing import SharingCost

    model = _load(qwen3_moe_path)
    prompts = [[7, 8, 9, 10], [7, 8, 9, 10], [20, 21, 22], [20, 21, 22]]  # two groups: the trees share their prompts
    completions = [[40, 41, 42, 43, 44], [40, 12], [50, 51, 52], [13, 14, 15, 16]]
    P, T = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(4, P + T, dtype=torch.long)
    am = torch.zeros(4, P + T, dtype=torch.long)
    routing = torch.full((4, T, 2, 2), unrouted(torch.uint8), dtype=torch.uint8)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, P - len(p) : P], ids[i, P : P + len(c)] = torch.tensor(p), torch.tensor(c)
        am[i, P - len(p) : P + len(c)] = 1
        routing[i, : len(c) - 1] = _own_routing(model, p, c)[:-1].to(torch.uint8)  # the last token: unrouted

    def logps(**kw):
        with torch.no_grad():
            return score_tokens(model, ids, am, T, **kw)

    real = am[:, P:].bool()
    plain = logps().logps
    own = logps(routing=routing)
    torch.testing.assert_close(own.logps[real], plain[real], atol=1e-5, rtol=0)
    assert own.routing.counts[0] == 0 and own.routing.counts[1] == int(routed(routing).sum())

    _perturb_routers(model, seed=0)
    moved = logps().logps
    padded = logps(routing=routing)
    assert (padded.logps - moved)[real].abs().max() > 1e-2, "the perturbation changed no routing"
    assert padded.routing.token_mismatch > 0.3
    packed = logps(routing=routing, padding_free=True)
    shared = logps(routing=routing, padding_free=True, share_prefix=SharingCost(per_token=1.0, per_pair=0.0))
    for other in (packed, shared):
        torch.testing.assert_close(other.logps[real], padded.logps[real], atol=1e-4, rtol=0)
        torch.testing.assert_close(other.routing.counts, padded.routing.counts)
    counted = logps(routing=routing, replay=False)
    torch.testing.assert_close(counted.logps[real], moved[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(counted.routing.counts, padded.routing.counts)


# ---------------------------------------------------------------------------------------------- the rows
def _rows(R: int, T: int, routing: torch.Tensor | None):
    from grpo_async.pipeline.types import MicroBatch

    return MicroBatch(
        prompt_ids=torch.ones(R, 2, dtype=torch.long),
        prompt_mask=torch.ones(R, 2, dtype=torch.long),
        completion_ids=torch.ones(R, T, dtype=torch.long),
        completion_mask=torch.ones(R, T, dtype=torch.long),
        loss_mask=torch.ones(R, T, dtype=torch.long),
        rollout_logps=torch.zeros(R, T),
        advantages=torch.zeros(R),
        policy_version=torch.zeros(R, dtype=torch.long),
        round_id=torch.zeros(R, dtype=torch.long),
        row_index=torch.arange(R),
        routed_experts=routing,
    )


def test_routed_experts_travel_with_their_rows(tmp_path):
    """Per-row experts `[R, T, L, k]` (uint8, 255 = unrouted) through the producer's stacking, joining parts of other
    widths (stream rounds, ranks), a process's slice, the broadcast (pickle), trimming, `pad_to_multiple_of` and a
    checkpoint's in-flight rounds."""
    from grpo_async.algo.router_replay import stack_routing
    from grpo_async.pipeline.checkpointing import load_rounds, save_rounds
    from grpo_async.pipeline.join import cat_batches
    from grpo_async.pipeline.rows import process_slice
    from grpo_async.pipeline.types import Round

    gen = torch.Generator().manual_seed(0)
    per_row = [torch.randint(0, 4, (n, 3, 2), generator=gen, dtype=torch.uint8) for n in (3, 1, 2)]
    a = _rows(3, 3, stack_routing(per_row, 3))  # [3, 3, 3 layers, top-2]
    assert a.routed_experts.dtype == torch.uint8 and torch.equal(a.routed_experts[1, 0], per_row[1][0])
    assert (a.routed_experts[1, 1:] == 255).all() and routed(a.routed_experts).tolist()[1] == [True, False, False]
    b = _rows(2, 5, torch.randint(0, 4, (2, 5, 3, 2), generator=gen, dtype=torch.uint8))
    joined = cat_batches([a, b], pad_token_id=0)
    assert joined.routed_experts.shape == (5, 5, 3, 2) and (joined.routed_experts[0, 3:] == 255).all()
    assert torch.equal(joined.routed_experts[3:], b.routed_experts)
    rank1 = pickle.loads(pickle.dumps(joined.select(process_slice(5, 5, 4))))  # the broadcast pickles rounds
    assert torch.equal(rank1.routed_experts[0], b.routed_experts[1])
    trimmed = joined.select(torch.tensor([0, 1])).trim()  # completion columns past the widest row's end go
    assert torch.equal(trimmed.routed_experts, a.routed_experts[:2])
    short = _rows(2, 2, joined.routed_experts[:2, :2].clone())
    padded = short.pad_to_multiple(4)
    assert padded.routed_experts.shape == (2, 4, 3, 2) and (padded.routed_experts[:, 2:] == 255).all()
    described = save_rounds(str(tmp_path), [Round(7, 0, joined)])
    (back,) = load_rounds(str(tmp_path), described)
    assert back.batch.routed_experts.dtype == torch.uint8 and torch.equal(
        back.batch.routed_experts, joined.routed_experts
    )


# ---------------------------------------------------------------------------------------------- the samplers
def test_hf_backend_records_its_own_routing(qwen3_moe_path):
    """Every completion token but the last (never fed back in) carries the experts the sampler's copy ran it through,
    which are the ones the model routes it to on the whole sequence."""
    from grpo_async.generation.hf import HFBackend
    from grpo_async.testing import build_tokenizer

    model = _load(qwen3_moe_path)
    backend = HFBackend(model, build_tokenizer(), record_routing=True)
    out = backend.generate(PROMPTS, SamplingConfig(n=2, max_tokens=6, seed=1))
    for i, c in enumerate(out):
        r = c.routed_experts
        assert r.shape == (len(c.completion_ids), 2, 2) and r.dtype == torch.uint8
        assert routed(r).tolist() == [True] * (len(c.completion_ids) - 1) + [False]
        assert _same_sets(_own_routing(model, PROMPTS[i // 2], c.completion_ids)[:-1], r[:-1]).all()
    with pytest.raises(ValueError, match="num_beams=2"):
        backend.generate(PROMPTS[:1], SamplingConfig(max_tokens=2, extra={"num_beams": 2, "do_sample": False}))


def test_refused_where_it_cannot_work(qwen3_moe_path, tiny_model_path, tmp_path):
    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    def trainer(path, **kw):
        args = tiny_config(tmp_path / "out", router_replay="rollout")
        return GRPOTrainer(model=path, reward_funcs=letter_reward, args=args, train_dataset=make_dataset(8), **kw)

    with pytest.raises(ValueError, match=r"GRPOConfig.router_replay='rollout': .* no mixture-of-experts router"):
        trainer(tiny_model_path)
    with pytest.raises(ValueError, match="GRPOConfig.router_replay='rollout': the completions come from a rollout"):
        trainer(qwen3_moe_path, rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="GRPOConfig.router_replay: the in-process vLLM engine runs its engine in"):
        VLLMColocateBackend(qwen3_moe_path, separate_process=True, record_routing=True)


# ---------------------------------------------------------------------------------------------- in-process vLLM
@pytest.mark.vllm
def test_vllm_engine_records_routing_and_replay_trains_in_stream_mode(qwen3_moe_path, tmp_path):
    """The in-process engine records each completion token's experts in its worker (float32: the HF model's own
    routing, request by request, in batched steps); a stream-mode run (groups joined into rounds) trains with
    replay: the training forward runs the recorded experts with perturbed routers."""
    t, watch = _train_watched(
        qwen3_moe_path, tmp_path, generation_backend="vllm", async_mode="stream", router_replay="rollout"
    )
    try:
        assert _training_forward_agreement(watch).all()
        model = _load(qwen3_moe_path)  # the weights pushed as version 0, before the first optimizer step
        checked = 0
        for mb, _ in watch.seen:
            for b in range(len(mb["advantages"])):
                # a row every token of which version 0 sampled (a stream round joins the groups that finish first:
                # the first step can train rows requested for the second round, and a later one rows of the first)
                c_mask = mb["completion_mask"][b].bool()
                versions = mb["token_version"][b][c_mask] if "token_version" in mb else mb["policy_version"][b]
                if int(versions.max()) != 0:
                    continue
                p = mb["prompt_ids"][b][mb["prompt_mask"][b].bool()].tolist()
                c = mb["completion_ids"][b][c_mask].tolist()
                r = mb["routed_experts"][b, : len(c)]
                assert routed(r).tolist() == [True] * (len(c) - 1) + [False]
                assert _same_sets(_own_routing(model, p, c)[:-1], r[:-1]).all()
                checked += 1
        assert checked > 0
        out = t.backend.generate(PROMPTS, SamplingConfig(n=2, max_tokens=4, seed=2))
        assert all(c.routed_experts is not None and c.routed_experts.shape[0] == len(c.completion_ids) for c in out)
    finally:
        t.close()
