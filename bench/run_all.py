"""`make bench`: run every benchmark under `bench/` one after the other (never side by side: the machine has 2 cores)
and collect their results into `bench/RESULTS.md` (table: metric, ours, peer/limit, ratio, machine, date) with one
PNG per bench under `bench/plots/`.

Each benchmark is a script that prints ratios measured side by side in one run and ends with `RESULT <metric>=<x>`;
its own docstring says what it measures, the limit it compares to, and how to read the ratio. It writes
`bench/out/<name>.json`; the rows of the table come from there (`ROWS` below says how for the benches that do not
list their own `rows`), else from the `RESULT` lines. A benchmark that fails is reported as failed (and `make bench`
exits non-zero); its partial output stays in `bench/out/<name>.log`.

Each bench's latest result is a record in `bench/results/<name>.json` (committed, unlike `bench/out/`, so `RESULTS.md`
can be rebuilt on a fresh clone): date, ok, its `RESULT` lines, its table rows, machine, plot and `details` (the text
of its section), enough to write its rows and section without the bench's raw JSON. When `RESULTS.md` is written, a
record whose raw JSON (`bench/out/<name>.json`, the very file the record was made from: same modification time) is
still there has its rows and section recomputed from it by this version of the readers (and is saved again); any
other record is used as stored.

`python bench/run_all.py overlap.py vs_trl.py` reruns only those; the table keeps the other benches' records (with
their own date). `--write-only` rebuilds `RESULTS.md` from the records (e.g. after editing `NOTES.md`).
`--ingest lora_sync.py [...]` makes a bench's record from a run done by hand (`python bench/lora_sync.py >
bench/out/lora_sync.log`): its `RESULT` lines from `bench/out/<name>.log`, rows and section from
`bench/out/<name>.json`, the plot `bench/plots/<name>.png` if there is one, the date of the log (UTC); then rebuilds
`RESULTS.md`. A log without a `RESULT` line is refused.
`bench/NOTES.md` (hand-written: conditions, analysis) is appended to `RESULTS.md`.

Every record names what made it: `commit` (the git commit of the code it ran; `+dirty` when `grpo_async/` or `bench/`
had uncommitted changes), `command` (the exact command line) and `load` (`uptime`'s load averages before and after:
a ratio measured beside other jobs is not a result). `--ingest` takes the command with `--command "python bench/…"`.
A run that fails never replaces a good record: the good one stays (its rows in the table) and the failure is noted
beside it (`last_failure`), so one broken run cannot erase the evidence of the last good one. `tests/test_benches.py`
fails when a record has no commit or command, and runs every bench's `--smoke` mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")  # raw output of the last runs here (logs, JSON): gitignored
PLOTS = os.path.join(HERE, "plots")
RECORDS = os.path.join(HERE, "results")  # each bench's latest record: committed
#: benchmark scripts, in the order they run (cheapest first)
BENCHES = [
    "weight_sync.py",
    "lora_sync.py",
    "lcm.py",
    "prefix.py",
    "memory.py",
    "overlap.py",
    "streaming.py",
    "stream_real.py",
    "vs_trl.py",
    "vs_trl_2proc.py",
    "first_step.py",  # TRL's grpo.py vs the same script on ours, 1 and 2 processes, 2 repeats: ~8 min
    "learning.py",  # 12 SmolLM2 runs: ~50-60 min
    "router_replay.py",  # the tiny MoE, 5 training runs (3 engine starts): ~4 min
]
#: the benches that draw their own plot into `bench/plots/` (the others get `plot_rows`'s generic chart)
DRAWS_ITS_PLOT = ("overlap.py", "streaming.py", "stream_real.py", "vs_trl.py", "learning.py")
RESULT = re.compile(r"^RESULT (\w+)=([-+0-9.eE]+|nan|inf)\s*$")


def git_commit() -> str:
    """This checkout's commit; `+dirty` when the code a bench runs (`grpo_async/`, `bench/`) has uncommitted edits."""
    root = os.path.dirname(HERE)
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "grpo_async", "bench/*.py", "setup.py"],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except OSError:  # pragma: no cover (no git)
        return "unknown"
    if sha.returncode != 0:
        return "unknown"
    return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def load_average() -> str:
    """The 1/5/15-minute load averages (`os.getloadavg`), e.g. `"0.41 0.52 0.60"`."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    cores = os.cpu_count()
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, {cores} CPU cores"
    except ImportError:  # pragma: no cover
        pass
    return f"{platform.machine()} CPU{cpu_kind()}, {cores} cores"


#: the widest vector / matrix instructions of an x86 CPU, widest first: bfloat16 runs natively with the first two and
#: is emulated with the others (on AVX2 a bf16 vLLM engine is slower than a float32 one), so a ratio between modes of
#: different dtypes holds only for the kind of CPU that measured it
ISA_FLAGS = (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2"))


def cpu_kind(cpuinfo: str | None = None) -> str:
    """` (<model name>, <widest ISA>)` from `/proc/cpuinfo` (`cpuinfo`: its text), e.g. `" (AMD EPYC, AVX2)"`; `""`
    where it cannot be read."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return ""
    name = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    have = set(flags.group(1).split()) if flags else set()
    isa = next((label for flag, label in ISA_FLAGS if flag in have), None)
    parts = [p for p in (name.group(1).strip() if name else None, isa) if p]
    return f" ({', '.join(parts)})" if parts else ""


