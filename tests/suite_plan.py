"""How `make test` spreads the suite over its workers, and which tests `make test-fast` leaves out.

Both read `tests/durations.json`: the seconds each test took (setup + call + teardown) in a recorded run of the whole
suite, for tests that took ≥ 0.5 s (`GRPO_RECORD_DURATIONS=tests/durations.json make test` rewrites it; the tests it
does not list took less, or are new).

- **`heavy`**: a test listed at ≥ `HEAVY_SECONDS`, or using a module- or class-scoped fixture of its file listed at
  ≥ `HEAVY_SECONDS`, is marked `heavy`; `make test-fast` deselects it with the `slow`, `vllm`, `multiprocess` and
  `gpu` ones, which leaves the unit tests (the inner loop, ~1 s each at most).
- **Scheduling** (`pytest -n 3 --dist loadgroup --no-loadscope-reorder` on 2 cores): a file's tests run on one worker
  (they share module fixtures: engines, servers, models), except that every test listed at ≥ `SPLIT_SECONDS` (a chaos
  run, a bench smoke, a 2-process run) is a unit of its own that any worker may take, unless it uses a module- or
  class-scoped fixture of its file listed at ≥ `HEAVY_SECONDS` (a server): a unit of its own would set that fixture
  up a second time (on another worker, or again on the same one once the file's unit starts: 40-80 s per server
  fixture in the run of 03:05, where 15 tests that only paid their file's server start were split off). The units
  run longest first, so the last minutes do not find a worker idle while another runs a long file. A test not
  listed is weighed by its marks (`UNLISTED_SECONDS`).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
HEAVY_SECONDS = 2.0
SPLIT_SECONDS = 30.0
#: the weight of a test that `durations.json` does not list, by its first mark found here
UNLISTED_SECONDS = {"slow": 60.0, "multiprocess": 30.0, "vllm": 10.0}
RECORD_MIN_SECONDS = 0.5


def load_durations(path: Path = DURATIONS) -> dict[str, float]:
    if not path.exists():
        return {}
    with open(path) as f:
        return {k: float(v) for k, v in json.load(f).items()}


def weight(item, durations: dict[str, float]) -> float:
    if item.nodeid in durations:
        return durations[item.nodeid]
    return next((s for mark, s in UNLISTED_SECONDS.items() if mark in item.keywords), 0.1)


def fixture_key(path: str, name: str) -> str:
    """`durations.json`'s key of a module- or class-scoped fixture of the file `path`."""
    return f"{path}::fixture:{name}"


def uses_heavy_fixture(item, durations: dict[str, float]) -> bool:
    """Whether the test uses a module- or class-scoped fixture of its file listed at ≥ `HEAVY_SECONDS` (a model
    trained once for the file's tests, a server)."""
    path = item.nodeid.split("::")[0]
    return any(durations.get(fixture_key(path, name), 0.0) >= HEAVY_SECONDS for name in item.fixturenames)


def is_heavy(item, durations: dict[str, float]) -> bool:
    """A test is heavy when it took ≥ `HEAVY_SECONDS`, or when it uses a module- or class-scoped fixture of its file
    that did: which test pays that setup depends on the selection."""
    return weight(item, durations) >= HEAVY_SECONDS or uses_heavy_fixture(item, durations)


def plan(items: list, durations: dict[str, float], order: bool) -> None:
    """Mark `heavy` tests and give every test its `xdist_group`; with `order`, sort `items` longest unit first
    (stable: a file's tests keep their order, the units of equal weight keep theirs)."""
    heavy = pytest.mark.heavy
    units: dict[str, str] = {}
    for item in items:
        seconds = weight(item, durations)
        if is_heavy(item, durations):
            item.add_marker(heavy)
        path = item.nodeid.split("::")[0]
        alone = seconds >= SPLIT_SECONDS and not uses_heavy_fixture(item, durations)
        units[item.nodeid] = item.nodeid if alone else path
        item.add_marker(pytest.mark.xdist_group(units[item.nodeid]))
    if order:
        unit_seconds = Counter()
        for item in items:
            unit_seconds[units[item.nodeid]] += weight(item, durations)
        items.sort(key=lambda item: -unit_seconds[units[item.nodeid]])


class FixtureTimer:
    """In each process that runs tests: times the setup of module- and class-scoped fixtures and hands the seconds to
    the report of the test whose setup ran them (`user_properties` travel with the report to the xdist controller)."""

    def __init__(self):
        self.pending: list[tuple[str, float]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        start = time.perf_counter()
        yield
        if fixturedef.scope in ("module", "class"):
            path = request.node.nodeid.split("::")[0]
            self.pending.append((fixture_key(path, fixturedef.argname), time.perf_counter() - start))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        if call.when == "setup" and self.pending:
            outcome.get_result().user_properties.append(("fixture_seconds", self.pending))
            self.pending = []


class DurationRecorder:
    """Collects each test's setup + call + teardown seconds and its file's fixture setups (in the process that sees
    every report: the xdist controller, or the only process) and writes those ≥ `RECORD_MIN_SECONDS` to `path` at the
    end of the session."""

    def __init__(self, path: str):
        self.path = path
        self.seconds: Counter = Counter()

    def pytest_runtest_logreport(self, report) -> None:
        # under `--dist loadgroup` xdist appends "@<group>" to the node id
        self.seconds[report.nodeid.split("@")[0]] += report.duration
        for key, value in report.user_properties:
            if key == "fixture_seconds":
                for fixture, seconds in value:
                    self.seconds[fixture] = max(self.seconds[fixture], seconds)

    def pytest_sessionfinish(self, session) -> None:
        kept = {k: round(v, 1) for k, v in sorted(self.seconds.items()) if v >= RECORD_MIN_SECONDS}
        with open(self.path, "w") as f:
            json.dump(kept, f, indent=0, sort_keys=True)
            f.write("\n")


def register_recorder(config) -> None:
    """`GRPO_RECORD_DURATIONS=<path>` records this run's durations there (only in the controller under xdist)."""
    path = os.environ.get("GRPO_RECORD_DURATIONS")
    if not path:
        return
    config.pluginmanager.register(FixtureTimer(), "grpo_fixture_timer")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config.pluginmanager.register(DurationRecorder(path), "grpo_duration_recorder")
