"""`make bench`: run every benchmark under `bench/` one after the other (never side by side: the machine has 2 cores)
and collect their `RESULT name=value` lines into `bench/RESULTS.md`.

Each benchmark is a script that prints ratios measured side by side in one run and ends with `RESULT <metric>=<x>`;
its own docstring says what it measures and how to read the ratio. A benchmark that fails is reported as failed (and
`make bench` exits non-zero); its partial output stays in `bench/out/<name>.log`.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
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


def main(argv: list[str] | None = None) -> int:
    names = argv if argv else [b for b in BENCHES if os.path.exists(os.path.join(HERE, b))]
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    rows, failed = [], []
    for name in names:
        print(f"== bench/{name}", flush=True)
        log_path = os.path.join(HERE, "out", name.replace(".py", ".log"))
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, os.path.join(HERE, name)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            results = []
            for line in proc.stdout:
                log.write(line)
                m = RESULT.match(line)
                if m:
                    results.append((m.group(1), float(m.group(2))))
                    print(line, end="", flush=True)
            code = proc.wait()
        if code != 0 or not results:
            failed.append(name)
            print(f"   FAILED (exit {code}); see {log_path}", flush=True)
        rows += [(name, metric, value) for metric, value in results]
    date = datetime.date.today().isoformat()
    with open(os.path.join(HERE, "RESULTS.md"), "w") as f:
        f.write(
            "# Benchmark results\n\nWritten by `make bench` (`bench/run_all.py`). Each script's docstring says what"
        )
        f.write(" it measures and what limit the ratio is compared to.\n\n")
        f.write("| bench | metric | value | machine | date |\n|---|---|---|---|---|\n")
        for name, metric, value in rows:
            f.write(f"| `bench/{name}` | `{metric}` | {value:.3f} | {machine()} | {date} |\n")
        for name in failed:
            f.write(f"| `bench/{name}` | FAILED | — | {machine()} | {date} |\n")
    print(f"wrote {os.path.join(HERE, 'RESULTS.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