def machine_of(data: dict) -> str:
    """The device a bench recorded (a GPU's name), else this machine."""
    device = data.get("device") or ""
    return device if device and not device.startswith("CPU") else machine()


# ---------------------------------------------------------------------------------------------- rows per bench
def _rows_weight_sync(data: dict) -> list[dict]:
    rows = []
    for t in ("broadcast", "shm", "cuda_ipc"):
        if t in data:
            r = data[t]
            rows.append(
                {
                    "metric": f"weight sync, {t}: bucketed vs per-tensor (s/sync)",
                    "ours": r["bucketed_s"],
                    "peer": r["per_tensor_s"],
                    "peer_name": "per-tensor",
                    "ratio": r["speedup"],
                }
            )
            rows.append(
                {
                    "metric": f"weight sync, {t}: bucketed vs one flat loaded transfer (s/sync)",
                    "ours": r["bucketed_s"],
                    "peer": r["flat_loaded_s"],
                    "peer_name": "limit: flat loaded",
                    "ratio": r["flat_loaded_s"] / r["bucketed_s"],
                }
            )
    if "staging" in data:  # trainer memory during a publish: streamed from the live model vs a staged CPU copy
        st = data["staging"]
        rows.append(
            {
                "metric": "weight sync: trainer's peak extra memory during a publish, streamed (MB)",
                "ours": st["peak_extra_mb"],
                "peer": st["staged_copy_extra_mb"],
                "peer_name": "a staged full CPU copy",
                "ratio": st["staged_copy_extra_mb"] / max(st["peak_extra_mb"], 1e-9),
            }
        )
    for t in ("broadcast", "shm"):  # delta sync into a bf16 server (weight_sync_delta): per learning rate
        for lr, r in (data.get("delta") or {}).get(t, {}).items():
            rows.append(
                {
                    "metric": f"delta weight sync, {t}, bf16 engine, lr {float(lr):g}: bytes per sync (MB)",
                    "ours": r["delta"]["bytes"] / 1e6,
                    "peer": r["full_engine_dtype"]["bytes"] / 1e6,
                    "peer_name": "full push in bf16",
                    "ratio": r["bytes_ratio"],
                }
            )
            rows.append(
                {
                    "metric": f"delta weight sync, {t}, bf16 engine, lr {float(lr):g}: s/sync",
                    "ours": r["delta"]["seconds"],
                    "peer": r["full"]["seconds"],
                    "peer_name": "full push (float32, delta off)",
                    "ratio": r["seconds_ratio"],
                }
            )
    return rows


