"""The backend registry: one `BackendSpec` per generation backend, the only place that says what a backend is and can
do. The config rules (transports, stream mode), the pipeline's wiring (an engine per rank) and `make_backend` all read
it; a backend added with `register_backend` is a first-class one (it may declare that it streams, or that its engine
lives in the training process)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..weight_sync.names import SYNC_SETTINGS


@dataclass(frozen=True)
class BackendSpec:
    """What a generation backend is and can do.

    - `name`: the `GRPOConfig.generation_backend` value.
    - `factory(args, unwrapped_model, tokenizer, model_path) -> GenerationBackend`: builds it. `model_path` is a
      folder (or hub id) holding the policy's architecture, initial weights and tokenizer, for engines that load a
      model themselves; the trainer pushes its current weights before the first round anyway.
    - `weight_sync`: the `weight_sync_transport` values it takes (with `"auto"` the policy publisher streams the
      weights into its `load_weights`; with `"none"` the sampler keeps its initial weights); `why`: the reason it
      takes only those (the config's error quotes it).
    - `in_process`: its engine lives in the training process, so with several processes every rank builds its own
      (when each rank's rows are whole groups) instead of the main process generating for all.
    - `streams`: it takes concurrent `generate` calls, one per prompt group, so `async_mode="stream"` can use it (a
      backend with a `start_streaming()` method has it called once before the first group).
    - `delta`: it takes delta pushes (`GRPOConfig.weight_sync_delta`, `weight_sync.delta`): its factory passes
      `args.weight_sync_delta` on and honours it.
    - `runs_on_caller`: its `generate` computes on the calling thread (no engine thread or process of its own), so
      a round the trainer waits for right away is generated on the trainer's thread (rounds mode:
      `AsyncBatchGenerator.submit_batch(inline=True)`), where torch's OpenMP regions run faster on a CPU.
    - `records_routing`: with `GRPOConfig.router_replay` on, its completions carry the experts its sampler routed
      each token to (`Completion.routed_experts`): its factory reads `args.router_replay` and records them.
    """

    name: str
    factory: Callable
    weight_sync: tuple[str, ...] = ("auto", "none")
    why: str = ""
    in_process: bool = False
    streams: bool = False
    delta: bool = False
    records_routing: bool = False
    runs_on_caller: bool = False

    def __post_init__(self):
        unknown = [t for t in self.weight_sync if t not in SYNC_SETTINGS]
        if not isinstance(self.name, str) or not self.name or not callable(self.factory):
            raise ValueError(f"BackendSpec: name must be a non-empty str and factory callable; got {self!r}")
        if unknown or not self.weight_sync:
            raise ValueError(
                f"BackendSpec({self.name!r}): weight_sync must be a non-empty tuple of {SYNC_SETTINGS}; "
                f"got {self.weight_sync!r}"
            )
        object.__setattr__(self, "weight_sync", tuple(self.weight_sync))
        if not self.why:
            object.__setattr__(self, "why", f"registered with weight_sync={self.weight_sync}")


_SPECS: dict[str, BackendSpec] = {}


def register_backend(
    spec: BackendSpec | str,
    factory: Callable | None = None,
    weight_sync: tuple[str, ...] = ("auto", "none"),
    *,
    streams: bool = False,
    in_process: bool = False,
) -> BackendSpec:
    """Add (or replace) a backend, usable as `GRPOConfig(generation_backend=name)`: a `BackendSpec`, or its fields
    (`register_backend(name, factory, weight_sync, streams=..., in_process=...)`). Returns the spec."""
    if not isinstance(spec, BackendSpec):
        spec = BackendSpec(spec, factory, tuple(weight_sync), streams=streams, in_process=in_process)
    elif factory is not None:
        raise TypeError("register_backend(spec): pass a BackendSpec alone, or a name and its factory")
    _SPECS[spec.name] = spec
    return spec


def unregister_backend(name: str) -> None:
    """Remove a registered backend (a test's cleanup); unknown names are ignored."""
    _SPECS.pop(name, None)


def backend_spec(name: str) -> BackendSpec:
    """The spec of backend `name`; a clear error naming the registered ones if there is none."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(
            f"generation_backend {name!r} is not available; registered: {sorted(_SPECS)} "
            "(grpo_async.generation.register_backend adds one)"
        ) from None


def registered_backends() -> tuple[str, ...]:
    """The names `GRPOConfig.generation_backend` accepts now: the built-ins and `register_backend`'s."""
    return tuple(_SPECS)
