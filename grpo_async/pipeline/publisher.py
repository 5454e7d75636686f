"""`PolicyPublisher`: streams the live policy's weights into the sampler; owns the published policy version.

The policy version is the optimizer step that produced the weights (`Trainer.state.global_step`), the pipeline's one
clock: a round records the version its sampler held, staleness is `step trained at − version sampled with`.

Publishing never stages a copy of the model: `iter_full_params` yields the parameters module group by module group
straight from the live model (ZeRO-3 gathers one group at a time, PEFT adapters are merged for the duration, FSDP2
`full_tensor()`s), and the backend's `load_weights` packs each bucket into its transport before asking for the next
group. Device tensors stay on their device (NCCL broadcast and CUDA IPC pack on the GPU). The trainer holds about one
bucket beyond the model.

```txt
rank 0 (main)   wait until no round runs ─▶ load_weights(groups) ─▶ bucket ─▶ transport ─▶ bucket ─▶ ... ─▶ end(v)
rank 1..N-1                                 iterate groups (take part in ZeRO-3 / FSDP2 gathers), send nothing
```
With an engine on every rank (`hf`, in-process `vllm`, several processes: `build.generates_on_every_rank`) every
rank's publisher holds its own engine and loads its own model's weights into it, as rank 0 does above: no weights
cross processes (under ZeRO-3 / FSDP2 the gathers still run on every rank, group by group).

With a PEFT LoRA policy and `adapter=True` (`GRPOConfig.vllm_lora_sync` resolved by
`weight_sync.lora.lora_sync_mode`), a publish sends only the adapter's `lora_A` / `lora_B` tensors and its config
(`backend.load_adapter`): nothing is merged, the sampler's base weights never move. `last` records what the latest
publish sent (`{"mode", "tensors", "bytes", "seconds"}`), on the main process.

Where a round in flight must finish on the old weights, the caller (`RoundScheduler.publish`) waits for it before
publishing (`due(version)` says a publish will send); with `inflight=True` (servers) it does not wait, and the server
freezes its running requests around the load instead.

Example:
    >>> publisher = PolicyPublisher(shared_backend)   # doctest: +SKIP
    >>> publisher.publish(model, version=trainer.state.global_step)  # doctest: +SKIP
    0.12
"""

from __future__ import annotations

import contextlib
import time

from torch import nn

from ..generation.shared import SharedBackend
from ..weight_sync.collect import iter_full_params
from ..weight_sync.lora import adapter_config, iter_adapter_params, lora_sync_mode

__all__ = ["PolicyPublisher", "lora_sync_mode"]


class PolicyPublisher:
    """Publishes weights when the policy version changes.

    Args:
        backend (`SharedBackend` or `None`): the sampler of this process (the main process's, or with an engine on
            every rank each rank's own); `None` on a process without one (it only takes part in the collectives of
            gathering the parameters).
        enabled (`bool`, *optional*, defaults to `True`): `False` when the sampler never receives weights
            (`weight_sync_transport="none"`, a generation-only endpoint): `publish` does nothing.
        inflight (`bool`, *optional*, defaults to `False`): the backend loads while rounds run (servers freeze
            them), so the caller need not wait for the rounds in flight.
        adapter (`bool`, *optional*, defaults to `False`): send only the PEFT LoRA adapter (`backend.load_adapter`)
            instead of the merged full weights; every process must pass the same value.
    """

    def __init__(
        self,
        backend: SharedBackend | None,
        *,
        enabled: bool = True,
        inflight: bool = False,
        adapter: bool = False,
    ):
        self.backend = backend
        self.enabled = enabled
        self.inflight = inflight
        self.adapter = adapter
        self.published: int | None = None  # the version last published (tracked on every rank)
        self.last: dict | None = None  # what the latest publish sent: {"mode", "tensors", "bytes", "seconds"}

    def due(self, version: int) -> bool:
        """Whether `publish(model, version)` would send weights (enabled, and `version` not yet published)."""
        return self.enabled and self.published != version

    def publish(self, model: nn.Module, version: int) -> float:
        """Every process calls this at the same point; returns the seconds the publish took (0 when nothing to do)."""
        if not self.due(version):
            return 0.0
        start = time.perf_counter()
        sent = {"mode": "adapter" if self.adapter else "full", "tensors": 0, "bytes": 0}
        if self.backend is None:
            for _ in self._groups(model, sent, None):  # take part in the gathers; the main process sends
                pass
        else:
            try:
                with contextlib.nullcontext() if self.inflight else self.backend.lock:
                    backend = self.backend.get()
                    groups = self._groups(model, sent, backend)
                    if self.adapter:
                        if not hasattr(backend, "load_adapter"):
                            raise TypeError(
                                f"{type(backend).__name__} cannot take a LoRA adapter (no load_adapter); "
                                "set GRPOConfig.vllm_lora_sync='merged'"
                            )
                        backend.load_adapter(groups, adapter_config(model), version)
                    else:
                        backend.load_weights(groups, version)
            except KeyboardInterrupt:
                # a push cut off mid-way may leave a server stuck in a reload session or a process group half-used:
                # the backend is left to the process's exit instead of being closed (and waited on) by the caller
                self.backend.forget()
                raise
        self.published = version
        self.last = {**sent, "seconds": time.perf_counter() - start}
        return self.last["seconds"]

    def _groups(self, model: nn.Module, sent: dict, backend):
        """The groups a publish sends to `backend` (None: nobody, this process only takes part in the gathers): an
        engine takes the checkpoint's names and layout (`iter_full_params`: an MoE model's experts one tensor per
        expert), a backend that says `runtime_weight_names = True` (`HFBackend`: an HF model of the same class) the
        model's own parameter names."""
        if self.adapter:
            return self._counted(iter_adapter_params(model), sent)
        checkpoint = backend is not None and not getattr(backend, "runtime_weight_names", False)
        return self._counted(iter_full_params(model, checkpoint_layout=checkpoint), sent)

    @staticmethod
    def _counted(groups, sent: dict):
        for module, tensors in groups:
            sent["tensors"] += len(tensors)
            sent["bytes"] += sum(t.numel() * t.element_size() for _, t in tensors)
            yield module, tensors

    def reset(self) -> None:
        """Forget what was published (a new backend, a resumed run): the next `publish` sends again."""
        self.published = None
