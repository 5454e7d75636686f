"""`tests/suite_plan.py` (how `make test` spreads the suite, what `make test-fast` leaves out), on a suite of its own
run by a real pytest: a recorded run's durations mark tests `heavy` (their own seconds, or a module fixture's), long
tests become units of their own unless they use a costly fixture of their file, and `GRPO_RECORD_DURATIONS` records
both kinds of seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SUITE = """
import time
import pytest

@pytest.fixture(scope="module")
def trained():
    time.sleep(0.6)  # a model trained once for the file's tests
    return 1

def test_unit():
    pass

def test_slow_one():
    time.sleep(0.6)

def test_uses_the_fixture(trained):
    pass

def test_long_one():
    pass

def test_long_with_the_fixture(trained):
    pass
"""

CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
import suite_plan

suite_plan.HEAVY_SECONDS = 0.5
suite_plan.RECORD_MIN_SECONDS = 0.0
suite_plan.DURATIONS = suite_plan.Path(__file__).with_name("durations.json")

def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: heavy")
    suite_plan.register_recorder(config)

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    suite_plan.plan(items, suite_plan.load_durations(suite_plan.DURATIONS), order=True)
    for item in items:
        print("PLAN", item.nodeid, [m.args[0] for m in item.iter_markers("xdist_group")])
"""


def _clean_env() -> dict[str, str]:
    """This process's environment without what the outer run sets for itself (an xdist worker's id makes the inner
    pytest act as a worker; a recording of the outer run's durations must not be overwritten by the inner one)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST") and k != "GRPO_RECORD_DURATIONS"}


def _pytest(root: Path, *args: str, **env: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "-q", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**_clean_env(), **env},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_a_recorded_run_marks_heavy_tests_and_splits_long_ones(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    record = tmp_path / "durations.json"
    _pytest(tmp_path, "test_suite.py", GRPO_RECORD_DURATIONS=str(record))
    seconds = json.loads(record.read_text())
    assert seconds["test_suite.py::test_slow_one"] >= 0.6
    assert seconds["test_suite.py::fixture:trained"] >= 0.6  # the fixture's setup, apart from the test that paid it
    assert seconds["test_suite.py::test_unit"] < 0.5

    seconds["test_suite.py::test_long_one"] = 60.0  # as a chaos run would have recorded
    seconds["test_suite.py::test_long_with_the_fixture"] = 45.0  # long, but split off it would set `trained` up again
    record.write_text(json.dumps(seconds))
    out = _pytest(tmp_path, "test_suite.py", "-m", "not heavy", "--collect-only")
    collected = {ln.split("::")[1].split()[0] for ln in out.splitlines() if ln.startswith("test_suite.py::")}
    assert collected == {"test_unit"}  # test_uses_the_fixture is heavy through its fixture
    plan = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("PLAN ")]
    assert plan[0] == ["test_suite.py::test_long_one", "['test_suite.py::test_long_one']"]  # longest unit first
    assert {group for _, group in plan[1:]} == {"['test_suite.py']"}  # the rest stays together
    assert "test_suite.py::test_long_with_the_fixture" in [nodeid for nodeid, _ in plan[1:]]