def _rows_lcm(data: dict) -> list[dict]:
    s = data["seconds"]
    return [
        {
            "metric": "LCM logps stages, 4× vs 1× micro-batch (s/round)",
            "ours": s["4"],
            "peer": s["1"],
            "peer_name": "1× micro-batch",
            "ratio": data["speedup"],
        }
    ]


def _rows_memory(data: dict) -> list[dict]:
    r = data["results"]
    rows = [
        {
            "metric": "trainer step peak memory, packed (padding-free) vs padded (MB)",
            "ours": r["packed"]["step_peak_mb"],
            "peer": r["padded"]["step_peak_mb"],
            "peer_name": "padded",
            "ratio": data["packing_memory_ratio"],
        },
        {
            "metric": "trainer process peak, reference on a server vs in-process (MB)",
            "ours": r["ref_server"]["peak_mb"],
            "peer": r["ref_inprocess"]["peak_mb"],
            "peer_name": "in-process ref",
            "ratio": data["ref_memory_ratio"],
        },
    ]
    if "token_budget_throughput_ratio" in data:  # issue 25: token-budget micro-batches on long-tailed lengths
        k = data["token_budget_rows_per_pass"]
        rows += [
            {
                "metric": "token budget: step peak on long-tailed rows vs the budget's bound (MB; ratio <= 1: within)",
                "ours": r["tb_budget"]["step_peak_mb"],
                "peer": r["tb_bound"]["step_peak_mb"],
                "peer_name": f"passes of {k} bins of the longest row",
                "ratio": data["token_budget_peak_ratio"],
            },
            {
                "metric": "token budget: training tokens per second vs the row-based split that fits the same peak",
                "ours": r["tb_budget"]["tokens_per_second"],
                "peer": r[f"tb_rows_{k}"]["tokens_per_second"],
                "peer_name": f"{k} rows per pass",
                "ratio": data["token_budget_throughput_ratio"],
            },
        ]
    return rows


def _rows_lora_sync(data: dict) -> list[dict]:
    a, m = data["adapter"], data["merged"]
    return [
        {
            "metric": "LoRA weight sync: adapter-only vs merged (s/sync)",
            "ours": a["median_s"],
            "peer": m["median_s"],
            "peer_name": "merged full weights",
            "ratio": data["speedup"],
        },
        {
            "metric": "LoRA weight sync: bytes per sync, adapter-only vs merged (MB)",
            "ours": a["bytes"] / 1e6,
            "peer": m["bytes"] / 1e6,
            "peer_name": "merged full weights",
            "ratio": data["bytes_ratio"],
        },
    ]


#: how to read `bench/out/<name>.json` into table rows, for benches whose JSON has no `rows` list of its own
ROWS = {
    "weight_sync.py": _rows_weight_sync,
    "lora_sync.py": _rows_lora_sync,
    "lcm.py": _rows_lcm,
    "memory.py": _rows_memory,
}


def raw_path(name: str) -> str:
    """The bench's own JSON of its last run (`bench/out/<name>.json`, not committed)."""
    return os.path.join(OUT, name.replace(".py", ".json"))


def record_path(name: str) -> str:
    """The bench's latest record (`bench/results/<name>.json`, committed)."""
    return os.path.join(RECORDS, name.replace(".py", ".json"))


def rows_of(name: str, results: list[tuple[str, float]]) -> tuple[list[dict], dict]:
    path = raw_path(name)
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    rows = []
    try:
        rows = data.get("rows") or (ROWS[name](data) if name in ROWS and data else [])
    except (KeyError, TypeError, ZeroDivisionError) as e:
        print(f"   (could not read rows from {path}: {e!r}; using the RESULT lines)")
    if not rows:
        rows = [{"metric": m, "ours": v, "peer": None, "peer_name": "", "ratio": v} for m, v in results]
    return rows, data


