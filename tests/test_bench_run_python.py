"""`bench/_runs.run_python`, the launcher of every bench run: a fresh interpreter (or `accelerate launch` on 2
processes) in a real run, a fork of a warm interpreter in a smoke run. The smoke runs of `tests/test_benches.py` take
the warm path; here both paths run the same script and must give the same record, so the one a real run takes cannot
rot unseen."""

import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import _runs  # noqa: E402

#: prints what a run sees (its arguments, the variables a launcher sets, its rank) as `RUN {json}` on rank 0 only,
#: as `bench/_runs.py` does; no torch import, so the fresh interpreters cost little
SCRIPT = """
import json, os, sys
seen = {k: os.environ.get(k) for k in ("BENCH_TEST", "RANK", "WORLD_SIZE", "LOCAL_RANK", "ACCELERATE_USE_CPU")}
seen["argv"] = sys.argv[1:]
seen["main"] = __name__
if os.environ.get("RANK", "0") == "0":
    print("RUN " + json.dumps(seen), flush=True)
print("to stderr too", file=sys.stderr, flush=True)
sys.exit(int(os.environ.get("BENCH_TEST_EXIT", "0")))
"""


@pytest.fixture()
def script(tmp_path):
    path = tmp_path / "run.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_one_process_prints_its_record(script, warm):
    env = {**os.environ, "BENCH_TEST": "yes"}
    proc = _runs.run_python(script, ["a", '{"x": 1}'], timeout=120, env=env, warm=warm)
    assert proc.returncode == 0 and "to stderr too" in proc.stdout, proc.stdout
    record = _runs.run_record(proc, "one process")
    assert record == {
        "BENCH_TEST": "yes",
        "RANK": None,
        "WORLD_SIZE": None,
        "LOCAL_RANK": None,
        "ACCELERATE_USE_CPU": os.environ.get("ACCELERATE_USE_CPU"),
        "argv": ["a", '{"x": 1}'],
        "main": "__main__",
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("warm", [False, True], ids=["accelerate-launch", "warm"])
def test_two_processes_get_the_launchers_ranks(script, warm):
    env = {**os.environ, "BENCH_TEST": "2", "ACCELERATE_USE_CPU": "true"}
    proc = _runs.run_python(script, [json.dumps({"s": 1})], timeout=180, env=env, processes=2, warm=warm)
    assert proc.returncode == 0, proc.stdout[-3000:]
    record = _runs.run_record(proc, "two processes")
    assert record["RANK"] == "0" and record["WORLD_SIZE"] == "2" and record["LOCAL_RANK"] == "0", record
    assert record["BENCH_TEST"] == "2" and record["ACCELERATE_USE_CPU"] == "true"
    assert record["argv"] == ['{"s": 1}'] and record["main"] == "__main__"
    assert proc.stdout.count("RUN ") == 1  # rank 1 ran too, and printed no record
    assert proc.stdout.count("to stderr too") == 2


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_run_without_a_record_fails_naming_it_with_its_output(script, warm):
    env = {**os.environ, "BENCH_TEST_EXIT": "3", "RANK": "1"}  # rank 1 prints no record
    proc = _runs.run_python(script, [], timeout=120, env=env, warm=warm)
    assert proc.returncode == 3
    with pytest.raises(RuntimeError, match=r"run the named one failed \(exit 3\):\n(.|\n)*to stderr too"):
        _runs.run_record(proc, "the named one")


def test_a_record_another_process_wrote_into_is_still_read():
    """Two processes on one unbuffered pipe: rank 1's stderr line was written around rank 0's record (seen in a
    clean-clone run: `to stderr tooRUN {...}`): the record is read from its `RUN {` to the end of its JSON object."""
    import subprocess

    out = 'to stderr tooRUN {"RANK": "0", "argv": ["{\\"s\\": 1}"]}\nto stderr too\nRUN {"RANK": "1"}to stderr\n'
    proc = subprocess.CompletedProcess(["x"], 0, stdout=out)
    assert _runs.run_record(proc, "glued") == {"RANK": "0", "argv": ['{"s": 1}']}
    assert _runs.run_records(out) == [{"RANK": "0", "argv": ['{"s": 1}']}, {"RANK": "1"}]
    # both records on one line, the newlines after them (seen with test_clean_exit's RESULT records)
    assert _runs.run_records('RUN {"RANK": "1"}RUN {"RANK": "0"}\n\n') == [{"RANK": "1"}, {"RANK": "0"}]


STUCK = """
import sys, time
print("before the wait", flush=True)
def waits_for_ever():
    time.sleep(600)
waits_for_ever()
"""


@pytest.mark.parametrize("warm", [False, True], ids=["fresh", "warm"])
def test_a_run_past_its_timeout_is_killed_and_named_with_its_output(tmp_path, warm):
    """A stuck run raises `RunTimedOut` naming it (script, arguments, process count) with its output; a warm fork's
    output ends with every thread's Python stack, so the report shows where it was stuck (`waits_for_ever`)."""
    import time

    path = tmp_path / "stuck.py"
    path.write_text(STUCK)
    t0 = time.monotonic()
    with pytest.raises(_runs.RunTimedOut) as e:
        _runs.run_python(str(path), ["--flag"], timeout=4, warm=warm)
    message = str(e.value)
    assert message.startswith("`stuck.py --flag` on 1 process(es) ran past 4 s and was killed"), message
    assert "before the wait" in message, message
    if warm:
        assert "in waits_for_ever" in message and 'File "' in message, message
    assert time.monotonic() - t0 < 60


def test_ctrl_c_during_a_fresh_run_ends_it(tmp_path):
    """A fresh run is in a session of its own (so its group can be killed at the timeout): the terminal's Ctrl-C does
    not reach it, so a `KeyboardInterrupt` in the bench kills its group before propagating; no run is left behind. A
    bench process (its own interpreter) starts a run that sleeps, then gets SIGINT as from the terminal."""
    import signal
    import subprocess
    import time

    pid_file = tmp_path / "pid"
    sleeper = tmp_path / "sleeps.py"
    sleeper.write_text(f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    bench = tmp_path / "bench.py"
    bench.write_text(
        f"import sys\nsys.path.insert(0, {BENCH!r})\nimport _runs\n"
        f"try:\n    _runs.run_python({str(sleeper)!r}, [], timeout=300)\nexcept KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n    raise SystemExit(3)\n"
    )
    proc = subprocess.Popen([sys.executable, str(bench)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # the pid is written before the sleep starts
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "interrupted" in out, (proc.returncode, out)
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # ended and reaped (`run_python` waited for it)
