"""Imported first by `warm_launch`'s fork server (its `PRELOAD`): the preload's imports (torch, transformers, vLLM,
trl, ...: ~700k objects, every one long-lived) run with the garbage collector off, whose automatic collections would
walk that growing heap again and again (what it costs: `grpo_async.gc_tuning`, which pauses it the same way around
the product's own entry points). `support.frozen_heap`, imported last, runs one full collection, freezes what
survives and turns the collector back on; the test workers do the same around their collection
(`tests/conftest.py`)."""

import gc

gc.disable()
