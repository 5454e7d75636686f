"""Every bench under `bench/` runs (its `--smoke` mode) in the test suite, and every published number names the commit
and the command that made it.

A refactor that breaks a bench fails here, not months later when someone reruns it: `bench/lcm.py` and
`bench/memory.py` once called trainer internals that a redesign removed, and nothing noticed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import tempfile
from pathlib import Path

import pytest
from support.warm_launch import run_script

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"

#: bench → marks of its smoke run (every bench script must be here: `test_every_bench_is_smoked`)
SMOKE = {
    "lcm.py": [],
    "prefix.py": [],  # the tiny model in-process (no vLLM)
    "memory.py": [pytest.mark.vllm],  # one `grpo-async serve` reference server
    "weight_sync.py": [pytest.mark.vllm],
    "lora_sync.py": [pytest.mark.vllm],
    "overlap.py": [pytest.mark.vllm, pytest.mark.multiprocess],  # runs (warm forks) against a server each
    "streaming.py": [pytest.mark.vllm, pytest.mark.multiprocess],  # trainer processes (warm forks), one server
    # real_math.py's training on the tiny model, rounds then stream, each its own process (a warm fork), one server
    "stream_real.py": [pytest.mark.vllm, pytest.mark.slow],
    # real_math.py's training on the tiny model in the 4 modes (sync, async, async2, stream), one server, warm forks
    "learning.py": [pytest.mark.vllm, pytest.mark.slow],
    "vs_trl.py": [pytest.mark.vllm],
    # 2 processes × 4 trainers, two of them starting a vLLM engine per rank (warm forks): ~40 s alone
    "vs_trl_2proc.py": [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.slow],
    # the tiny MoE trained 2 steps 5 times: 3 in-process engines (float32, bfloat16 twice), 2 hf samplers
    "router_replay.py": [pytest.mark.vllm],
    # TRL's own trl/scripts/grpo.py and its import-swapped copy on the tiny model, 1 and 2 processes (warm forks)
    "first_step.py": [pytest.mark.slow, pytest.mark.multiprocess],
}
RESULT = re.compile(r"^RESULT (\w+)=(\S+)\s*$", re.M)


def run_all():
    spec = importlib.util.spec_from_file_location("bench_run_all", BENCH / "run_all.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench_scripts() -> list[str]:
    """The bench scripts: every `bench/*.py` but helpers (`_*.py`) and the runner."""
    return sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_") and p.name != "run_all.py")


def test_every_bench_is_smoked_and_run_by_make_bench():
    scripts = bench_scripts()
    assert sorted(SMOKE) == scripts, "a bench without a smoke test here (or a smoke test of a bench that is gone)"
    assert sorted(run_all().BENCHES) == scripts, "bench/run_all.py BENCHES must list every bench (make bench)"


@pytest.mark.parametrize("name", [pytest.param(n, marks=m) for n, m in SMOKE.items()])
def test_bench_smoke(name):
    """`python bench/<name> --smoke` (in a fork of a warm interpreter) exits 0 and prints the same `RESULT` metrics as
    the published run, all finite."""
    # forked from a warm interpreter (`warm_launch.run_script`): the bench's own imports once per worker, not per
    # bench; so are the engine cores it starts in child processes (`lora_sync`'s two), its OpenMP running one thread
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir()  # where it was: the compile cache is not the bench's to clean
    with tempfile.TemporaryDirectory(prefix="bench_tmp_") as tmp:  # short: vLLM's sockets go there too
        proc = run_script(str(BENCH / name), ["--smoke"], env={**env, "TMPDIR": tmp}, timeout=600, fork_engine=True)
        # a bench cleans up after itself (memory.py once left 305 MB per run in /tmp): no folder of its scratch files
        # is left, only the model caches of fixed name that its next run reuses (`grpo_async_bench_*`); files may be
        # (a server's log, a vLLM socket)
        left = sorted(p.name for p in Path(tmp).iterdir() if p.is_dir() and not p.name.startswith("grpo_async_bench_"))
    out = proc.stdout
    assert proc.returncode == 0, f"bench/{name} --smoke failed (exit {proc.returncode}):\n{out[-4000:]}"
    assert not left, f"bench/{name} --smoke left folders in its temporary directory: {left}"
    printed = dict(RESULT.findall(proc.stdout))
    assert printed, f"bench/{name} --smoke printed no RESULT line:\n{out[-3000:]}"
    for metric, value in printed.items():
        assert math.isfinite(float(value)), f"bench/{name}: RESULT {metric}={value}"
    record = BENCH / "results" / name.replace(".py", ".json")
    if record.exists():  # the smoke run reports what the published record reports
        published = {m for m, _ in json.loads(record.read_text())["results"]}
        assert published <= set(printed), f"bench/{name} --smoke no longer prints {sorted(published - set(printed))}"
    assert not (BENCH / "out" / name.replace(".py", ".json")).exists() or _older_than_test(name), (
        "a smoke run must write under bench/out/smoke/, never over a real run's raw JSON"
    )


_STARTED = __import__("time").time()


def _older_than_test(name: str) -> bool:
    return (BENCH / "out" / name.replace(".py", ".json")).stat().st_mtime < _STARTED


def test_every_record_names_its_commit_and_command():
    """Each bench's published record (`bench/results/`) and each RESULTS.md row say which code and command made it."""
    records = sorted((BENCH / "results").glob("*.json"))
    assert {p.stem + ".py" for p in records} == set(bench_scripts()), "a bench has no published record"
    for path in records:
        rec = json.loads(path.read_text())
        assert rec.get("ok"), f"{path.name}: the published record is a failed run"
        assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", rec.get("commit") or ""), f"{path.name}: no commit"
        assert (rec.get("command") or "").startswith(f"python bench/{path.stem}.py"), f"{path.name}: no command"
        assert "+dirty" not in rec["commit"], f"{path.name}: made from uncommitted code ({rec['commit']})"
    table = [ln for ln in (BENCH / "RESULTS.md").read_text().splitlines() if ln.startswith("| `bench/")]
    assert table, "RESULTS.md has no table rows"
    for line in table:
        commit = line.rstrip(" |").rsplit("|", 1)[-1].strip()
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), f"RESULTS.md row without a commit: {line}"
    text = (BENCH / "RESULTS.md").read_text()
    for path in records:
        assert f"Made by `python bench/{path.stem}.py" in text, f"RESULTS.md: the {path.stem} section names no command"