# ---------------------------------------------------------------------------------------------- plots
def plot_rows(name: str, rows: list[dict], path: str) -> None:
    """A generic bar chart (ours vs peer/limit per row) for benches that draw no plot of their own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("peer") is not None]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7.5, 0.6 + 0.55 * len(rows)))
    y = range(len(rows))
    ax.barh([i - 0.2 for i in y], [r["peer"] for r in rows], height=0.4, color="lightgray", label="peer / limit")
    ax.barh([i + 0.2 for i in y], [r["ours"] for r in rows], height=0.4, color="tab:blue", label="ours")
    ax.set_yticks(list(y), [f"{r['metric'][:60]}\n({r['ratio']:.2f}x)" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.legend(fontsize=7)
    ax.set_title(f"bench/{name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- details sections
def _f(x, spec: str = ".3f") -> str:
    """A number for a details table; missing or NaN (a phase a mode does not run) as "—"."""
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _details_overlap(d: dict) -> str:
    runs = [(f"`{m}` (interleaved)", r) for m, r in d["modes"].items()]
    runs.append(("sync run (`num_batches_ahead=0`, separate)", d["sync"]))
    lines = [
        f"Device: {d['device']}; setup {d['setup']}.\n",
        "Medians over each mode's steps (seconds; `trainer work` = the trainer's busy time, `live overlap` = the mean "
        "of the live `async/overlap` metric):\n",
        "| run | s/step | T_gen | trainer work | wait for generation (`timing/wait_generation`) | weight sync | "
        "live overlap |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs:
        lines.append(
            f"| {name} | {_f(r.get('step_s'))} | {_f(r.get('T_gen'))} | {_f(r.get('trainer_busy'))} | "
            f"{_f(r.get('wait'))} | {_f(r.get('weight_sync'))} | {_f(r.get('live_overlap'))} |"
        )
    t_gen, t_train, ratio = d["T_gen"], d["T_train"], d["live_vs_bench"]
    within = "within 10 %" if abs(ratio - 1) <= 0.10 else "**not** within 10 %"
    lines += [
        "",
        f"Bound: T_gen alone {_f(t_gen)} s (`gen_alone` steps), T_train alone {_f(t_train)} s (`train_alone` steps); "
        f"S* = (T_gen + T_train) / max = {_f(d['S_star'])}; achieved (T_gen + T_train) / async s/step = "
        f"{_f(d['achieved'])}× → **{_f(d['overlap_fraction'])} of S*** (target ≥ 0.95; verl reports 0.88).",
        "",
        f"Live metric: `async/overlap` mean {_f(d['live_overlap'])} over the same async steps; live ÷ bench = "
        f"{_f(ratio)}: {within} (above 1 by the phases' slow-down side by side, which only the alone timings show).",
        "",
        f"Speed-up a user sees: sync run ÷ async = **{_f(d['achieved_vs_sync_run'])}×** (sync steps ÷ async steps of "
        f"the same run: {_f(d.get('achieved_vs_sync_mode'))}×). The sync run's step holds {_f(d.get('other_s'))} s "
        "beyond the two alone phases"
        + (": " + ", ".join(f"{k} {v:+.3f}" for k, v in d["sync_loss"].items()) if d.get("sync_loss") else "")
        + ".",
    ]
    if d.get("spread"):
        lines += ["", "Spread over the repeats (each repeat summarized on its own):", "", "| | min | median | max |"]
        lines.append("|---|---|---|---|")
        for key, v in d["spread"].items():
            lines.append(f"| `{key}` | {_f(v['min'])} | {_f(v['median'])} | {_f(v['max'])} |")
    return "\n".join(lines) + "\n"


def _details_vs_trl(d: dict) -> str:
    modes = d["modes"]
    keys: list[str] = []
    for m in modes.values():
        keys += [k for k in m["phases"] if k not in keys]
    lines = [
        f"Device: {d['device']}; TRL {d['trl_version']}; setup {d['setup']}.\n",
        "| trainer / mode | s/step (median) | tokens/s | speed-up vs TRL | fastest step | speed-up, fastest steps |",
        "|---|---|---|---|---|---|",
    ]
    trl_min = min(modes["trl"]["steps"])
    for name, m in modes.items():
        fastest = min(m["steps"])  # external load only ever adds time: the fastest steps are the least disturbed
        lines.append(
            f"| `{name}` | {m['step_s']:.3f} | {m['tokens_per_s']:.0f} | {m['speedup']:.2f}× | {fastest:.3f} | "
            f"{trl_min / fastest:.2f}× |"
        )
    lines += [
        "",
        "Where one step's time goes (median seconds per phase). In async modes generation runs beside training, so "
        "its phases (weight sync, generate, rewards) are not part of the step: only `wait for generation` is.",
        "",
        "| phase | " + " | ".join(f"`{n}`" for n in modes) + " |",
        "|---|" + "---|" * len(modes),
    ]
    for k in keys:
        cells = [f"{m['phases'][k]:.3f}" if k in m["phases"] else "—" for m in modes.values()]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{m['step_s']:.3f}**" for m in modes.values()) + " |")
    return "\n".join(lines) + "\n"


#: extra sections for RESULTS.md, from each bench's JSON
DETAILS = {"overlap.py": _details_overlap, "vs_trl.py": _details_vs_trl}


# ---------------------------------------------------------------------------------------------- records
#: what a record says about the run that made it (never recomputed)
PROVENANCE = ("commit", "command", "load", "last_failure")


def make_record(name: str, date: str, results: list[tuple[str, float]], provenance: dict | None = None) -> dict:
    """The record of a finished run: its `RESULT` lines, rows and section from its raw JSON, its plot if any;
    `provenance`: `commit`, `command`, `load` of the run (kept as they are when a stored record is refreshed)."""
    rows, data = rows_of(name, results)
    record = {"name": name, "date": date, "ok": True, "results": [list(r) for r in results], "rows": rows}
    record.update(provenance or {})
    record["machine"] = machine_of(data)
    png = os.path.join(PLOTS, name.replace(".py", ".png"))
    if os.path.exists(png):
        record["plot"] = os.path.relpath(png, HERE)
    if name in DETAILS and data:
        record["details"] = DETAILS[name](data)
    if data:  # which raw JSON this record was made from: only that one may refresh it later
        record["raw_mtime"] = os.path.getmtime(raw_path(name))
    return record


def save_record(record: dict) -> None:
    os.makedirs(RECORDS, exist_ok=True)
    with open(record_path(record["name"]), "w") as f:
        json.dump(record, f, indent=1, ensure_ascii=False)
        f.write("\n")


def load_record(name: str) -> dict | None:
    path = record_path(name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def refresh(record: dict) -> dict:
    """Rows, section and plot of a stored record as this version of the readers makes them, where the raw JSON it was
    made from is still in `bench/out/`; else (a fresh clone, a record converted by hand, a raw JSON of a later run
    not ingested) the record as stored."""
    name = record["name"]
    if not record.get("ok"):
        return record
    raw = raw_path(name)
    if record.get("raw_mtime") is not None and os.path.exists(raw) and os.path.getmtime(raw) == record["raw_mtime"]:
        kept = {k: record[k] for k in PROVENANCE if k in record}
        return make_record(name, record["date"], [tuple(r) for r in record["results"]], kept)
    png = os.path.join(PLOTS, name.replace(".py", ".png"))
    if os.path.exists(png):
        record = {**record, "plot": os.path.relpath(png, HERE)}
    return record


# ---------------------------------------------------------------------------------------------- main
def read_results(lines) -> list[tuple[str, float]]:
    return [(m.group(1), float(m.group(2))) for m in map(RESULT.match, lines) if m]


def run_one(name: str) -> dict:
    print(f"== bench/{name}", flush=True)
    import time

    started = time.time()
    provenance = {"commit": git_commit(), "command": f"python bench/{name}", "load": {"before": load_average()}}
    log_path = os.path.join(OUT, name.replace(".py", ".log"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, name)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        results = []
        for line in proc.stdout:
            log.write(line)
            found = read_results([line])
            if found:
                results += found
                print(line, end="", flush=True)
        code = proc.wait()
    provenance["load"]["after"] = load_average()
    date = datetime.date.today().isoformat()
    if code != 0 or not results:
        print(f"   FAILED (exit {code}); see {log_path}", flush=True)
        return {"name": name, "date": date, "ok": False, "error": f"exit {code}", **provenance}
    png = os.path.join(PLOTS, name.replace(".py", ".png"))
    if not os.path.exists(png) or os.path.getmtime(png) < started:
        plot_rows(name, rows_of(name, results)[0], png)  # the bench drew none this run
    return make_record(name, date, results, provenance)


def ingest(name: str, command: str) -> dict:
    """The record of a run done by hand, from what it left in `bench/out/` (and `bench/plots/`: a bench that draws
    no plot of its own gets the generic chart of this run's rows); `command`: the command line that made it (the
    commit is this checkout's)."""
    if not command or f"bench/{name}" not in command:
        raise SystemExit(f'--ingest {name}: give the command that ran it, e.g. --command "python bench/{name} ..."')
    log_path = os.path.join(OUT, name.replace(".py", ".log"))
    if not os.path.exists(log_path):
        raise SystemExit(f"--ingest {name}: no {os.path.relpath(log_path)} (run the bench with its output there)")
    with open(log_path) as f:
        results = read_results(f)
    if not results:
        raise SystemExit(f"--ingest {name}: {os.path.relpath(log_path)} has no RESULT line (did the run finish?)")
    if not os.path.exists(raw_path(name)):
        print(f"   (no {os.path.relpath(raw_path(name))}: rows from the RESULT lines)")
    date = datetime.datetime.fromtimestamp(os.path.getmtime(log_path), datetime.timezone.utc).date().isoformat()
    png = os.path.join(PLOTS, name.replace(".py", ".png"))
    if name not in DRAWS_ITS_PLOT:  # the generic chart, drawn from this run's rows (as after `make bench`'s run)
        plot_rows(name, rows_of(name, results)[0], png)
    return make_record(name, date, results, {"commit": git_commit(), "command": command})


def keep_good(new: dict, old: dict | None) -> dict:
    """The record to store after a run: a failed run never replaces a good record; it is noted beside it."""
    if new.get("ok") or old is None or not old.get("ok"):
        return new
    failure = {k: new.get(k) for k in ("date", "error", "commit", "command")}
    print(f"   keeping the good record of {old.get('date')} ({old.get('commit')}); failure noted beside it")
    return {**old, "last_failure": failure}


def fmt(x) -> str:
    return "—" if x is None else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def provenance_line(rec: dict) -> str:
    """`Made by `command` at commit X on date, load before → after` (and the last failed attempt, if any)."""
    load = rec.get("load") or {}
    text = f"Made by `{rec.get('command', '?')}` at commit `{rec.get('commit', '?')}` on {rec.get('date')}"
    if load:
        text += f", load average {load.get('before', '?')} before, {load.get('after', '?')} after"
    text += "."
    fail = rec.get("last_failure")
    if fail:
        text += f" A later run failed ({fail.get('error')}, {fail.get('date')}, `{fail.get('commit')}`): see its log."
    return text


def write_results(records: list[dict]) -> str:
    path = os.path.join(HERE, "RESULTS.md")
    with open(path, "w") as f:
        f.write("# Benchmark results\n\n")
        f.write(
            "Written by `make bench` (`bench/run_all.py`). Every ratio is measured side by side in one run of its "
            "bench; each script's docstring says what it measures, the limit it compares to and how to read the "
            "ratio. `ours` and `peer / limit` are in the unit the metric names; `ratio` > 1 favours ours.\n\n"
        )
        f.write(
            "| bench | metric | ours | peer / limit | ratio | machine | date | commit |\n"
            "|---|---|---|---|---|---|---|---|\n"
        )
        for rec in records:
            if not rec.get("ok"):
                f.write(
                    f"| `bench/{rec['name']}` | FAILED ({rec.get('error')}) | — | — | — | {machine()} | "
                    f"{rec.get('date')} | {rec.get('commit', '—')} |\n"
                )
                continue
            for r in rec["rows"]:
                peer = f"{fmt(r.get('peer'))} ({r['peer_name']})" if r.get("peer_name") else fmt(r.get("peer"))
                f.write(
                    f"| `bench/{rec['name']}` | {r['metric']} | {fmt(r['ours'])} | {peer} | "
                    f"**{r['ratio']:.2f}×** | {rec['machine']} | {rec['date']} | {rec.get('commit', '—')} |\n"
                )
        f.write(
            "\n`RESULT` lines: "
            + ", ".join(f"`{m}={v:g}`" for rec in records if rec.get("ok") for m, v in rec["results"])
            + "\n"
        )
        for rec in records:
            if not rec.get("ok"):
                continue
            f.write(f"\n## `bench/{rec['name']}`\n\n")
            f.write(provenance_line(rec) + "\n\n")
            if rec.get("plot"):
                f.write(f"![{rec['name']}]({rec['plot']})\n\n")
            if rec.get("details"):
                f.write(rec["details"] + "\n")
        if os.path.exists(os.path.join(HERE, "NOTES.md")):
            with open(os.path.join(HERE, "NOTES.md")) as notes:
                f.write("\n" + notes.read())
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the benches under bench/ and write bench/RESULTS.md.")
    ap.add_argument("names", nargs="*", help=f"benches to rerun (default: all of {BENCHES})")
    ap.add_argument("--write-only", action="store_true", help="run nothing: rebuild RESULTS.md from bench/results/")
    ap.add_argument("--ingest", nargs="+", metavar="NAME", help="record runs done by hand (bench/out/<name>.log)")
    ap.add_argument("--command", default=None, help="with --ingest (one bench): the exact command that ran it")
    args = ap.parse_args(list(argv or []))
    if sum(map(bool, (args.names, args.write_only, args.ingest))) > 1:
        ap.error("give bench names, --write-only or --ingest, not several")
    fix = lambda n: n if n.endswith(".py") else n + ".py"  # noqa: E731
    if args.write_only:
        names, ingested = [], []
    elif args.ingest:
        names, ingested = [], [fix(n) for n in args.ingest]
    else:
        names = [fix(n) for n in args.names] or [b for b in BENCHES if os.path.exists(os.path.join(HERE, b))]
        ingested = []
    unknown = [n for n in names + ingested if not os.path.exists(os.path.join(HERE, n))]
    if unknown:
        raise SystemExit(f"no such bench: {unknown}; known: {BENCHES}")
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(PLOTS, exist_ok=True)
    if len(ingested) > 1 and args.command:
        ap.error("--command names the command of one bench: ingest one at a time")
    new = [ingest(name, args.command) for name in ingested]  # every one checked before any is stored
    failed = []
    for name in names:
        rec = run_one(name)
        save_record(keep_good(rec, load_record(name)))
        if not rec["ok"]:
            failed.append(name)
    for rec in new:
        save_record(rec)
        print(f"recorded {os.path.relpath(record_path(rec['name']))}: {rec['results']}")
    records = []
    for name in BENCHES:  # every bench's latest record, this run's or an earlier one's
        rec = load_record(name)
        if rec is None:
            continue
        fresh = refresh(rec)
        if fresh != rec:
            save_record(fresh)
        records.append(fresh)
    print(f"wrote {write_results(records)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
