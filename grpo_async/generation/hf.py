"""`HFBackend`: generation with `transformers.generate` on a private copy of the policy.

The copy is what makes background generation safe: the generator thread reads only the copy, the optimizer writes
only the trainer's model, and `load_weights` (called between rounds) copies the new weights over.

With `SamplingConfig.seed` set, sampling never touches torch's global RNG (which the trainer thread shares): a logits
processor (`SeededSampling`) applies the sampling filters (temperature, top-k, top-p, min-p, ...) and draws each
completion's token from its own `torch.Generator` (completion k of a call seeded `seed + k`), and `generate` runs in
greedy mode so that it picks exactly that token. A completion's tokens then depend on its seed, its prompt and the
weights only (up to the floating-point effects of its batch-mates' padding), not on when the thread ran.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import threading

import torch

from ..algo.router_replay import capture_routing, moe_layout, routing_dtype, unrouted
from ..algo.sampling_support import encode_support
from ..vision_processor import vision_placeholder_ids
from .base import Completion, GenerationAborted, SamplingConfig, check_completions

logger = logging.getLogger(__name__)

#: `GenerationConfig` fields that shape the sampling distribution (HF's "warpers"), in `generate`'s order
WARPER_FIELDS = ("temperature", "top_h", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


def sampling_warpers(params: dict, device=None):
    """HF's sampling warpers for `params` (a `GenerationConfig` field of `WARPER_FIELDS` → value; `None` or the
    neutral value: off), in `generate`'s order, as `generate(do_sample=True)` would build them."""
    from transformers.generation import logits_process as lp

    out = lp.LogitsProcessorList()
    get = params.get
    if get("temperature") is not None and get("temperature") != 1.0:
        out.append(lp.TemperatureLogitsWarper(get("temperature")))
    if get("top_h") is not None:
        out.append(lp.TopHLogitsWarper(top_h=get("top_h")))
    if get("top_k"):
        out.append(lp.TopKLogitsWarper(top_k=get("top_k")))
    if get("top_p") is not None and get("top_p") < 1.0:
        out.append(lp.TopPLogitsWarper(top_p=get("top_p")))
    if get("min_p"):
        out.append(lp.MinPLogitsWarper(min_p=get("min_p")))
    if get("typical_p") is not None and get("typical_p") < 1.0:
        out.append(lp.TypicalLogitsWarper(mass=get("typical_p")))
    if get("epsilon_cutoff") is not None and 0.0 < get("epsilon_cutoff") < 1.0:
        out.append(lp.EpsilonLogitsWarper(epsilon=get("epsilon_cutoff")))
    if get("eta_cutoff") is not None and 0.0 < get("eta_cutoff") < 1.0:
        out.append(lp.EtaLogitsWarper(epsilon=get("eta_cutoff"), device=device))
    return out


class SeededSampling:
    """A logits processor (the last one `generate` applies, with `do_sample=False`) that samples row i's next token
    from `warpers(scores)` with its own CPU generator seeded `seeds[i]` (inverse CDF of one uniform per row and step),
    records its log-probability, and returns scores that keep only that token, so greedy selection takes it.

    `logps` holds one `[b]` tensor per step: the sampled token's log-probability under the warped distribution (what
    `output_scores` would give), so the scores need not be kept; `kept` one list per step: each row's kept set
    (`algo.sampling_support.encode_support`, `None` where nothing was cut).
    """

    def __init__(self, warpers, seeds: list[int]):
        self.warpers = warpers
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]
        self.logps: list[torch.Tensor] = []
        self.kept: list[list[list[int] | None]] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"SeededSampling: {scores.shape[0]} rows but {len(self.generators)} seeds")
        scores = self.warpers(input_ids, scores)
        logp = torch.log_softmax(scores.float(), dim=-1)  # [b, V]
        u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])  # [b] in [0, 1)
        cdf = logp.double().exp().cumsum(-1)  # [b, V]
        target = ((1.0 - u).to(cdf.device) * cdf[:, -1]).unsqueeze(1)  # [b, 1] in (0, total]: never a 0-prob token
        tokens = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)  # [b, 1]
        self.logps.append(logp.gather(1, tokens).squeeze(1))
        self.kept.append(encode_support(torch.isfinite(logp)))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, tokens, 0.0)