def test_a_failed_run_never_replaces_a_good_record(tmp_path, monkeypatch):
    """`make bench` with a bench that now fails: the stored good record stays (its rows stay in RESULTS.md) and the
    failure is noted beside it."""
    ra = run_all()
    here = tmp_path / "bench"
    (here / "results").mkdir(parents=True)
    (here / "flaky.py").write_text("import sys\nprint('RESULT flaky_speedup=2.5')\nsys.exit(0)\n")
    monkeypatch.setattr(ra, "HERE", str(here))
    monkeypatch.setattr(ra, "OUT", str(here / "out"))
    monkeypatch.setattr(ra, "PLOTS", str(here / "plots"))
    monkeypatch.setattr(ra, "RECORDS", str(here / "results"))
    monkeypatch.setattr(ra, "BENCHES", ["flaky.py"])
    assert ra.main(["flaky.py"]) == 0
    good = json.loads((here / "results" / "flaky.json").read_text())
    assert good["ok"] and good["results"] == [["flaky_speedup", 2.5]] and good["command"] == "python bench/flaky.py"
    assert "load" in good and "commit" in good

    (here / "flaky.py").write_text("import sys\nprint('Traceback: broken by a refactor')\nsys.exit(1)\n")
    assert ra.main(["flaky.py"]) == 1  # make bench still fails
    kept = json.loads((here / "results" / "flaky.json").read_text())
    assert kept["ok"] and kept["results"] == [["flaky_speedup", 2.5]], "the good record was overwritten"
    assert kept["last_failure"]["error"] == "exit 1"
    results_md = (here / "RESULTS.md").read_text()
    assert "2.50×" in results_md and "A later run failed (exit 1" in results_md


def test_ingest_needs_the_command(tmp_path, monkeypatch):
    ra = run_all()
    here = tmp_path / "bench"
    (here / "out").mkdir(parents=True)
    (here / "byhand.py").write_text("")
    (here / "out" / "byhand.log").write_text("RESULT byhand_ratio=1.5\n")
    monkeypatch.setattr(ra, "HERE", str(here))
    monkeypatch.setattr(ra, "OUT", str(here / "out"))
    monkeypatch.setattr(ra, "PLOTS", str(here / "plots"))
    monkeypatch.setattr(ra, "RECORDS", str(here / "results"))
    monkeypatch.setattr(ra, "BENCHES", ["byhand.py"])
    with pytest.raises(SystemExit, match="give the command"):
        ra.main(["--ingest", "byhand.py"])
    assert ra.main(["--ingest", "byhand.py", "--command", "python bench/byhand.py --repeats 9"]) == 0
    rec = json.loads((here / "results" / "byhand.json").read_text())
    assert rec["command"] == "python bench/byhand.py --repeats 9" and rec["results"] == [["byhand_ratio", 1.5]]


def test_a_record_names_the_kind_of_cpu_that_measured_it():
    """bfloat16 is native on AMX / AVX512-BF16 and emulated on AVX2 (there a bf16 engine is slower than a float32
    one): the machine column of a CPU record says which (model name, widest of those instructions)."""
    cpu_kind = run_all().cpu_kind
    amx = "model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n"
    assert cpu_kind(amx) == " (Intel(R) Xeon(R) Platinum 8488C, AMX-BF16)"
    assert cpu_kind("model name\t: AMD EPYC\nflags\t\t: fpu fma avx avx2\n") == " (AMD EPYC, AVX2)"
    assert cpu_kind("flags\t\t: fpu sse2\n") == "" and cpu_kind("") == ""
    assert run_all().machine().endswith(" cores")


def test_first_step_compares_in_float32_where_bfloat16_is_emulated():
    """`bench/first_step.py` without `--fp32` / `--no-fp32` gives both scripts `--bf16 False` on a CPU without
    bfloat16 instructions (TRL's default bf16 autocast is emulated there), so `make bench` compares the trainers."""
    spec = importlib.util.spec_from_file_location("bench_first_step", BENCH / "first_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.cpu_has_bf16("model name\t: Xeon\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n")
    assert not module.cpu_has_bf16("model name\t: AMD EPYC\nflags\t\t: fpu fma avx avx2\n")
    assert not module.cpu_has_bf16("")


def test_the_benches_that_draw_their_own_plot_are_named():
    """`run_all.ingest` draws the generic chart for a bench run by hand unless the bench draws its own plot into
    `bench/plots/`: `DRAWS_ITS_PLOT` must name exactly those (else an ingest keeps an earlier run's chart, or replaces
    a bench's own plot with the generic one)."""
    own = sorted(name for name in bench_scripts() if "plots" in (BENCH / name).read_text())
    assert sorted(run_all().DRAWS_ITS_PLOT) == own
