"""The weight-reload session of one `grpo-async serve`, as its `/ws/update` route sees it (the API process side).

A push is a session: its first request (`begin`) opens it and gets an id back, the following ones carry that id, the
last one (`end`) loads the staged push (generation is paused for that request only) or an `abort` drops it.

```
trainer A:  begin ──▶ id=a1   bucket(a1)   bucket(a1)   ✗ killed
                                                        │ idle ─────────────▶ /health 503 at idle_timeout/2,
trainer B:                                  begin ──▶ id=b1 (a1 aborted)      dropped at idle_timeout
                                                        bucket(b1) ... end(b1) ──▶ loaded, version v
trainer A': bucket(a1) ──▶ 409 (a1 is gone: it never mixes into b1)
```

Without ids (older clients) a request joins whatever session is open.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass, field

logger = logging.getLogger("grpo_async.serve")

#: `--reload-idle-timeout` default: seconds a push may go without a request before the server drops it
RELOAD_IDLE_TIMEOUT_S = 60.0


@dataclass
class ReloadSession:
    """One open push: `id` (answered at `begin`), when it opened and when its last request ended."""

    id: str
    opened: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)
    requests: int = 0


@dataclass
class SessionTracker:
    """The open session (at most one) and the weight RPC in flight, for `/ws/update`, `/ws/info` and `/health`.

    Args:
        idle_timeout (`float`, *optional*, defaults to `RELOAD_IDLE_TIMEOUT_S`): a session with no request for that
            long is dropped (its sender is gone); `/health` reports it from half that.
    """

    idle_timeout: float = RELOAD_IDLE_TIMEOUT_S
    current: ReloadSession | None = None
    busy_since: float | None = None  # a weight RPC is running in the engine since then

    def open(self) -> ReloadSession:
        self.current = ReloadSession(id=secrets.token_hex(8))
        return self.current

    def close(self) -> None:
        self.current = None

    def idle(self, now: float | None = None) -> float:
        """Seconds the open session has gone without a request (0 while one runs or when none is open)."""
        if self.current is None or self.busy_since is not None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.current.last

    def expired(self, session_id: str) -> bool:
        """Whether `session_id` is the open session and it has been idle for `idle_timeout` or more."""
        return self.current is not None and self.current.id == session_id and self.idle() >= self.idle_timeout

    def problem(self) -> str | None:
        """Why `/health` should answer 503, or None: a session idle for more than half the timeout (its sender has
        probably died mid-push), or a weight RPC running in the engine for longer than the timeout."""
        now = time.monotonic()
        if self.busy_since is not None and now - self.busy_since > self.idle_timeout:
            return (
                f"a weight update has been running in the engine for {now - self.busy_since:.0f} s "
                f"(over --reload-idle-timeout {self.idle_timeout:g} s)"
            )
        idle = self.idle(now)
        if self.current is not None and idle > self.idle_timeout / 2:
            return (
                f"weight reload session {self.current.id} has had no request for {idle:.0f} s: its sender has "
                f"probably died mid-push; it is dropped after {self.idle_timeout:g} s idle (--reload-idle-timeout) or "
                "by the next push's begin, and the served weights stay as they were"
            )
        return None

    def info(self) -> dict | None:
        """`{"id", "open_s", "idle_s", "requests"}` of the open session, or None."""
        s = self.current
        if s is None:
            return None
        now = time.monotonic()
        idle = round(self.idle(now), 3)
        return {"id": s.id, "open_s": round(now - s.opened, 3), "idle_s": idle, "requests": s.requests}
