"""Imported last by `warm_launch`'s fork server (its `PRELOAD`): moves every object the preload created into the
garbage collector's permanent generation (`gc.freeze()`), as CPython's documentation advises before forking without
exec.

Each process forked from that server is a fresh interpreter's stand-in that already holds ~700k objects from torch,
transformers and vLLM. Without the freeze every full collection in a fork walks them all: ~0.5 CPU-s each, and vLLM
runs four while an engine starts (`gc.collect()` twice in its model loader, `freeze_gc_heap()` in the engine core and
in the API server), ~2 of the ~4 CPU-s a forked test server takes to be ready. Frozen, they are skipped; a fork's
own objects are collected as before (what the preload made is never garbage: modules and what they hold). The walk
also wrote to each object's header, which made the fork copy those memory pages.

The freeze holds for the server's and its children's lives: vLLM's own `gc.freeze` (an engine's start) and
`gc.unfreeze` (its shutdown, followed by full collections) do nothing here (as in a test worker: `tests/conftest.py`),
so an engine's objects stay in the ordinary generations and its shutdown's collections walk only the fork's own.

The collector was off while the preload imported (`support.collector_off`, imported first): on again from here.
"""

import gc

gc.collect()
gc.freeze()
gc.enable()


def _kept_frozen() -> None:
    """`gc.freeze` / `gc.unfreeze` in this process and its forks: nothing, the preload stays frozen."""


gc.freeze = gc.unfreeze = _kept_frozen
