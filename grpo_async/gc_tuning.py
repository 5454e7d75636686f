"""Python's garbage collector around the two moments it walks a trainer's whole heap for nothing.

A process that imports torch, transformers, accelerate, trl and vLLM holds ~700k objects, all long-lived (modules,
classes, functions and what they hold). A full collection walks every one: ~0.7-0.8 CPU-s on this machine.

- **Importing that stack**: while the objects are created, the collector's automatic collections walk the growing
  heap again and again, ~25% of the imports' CPU (`python -c "import torch, transformers, accelerate, vllm, trl,
  grpo_async.trainer"`, ending in `os._exit`: 11.1-12.1 user CPU-s with the collector, 8.2-8.9 with `gc.disable()`
  first; `from grpo_async import GRPOTrainer, GRPOConfig` through this module: 9.4-9.9 -> 8.2-8.6; 2-3 alternated
  runs each, at be34e99, 2026-11-30). `grpo_async`'s entry points (its lazy public names, the trainer's first import
  of vLLM, `grpo-async serve`) import with the collector paused (`collector_paused`, `import_module`): nothing is
  lost, garbage made meanwhile is collected by the next collection, and a process that had turned the collector off
  keeps it off.
- **Starting an in-process vLLM engine**: vLLM runs three full collections as it loads the model (`gc.collect()`
  twice in its model loader, then `freeze_gc_heap`, which freezes the heap into the collector's permanent
  generation for the engine's life). `freeze_for_engine` runs one full collection and freezes first, so those three
  walk only what the load creates (a fresh interpreter's `VLLMColocateBackend(tiny model)`: its start's collections
  2.44 -> 0.80 CPU-s, timed by wrapping `gc.collect`, at be34e99, 2026-11-30). vLLM would freeze the same objects
  moments later; its shutdown unfreezes them (`gc.unfreeze()`) as before.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with automatic garbage collection off; on again after it, if it was on before."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def import_module(name: str, package: str | None = None) -> ModuleType:
    """`importlib.import_module(name, package)` with the collector paused (`collector_paused`)."""
    with collector_paused():
        return importlib.import_module(name, package)


def freeze_for_engine() -> None:
    """Before an in-process vLLM engine loads: one full collection, then everything alive into the permanent
    generation (`gc.freeze()`, what vLLM's `freeze_gc_heap` does once the engine is up), so the collections vLLM
    runs while loading walk only the new objects."""
    gc.collect()
    gc.freeze()
