"""`make bench`: run every benchmark under `bench/` one after the other (never side by side: the machine has 2 cores)
and collect their results into `bench/RESULTS.md` (table: metric, ours, peer/limit, ratio, machine, date) with one
PNG per bench under `bench/plots/`.

Each benchmark is a script that prints ratios measured side by side in one run and ends with `RESULT <metric>=<x>`;
its own docstring says what it measures, the limit it compares to, and how to read the ratio. It writes
`bench/out/<name>.json`; the rows of the table come from there (`ROWS` below says how for the benches that do not
list their own `rows`), else from the `RESULT` lines. A benchmark that fails is reported as failed (and `make bench`
exits non-zero); its partial output stays in `bench/out/<name>.log`.

`python bench/run_all.py overlap.py vs_trl.py` reruns only those; the table keeps the other benches' last results
(stored in `bench/out/<name>.result.json`, with their own date). `--write-only` rebuilds `RESULTS.md` from them.
`bench/NOTES.md` (hand-written: conditions, analysis) is appended to `RESULTS.md`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "out")
PLOTS = os.path.join(HERE, "plots")
#: benchmark scripts, in the order they run (cheapest first)
BENCHES = ["weight_sync.py", "lcm.py", "memory.py", "overlap.py", "vs_trl.py"]
RESULT = re.compile(r"^RESULT (\w+)=([-+0-9.eE]+|nan|inf)\s*$")


def machine() -> str:
    cores = os.cpu_count()
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)}, {cores} CPU cores"
    except ImportError:  # pragma: no cover
        pass
    return f"{platform.machine()} CPU, {cores} cores"


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
    return [
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


#: how to read `bench/out/<name>.json` into table rows, for benches whose JSON has no `rows` list of its own
ROWS = {"weight_sync.py": _rows_weight_sync, "lcm.py": _rows_lcm, "memory.py": _rows_memory}


def rows_of(name: str, results: list[tuple[str, float]]) -> tuple[list[dict], dict]:
    path = os.path.join(OUT, name.replace(".py", ".json"))
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
def _details_overlap(d: dict) -> str:
    s, a = d["sync"], d["async"]
    return (
        f"Device: {d['device']}; setup {d['setup']}.\n\n"
        f"| run | s/step | T_gen | T_train | wait for generation | weight sync |\n|---|---|---|---|---|---|\n"
        f"| sync (`num_batches_ahead=0`) | {s['step_s']:.3f} | {s['T_gen']:.3f} | {s['T_train']:.3f} | "
        f"{s['wait']:.3f} | {s['weight_sync']:.3f} |\n"
        f"| async (`num_batches_ahead=1`) | {a['step_s']:.3f} | {a['T_gen']:.3f} | {a['T_train']:.3f} | "
        f"{a['wait']:.3f} | {a['weight_sync']:.3f} |\n\n"
        f"S* = (T_gen + T_train) / max = {d['S_star']:.3f}; achieved {d['achieved']:.3f}× → "
        f"**{d['overlap_fraction']:.3f} of S*** (target ≥ 0.95; verl reports 0.88). The synchronous step also holds "
        f"{d['other_s']:.3f} s that is neither phase (optimizer step, round hand-off), which no overlap removes.\n"
    )


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


# ---------------------------------------------------------------------------------------------- main
def run_one(name: str) -> dict:
    print(f"== bench/{name}", flush=True)
    import time

    started = time.time()
    log_path = os.path.join(OUT, name.replace(".py", ".log"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, name)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        results = []
        for line in proc.stdout:
            log.write(line)
            m = RESULT.match(line)
            if m:
                results.append((m.group(1), float(m.group(2))))
                print(line, end="", flush=True)
        code = proc.wait()
    record = {"name": name, "date": datetime.date.today().isoformat(), "ok": code == 0 and bool(results)}
    if not record["ok"]:
        print(f"   FAILED (exit {code}); see {log_path}", flush=True)
        record["error"] = f"exit {code}"
        return record
    rows, data = rows_of(name, results)
    record.update(results=results, rows=rows, machine=machine_of(data))
    png = os.path.join(PLOTS, name.replace(".py", ".png"))
    if not os.path.exists(png) or os.path.getmtime(png) < started:
        plot_rows(name, rows, png)  # the bench drew none this run
    if os.path.exists(png):
        record["plot"] = os.path.relpath(png, HERE)
    if name in DETAILS and data:
        record["details"] = DETAILS[name](data)
    return record


def fmt(x) -> str:
    return "—" if x is None else f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def write_results(records: list[dict]) -> str:
    path = os.path.join(HERE, "RESULTS.md")
    with open(path, "w") as f:
        f.write("# Benchmark results\n\n")
        f.write(
            "Written by `make bench` (`bench/run_all.py`). Every ratio is measured side by side in one run of its "
            "bench; each script's docstring says what it measures, the limit it compares to and how to read the "
            "ratio. `ours` and `peer / limit` are in the unit the metric names; `ratio` > 1 favours ours.\n\n"
        )
        f.write("| bench | metric | ours | peer / limit | ratio | machine | date |\n|---|---|---|---|---|---|---|\n")
        for rec in records:
            if not rec.get("ok"):
                f.write(
                    f"| `bench/{rec['name']}` | FAILED ({rec.get('error')}) | — | — | — | {machine()} | "
                    f"{rec.get('date')} |\n"
                )
                continue
            for r in rec["rows"]:
                peer = f"{fmt(r.get('peer'))} ({r['peer_name']})" if r.get("peer_name") else fmt(r.get("peer"))
                f.write(
                    f"| `bench/{rec['name']}` | {r['metric']} | {fmt(r['ours'])} | {peer} | "
                    f"**{r['ratio']:.2f}×** | {rec['machine']} | {rec['date']} |\n"
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
            if rec.get("plot"):
                f.write(f"![{rec['name']}]({rec['plot']})\n\n")
            if rec.get("details"):
                f.write(rec["details"] + "\n")
        if os.path.exists(os.path.join(HERE, "NOTES.md")):
            with open(os.path.join(HERE, "NOTES.md")) as notes:
                f.write("\n" + notes.read())
    return path


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv == ["--write-only"]:  # rebuild RESULTS.md from the stored results (e.g. after editing NOTES.md)
        argv, names = [], []
    else:
        names = argv if argv else [b for b in BENCHES if os.path.exists(os.path.join(HERE, b))]
    unknown = [n for n in names if not os.path.exists(os.path.join(HERE, n))]
    if unknown:
        raise SystemExit(f"no such bench: {unknown}; known: {BENCHES}")
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(PLOTS, exist_ok=True)
    failed = []
    for name in names:
        rec = run_one(name)
        with open(os.path.join(OUT, name.replace(".py", ".result.json")), "w") as f:
            json.dump(rec, f, indent=1)
        if not rec["ok"]:
            failed.append(name)
    records = []
    for name in BENCHES:  # every bench's latest result, this run's or an earlier one's
        p = os.path.join(OUT, name.replace(".py", ".result.json"))
        if os.path.exists(p):
            with open(p) as f:
                rec = json.load(f)
            if rec.get("ok"):  # rows and details from the bench's JSON, read by this version of the readers
                rec["rows"], data = rows_of(name, [tuple(r) for r in rec["results"]])
                if name in DETAILS and data:
                    rec["details"] = DETAILS[name](data)
                rec["machine"] = machine_of(data)
                png = os.path.join(PLOTS, name.replace(".py", ".png"))
                if not os.path.exists(png):
                    plot_rows(name, rec["rows"], png)
                if os.path.exists(png):
                    rec["plot"] = os.path.relpath(png, HERE)
            records.append(rec)
    print(f"wrote {write_results(records)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
