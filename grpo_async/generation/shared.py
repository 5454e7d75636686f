"""`SharedBackend`: the one generation backend of a run, built on first use, used by one caller at a time.

Three collaborators use it on the process that generates (the main process, or with an engine on every rank each
rank: `pipeline/build.py`): the round producer (generator thread) generates, the policy publisher
(trainer thread) loads new weights, evaluation generates. `lock` makes each use atomic, so a round never sees its
weights change under it.

Example:
    >>> shared = SharedBackend(lambda: HFBackend(model, tokenizer))   # doctest: +SKIP
    >>> with shared.lock:  # doctest: +SKIP
    ...     completions = shared.get().generate(prompt_ids, sampling)
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable

from .base import GenerationBackend


class SharedBackend:
    """Builds the backend lazily with `factory()` and holds it until `close()`.

    Args:
        factory (`Callable[[], GenerationBackend]`): builds the backend (called at most once per `close`). It may
            return `(backend, folder)`: a temporary folder the backend reads (a saved model), deleted at `close`.
    """

    def __init__(self, factory: Callable[[], GenerationBackend | tuple[GenerationBackend, str | None]]):
        self._factory = factory
        self._backend: GenerationBackend | None = None
        self._folder: str | None = None
        self.lock = threading.RLock()

    def get(self) -> GenerationBackend:
        with self.lock:
            if self._backend is None:
                built = self._factory()
                self._backend, self._folder = built if isinstance(built, tuple) else (built, None)
            return self._backend

    @property
    def built(self) -> GenerationBackend | None:
        """The backend if it has been built, else None (never builds)."""
        return self._backend

    @property
    def version(self) -> int | None:
        """The policy version the backend holds (None before it is built or received weights)."""
        return getattr(self._backend, "version", None)

    def abort(self) -> None:
        """Interrupt the `generate` call in progress, if the backend can (`GenerationBackend.abort`); called from
        another thread, without the lock (the generating thread holds it)."""
        backend = self._backend
        if backend is not None and hasattr(backend, "abort"):
            backend.abort()

    def resume(self) -> None:
        """Undo `abort`: the backend generates again."""
        backend = self._backend
        if backend is not None and hasattr(backend, "resume"):
            backend.resume()

    def close(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def forget(self) -> None:
        """Drop the backend without closing it (a thread may still be using it; the process exit cleans up)."""
        self._backend = None
