"""`grpo_async.gc_tuning`: heavy imports with the garbage collector paused, and the heap frozen before an in-process
vLLM engine loads (so the loader's full collections walk only what it makes)."""

import gc
import sys

import pytest

import grpo_async
from grpo_async.gc_tuning import collector_paused, import_module


def test_the_collector_is_off_in_the_block_and_as_it_was_after():
    assert gc.isenabled()  # a worker's collector is on once its collection is over (tests/conftest.py)
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner block leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("an import that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled(), "a process that turned the collector off keeps it off"
    finally:
        gc.enable()


def test_a_module_is_imported_with_the_collector_off(tmp_path, monkeypatch):
    (tmp_path / "gc_probe_module.py").write_text("import gc\nENABLED_DURING_IMPORT = gc.isenabled()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gc_probe_module", raising=False)
    module = import_module("gc_probe_module")
    assert module.ENABLED_DURING_IMPORT is False
    assert gc.isenabled()


def test_the_packages_public_names_are_imported_through_it(monkeypatch):
    calls = []

    def recording(name, package=None):
        calls.append((name, package))
        return import_module(name, package)

    monkeypatch.setattr(grpo_async, "import_module", recording)
    monkeypatch.delitem(grpo_async.__dict__, "RepeatSampler", raising=False)  # imported once, then a global
    from grpo_async import RepeatSampler
    from grpo_async.data.sampler import RepeatSampler as defined

    assert RepeatSampler is defined and calls == [(".data.sampler", "grpo_async")]


@pytest.mark.vllm
def test_the_colocated_engine_freezes_the_heap_before_vllms_loader_collects(tiny_model_path, monkeypatch):
    """vLLM's model loader runs full collections (`gc.collect()`, twice) as the engine loads; by then everything the
    trainer's process held is in the permanent generation (`gc.freeze`), so they walk only what the load makes."""
    from grpo_async.generation.vllm_colocate import VLLMColocateBackend

    events = []
    collect, freeze = gc.collect, gc.freeze  # a worker's `gc.freeze` does nothing (its heap stays frozen)

    def recording_collect(*generation):
        caller = sys._getframe(1)
        events.append(("collect", caller.f_code.co_filename.rsplit("/", 1)[-1], generation))
        return collect(*generation)

    def recording_freeze():
        events.append(("freeze",))
        freeze()

    monkeypatch.setattr(gc, "collect", recording_collect)
    monkeypatch.setattr(gc, "freeze", recording_freeze)
    backend = VLLMColocateBackend(tiny_model_path, max_model_len=256)
    try:
        loader = [i for i, e in enumerate(events) if e[:2] == ("collect", "base_loader.py")]
        assert loader, f"vLLM's model loader collected nothing: {events}"
        ours = events.index(("freeze",))
        assert ours < loader[0], events
        assert events[ours - 1] == ("collect", "gc_tuning.py", ()), "a full collection first: no garbage frozen"
    finally:
        backend.close()