class AbortCriteria:
    """A `StoppingCriteria` that ends every row of the `generate` call once `event` is set (`HFBackend.abort`)."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class HFBackend:
    """Generate with `model.generate` on a frozen copy of `model`.

    Args:
        model (`PreTrainedModel`): the base architecture (no PEFT wrapper); it is deep-copied, never used directly.
        tokenizer: pad/eos ids and stop strings come from it.
        batch_size (`int`, *optional*): prompts per `generate` call (all at once when `None`).
        record_routing (`bool`, *optional*, defaults to `False`): record the experts each generated token ran at
            every MoE layer (`Completion.routed_experts`, `GRPOConfig.router_replay`): a hook on the copy's routers
            (`algo.router_replay.capture_routing`) during `generate`, whose decode step `j` runs completion token
            `j - 1` (the last token is never run: `unrouted`).
    """

    #: `load_weights` takes the policy's own parameter names (it copies them into a model of the same class), not the
    #: checkpoint layout an engine loads (`GenerationBackend.load_weights`)
    runtime_weight_names = True
    #: `generate(..., images=)`: a vision-language model generates with each prompt's images (`PromptImages`)
    takes_images = True

    def __init__(self, model, tokenizer, batch_size: int | None = None, record_routing: bool = False):
        self.model = copy.deepcopy(model).eval()
        self.moe = None  # (num_experts, num MoE layers, top_k) when routing is recorded
        if record_routing:
            self.moe = moe_layout(self.model)
            if self.moe is None:
                raise ValueError(
                    f"GRPOConfig.router_replay: {type(self.model).__name__} is not a mixture-of-experts model: "
                    "there is no routing to record (set router_replay='off')"
                )
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.version = 0
        self.completions_generated = 0  # every completion `generate` returned (its own count: tests, metrics)
        self._lock = threading.Lock()
        self._aborted = threading.Event()
        eos = self.model.generation_config.eos_token_id
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        #: a VLM's image / video placeholder tokens, never sampled (`vision_processor.vision_placeholder_ids`)
        self.placeholder_ids = vision_placeholder_ids(self.model.config)
        # On a GPU the engine issues its kernels on a CUDA stream of its own: on the trainer's (the default) stream,
        # generation in the background thread and the training step would queue behind each other on the device
        device = next(self.model.parameters()).device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _on_own_stream(self):
        """A context that runs the engine's kernels on its own stream, after the work the caller queued so far."""
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)

    @torch.no_grad()
    def load_weights(self, groups, version: int) -> None:
        """Copy `(module, [(hf_name, tensor), ...])` groups into the generation copy, one group at a time."""
        with self._lock, self._on_own_stream():
            self._load(groups)
            if self._stream is not None:
                self._stream.synchronize()  # the caller may free or overwrite the tensors it handed over
            self.version = version

    def _load(self, groups) -> None:
        params = dict(self.model.named_parameters())
        for _, tensors in groups:
            unknown = [k for k, _ in tensors if k not in params]
            if unknown:
                raise KeyError(f"HFBackend.load_weights: unknown parameter names {unknown[:5]}")
            for name, tensor in tensors:
                params[name].copy_(tensor.to(params[name].device, params[name].dtype))

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, images=None) -> list[Completion]:
        """`images[i]` (`PromptImages` or None): prompt i's images, for a vision-language model."""
        with self._lock, self._on_own_stream():
            out: list[Completion] = []
            step = self.batch_size or len(prompt_ids)
            for start in range(0, len(prompt_ids), step):  # seeded: the chunk's first prompt is prompt `start`
                self._check_aborted()
                chunk_images = images[start : start + step] if images is not None else None
                out.extend(
                    self._generate_chunk(prompt_ids[start : start + step], sampling.for_prompt(start), chunk_images)
                )
                self._check_aborted()  # the chunk stopped early: its completions are cut, never returned
            out = check_completions(out, len(prompt_ids), sampling.n, "HFBackend")
            self.completions_generated += len(out)
            return out

    def abort(self) -> None:
        """End the `generate` call in progress at its next token (another thread may call it); `generate` raises
        `GenerationAborted` until `resume()`."""
        self._aborted.set()

    def resume(self) -> None:
        self._aborted.clear()

    def _check_aborted(self) -> None:
        if self._aborted.is_set():
            raise GenerationAborted("HFBackend: generation aborted (shutting down)")

    def _generate_chunk(self, prompt_ids: list[list[int]], s: SamplingConfig, images=None) -> list[Completion]:
        pad = self.tokenizer.pad_token_id
        device = next(self.model.parameters()).device
        P = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), P), pad, dtype=torch.long)  # [b, P] left-padded
        attention_mask = torch.zeros((len(prompt_ids), P), dtype=torch.long)  # [b, P]
        for i, p in enumerate(prompt_ids):
            input_ids[i, P - len(p) :] = torch.tensor(p)
            attention_mask[i, P - len(p) :] = 1
        kwargs = dict(
            do_sample=True,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else None,
            min_p=s.min_p if s.min_p > 0 else None,
            max_new_tokens=s.max_tokens,
            num_return_sequences=s.n,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
            eos_token_id=sorted(self.eos_ids),
            synced_gpus=False,  # one process generates on its private copy (the default syncs ranks under ZeRO-3)
        )
        greedy = s.temperature == 0  # vLLM's meaning: the most likely token (log-probs then those of T = 1)
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None, min_p=None)
        if s.stop:
            kwargs.update(stop_strings=s.stop, tokenizer=self.tokenizer)
        if s.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = s.repetition_penalty
        extra = dict(s.extra or {})  # generation_kwargs: GenerationConfig fields
        sampler = None
        if not greedy and s.seed is not None and extra.get("do_sample", True) and extra.get("num_beams") in (None, 1):
            from transformers import LogitsProcessorList

            extra.pop("do_sample", None)
            params = {k: kwargs.pop(k) for k in ("temperature", "top_p", "top_k", "min_p")}
            params.update({k: extra.pop(k) for k in WARPER_FIELDS if k in extra})
            seeds = [s.seed + k for k in range(len(prompt_ids) * s.n)]  # output row k: prompt k // n, sample k % n
            sampler = SeededSampling(sampling_warpers(params, device), seeds)
            kwargs.update(do_sample=False, output_scores=False, logits_processor=LogitsProcessorList([sampler]))
            kwargs.update(temperature=None, top_p=None, top_k=None, min_p=None)  # greedy: the model's defaults unused
        # as TRL: one sequence per repeated row (each prompt n times, prompt-major), so generation_kwargs apply per
        # row (num_beams=2 gives each row its best beam; greedy decoding refuses num_return_sequences > 1)
        kwargs["num_return_sequences"] = 1
        input_ids, attention_mask = input_ids.repeat_interleave(s.n, 0), attention_mask.repeat_interleave(s.n, 0)
        if self.placeholder_ids:  # a VLM: no image token in a completion (it would be taken for an image)
            kwargs["suppress_tokens"] = self.placeholder_ids
        if images is not None and any(m is not None for m in images):  # a VLM: each row's own images, token types
            from ..algo.vision import VisionRows

            per_prompt = [None if m is None else m.inputs for m in images]
            rows = VisionRows.from_prompts(per_prompt, [len(p) for p in prompt_ids])
            rows = rows.select(torch.arange(len(prompt_ids)).repeat_interleave(s.n))  # [b*n] as the ids
            kwargs.update({k: v.to(device) for k, v in rows.model_inputs(0, P).items()})
            if extra.get("num_beams") not in (None, 1):  # beams are scored again by `_score`, which has no images
                raise ValueError(
                    f"generation_kwargs num_beams={extra['num_beams']}: the hf backend scores beam-searched sequences "
                    "again without their images; sample (num_beams 1) with a vision-language model"
                )
        kwargs.update(extra)
        from transformers import StoppingCriteriaList

        kwargs["stopping_criteria"] = StoppingCriteriaList(
            [*kwargs.get("stopping_criteria", []), AbortCriteria(self._aborted)]
        )
        if self.moe is not None and kwargs.get("num_beams") not in (None, 1):
            raise ValueError(
                "GRPOConfig.router_replay: the hf backend records one routing per sampled row, but "
                f"generation_kwargs num_beams={kwargs['num_beams']} runs beams that are reordered and dropped; "
                "set router_replay='off' or drop num_beams"
            )
        cache = None
        if self._shares_prompt_prefill(s.n, P, images, kwargs):
            cache = self._prompt_cache(input_ids[:: s.n], attention_mask[:: s.n], s.n, device)
        if cache is not None:
            kwargs["past_key_values"] = cache
        recording = capture_routing(self.model) if self.moe is not None else contextlib.nullcontext()
        with recording as calls:
            gen = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **kwargs
            )
        sequences = gen if isinstance(gen, torch.Tensor) else gen.sequences  # a custom generate may return a tensor
        seqs = sequences[:, P:].cpu()  # [b*n, T]
        routing = None if calls is None else self._routing(calls, seqs.shape[0], P, seqs.shape[1])  # [b*n,T,L,k]
        scores = None if isinstance(gen, torch.Tensor) else getattr(gen, "scores", None)
        kept = None  # per step, per row: the sampler's kept set (None: the sampler is unknown, e.g. beam search)
        if sampler is not None and len(sampler.logps) >= seqs.shape[1]:  # the sampled tokens' logprobs, step by step
            token_logps = torch.stack(sampler.logps[: seqs.shape[1]], dim=1).cpu()  # [b*n, T]
            kept = sampler.kept[: seqs.shape[1]]
        elif scores and scores[0].shape[0] == seqs.shape[0] and kwargs.get("num_beams") in (None, 1):
            # scores: processed (temperature / top-k / top-p) logits of each step, [b*n, V] per step
            logps = torch.stack([torch.log_softmax(sc.float(), dim=-1) for sc in scores], dim=1).cpu()
            token_logps = logps.gather(-1, seqs.unsqueeze(-1)).squeeze(-1)  # [b*n, T]
            kept = [encode_support(torch.isfinite(sc)) for sc in scores]
        else:  # beam search, no per-row scores, or a custom `generate` (e.g. a test's patched `model.generate`)
            # that never ran the seeded sampler: the copy scores its own sequences (temperature applied)
            token_logps = self._score(sequences, attention_mask.to(device), P, s.temperature)  # [b*n, T]
        completions = []
        for k, (row, lp) in enumerate(zip(seqs.tolist(), token_logps.tolist(), strict=True)):
            end = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), None)
            reason = "stop" if end is not None else "length"
            if end is None:
                end = len(row)
                # stop strings end generation without EOS: trim trailing padding
                while end > 0 and row[end - 1] == pad and pad not in self.eos_ids:
                    end -= 1
                if end < s.max_tokens:
                    reason = "stop"
            mask = None if kept is None else [step[k] for step in kept[:end]]  # [T_k] the row's kept sets
            completions.append(
                Completion(
                    completion_ids=row[:end],
                    logprobs=lp[:end],
                    finish_reason=reason,
                    sampling_mask=mask,
                    routed_experts=None if routing is None else routing[k, :end].clone(),  # [T_k, L, k]
                )
            )
        return completions

    def _shares_prompt_prefill(self, n: int, P: int, images, kwargs: dict) -> bool:
        """Whether a call's `n` rows per prompt can share one prefill of their prompt (`_prompt_cache`): n > 1, a
        prompt of 2 tokens or more, HF's own `generate` with its dynamic KV cache (no custom `generate`, no cache of
        the user's, no beams), no images and no router recording (both read the prefill's per-row calls)."""
        from transformers import GenerationMixin

        own_generate = "generate" not in vars(self.model) and type(self.model).generate is GenerationMixin.generate
        return (
            n > 1
            and P > 1
            and own_generate
            and not self.model.config.is_encoder_decoder
            and kwargs.get("use_cache", self.model.generation_config.use_cache) is not False
            and self.moe is None
            and (images is None or all(m is None for m in images))
            and kwargs.get("num_beams") in (None, 1)
            and not kwargs.get("past_key_values")
            and kwargs.get("cache_implementation") in (None, "dynamic")
        )

    def _prompt_cache(self, prompt_ids: torch.Tensor, mask: torch.Tensor, n: int, device):
        """The KV cache of `prompt_ids [b, P]` (left-padded, `mask [b, P]`) but their last token, computed once per
        prompt and repeated for its `n` rows (`[b*n, P-1]` of keys and values per layer): `generate` then runs only
        each row's last prompt token and its completion. The prefill costs as many rows as prompts instead of
        `b*n` (on a CPU, a round of 8 samples of one 45-token prompt spent ~1 s of its ~5 s there; decoding 8 rows
        costs about what 1 row does: the weights' memory traffic, not the rows, sets its time). None for a model
        whose cache holds other than key/value layers (linear attention, ...): `generate` prefills every row then."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        cache = DynamicCache(config=self.model.config)
        if any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
            return None
        ids, mask = prompt_ids[:, :-1].to(device), mask[:, :-1].to(device)  # [b, P-1]
        position_ids = (mask.cumsum(-1) - 1).clamp_(min=0)  # [b, P-1] as `generate` numbers a left-padded prompt
        # only the last position's logits (they are not used; the LM head over every position would cost the most)
        last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, **last)
        cache.batch_repeat_interleave(n)  # [b*n, heads, P-1, head_dim] per layer, prompt-major as the rows
        return cache

    def _routing(self, calls: list[list[torch.Tensor]], rows: int, P: int, T: int) -> torch.Tensor:
        """`[rows, T, L, k]` the experts of each row's completion tokens, from the routers' calls during `generate`:
        call 0 the prefill (`rows × P` prompt tokens), call `j ≥ 1` one decode step (`rows` tokens: completion token
        `j - 1`); the last token was never run (`unrouted`). A `RuntimeError` when the calls are not laid out so."""
        num_experts, layers, top_k = self.moe
        dtype = routing_dtype(num_experts)
        out = torch.full((rows, T, layers, top_k), unrouted(dtype), dtype=dtype)
        steps = calls[1:T]  # decode step j ran completion token j - 1
        shapes = [tuple(t.shape) for call in calls[:T] for t in call]
        expected = [(rows * P, top_k)] * layers + [(rows, top_k)] * (len(steps) * layers)
        if not calls or len(calls[0]) != layers or shapes != expected or len(steps) < T - 1:
            raise RuntimeError(
                f"router replay: the hf backend's generate ran its routers {len(calls)} times with shapes "
                f"{shapes[: 2 * layers]}..., not one prefill of {rows}x{P} tokens then one token per row per step "
                f"for {T} tokens: its routing cannot be recorded (a custom generate or decoding strategy?)"
            )
        if steps:
            out[:, : len(steps)] = torch.stack([torch.stack(call, 1) for call in steps], 1).to(dtype).cpu()
        return out

    def _score(self, sequences: torch.Tensor, prompt_mask: torch.Tensor, P: int, temperature: float) -> torch.Tensor:
        """Log-probabilities `[b, T]` of the completion tokens `sequences[:, P:]` under the copy, logits divided by
        `temperature` (tokens after a row's end are scored too and cut by the caller)."""
        from ..algo.logprobs import selective_log_softmax

        mask = torch.cat([prompt_mask, torch.ones_like(sequences[:, P:])], dim=1)  # [b, P+T]
        T = sequences.shape[1] - P
        # only the T positions that predict a completion token: the logits of a long prompt times a large vocabulary
        # (Qwen3's 151,936) would be the largest tensor of the run
        takes_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        keep = {"logits_to_keep": T + 1} if takes_keep else {}
        logits = self.model(input_ids=sequences, attention_mask=mask, **keep).logits[:, -(T + 1) : -1].float()
        return selective_log_softmax(logits / (temperature or 1.0), sequences[:, P:]).cpu()

    def close(self) -> None:
        """Drop the generation copy (idempotent); a `generate` call in progress is aborted."""
        self._aborted.set()
        with self._lock:
            self.model = None
