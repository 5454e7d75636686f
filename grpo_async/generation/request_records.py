"""What an in-process vLLM engine's worker records per request while it steps (the sampler's kept sets, the experts
the router chose), held until the caller takes a finished completion's record: the store both recorders share.

vLLM keys a request internally as `"<id>-<suffix>"` (a request with `n > 1`: `"<index>_<id>-<suffix>"`); the caller
knows `<id>` (and `<index>`). Thread-safe: the engine steps in one thread, completions are taken in another.
"""

from __future__ import annotations

import threading
from typing import Any


class RequestRecords:
    """Records by vLLM's internal request id: `_add` from the worker side, `_pop` from the caller's."""

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: dict[str, list[Any]] = {}  # internal id → the records of its steps, in step order

    def _add(self, rows) -> None:
        """Append each `(internal id, record)` of `rows` to its request's records."""
        with self._lock:
            for rid, record in rows:
                self._seen.setdefault(rid, []).append(record)

    def _pop(self, request_id: str, index: int | None) -> tuple[str, list[list[Any]]]:
        """Removes and returns the records of every internal id of request `request_id` (sample `index` of a request
        with `n > 1`), with the request's name as errors should say it; the caller decides how many may match."""
        prefix = request_id if index is None else f"{index}_{request_id}"
        with self._lock:
            keys = [k for k in self._seen if k.rsplit("-", 1)[0] == prefix]
            return prefix, [self._seen.pop(k) for k in keys]

    def discard(self, request_ids) -> None:
        """Forget the records of requests that end without a completion (aborted)."""
        ids = set(request_ids)
        with self._lock:
            for k in [k for k in self._seen if k.rsplit("-", 1)[0] in ids]:
                del self._seen[k]

    def clear(self) -> None:
        """Forget every record (no request of the engine is running)."""
        with self._lock:
            self._seen.clear()

    def pending(self) -> int:
        """Requests recorded and not taken yet."""
        with self._lock:
            return len(self._seen)
