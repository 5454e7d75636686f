"""Imported first by `warm_launch`'s fork server (its `PRELOAD`): the preload's imports (torch, transformers, vLLM,
trl, ...: ~700k objects, every one long-lived) run with the garbage collector off. Its automatic collections walked
that growing heap again and again: ~25% of the imports' CPU (`import torch, transformers, accelerate, vllm, trl`:
11.1-12.1 user CPU-s with the collector, 8.2-8.9 without). `support.frozen_heap`, imported last, runs one full
collection, freezes what survives and turns the collector back on; the test workers do the same around their
collection (`tests/conftest.py`)."""

import gc

gc.disable()
