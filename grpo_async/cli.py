"""`grpo-async` console script.

```
grpo-async serve --model PATH [vLLM server flags] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
grpo-async plot OUTPUT_DIR            # PNG plots of reward, KL, length, timings, overlap from OUTPUT_DIR/metrics.jsonl
```
"""

from __future__ import annotations

import os
import sys


def _plot(argv: list[str]) -> int:
    import argparse

    from .logging_utils import METRICS_FILE, plot_metrics

    p = argparse.ArgumentParser(prog="grpo-async plot", description="Plot the metrics of a training run.")
    p.add_argument("output_dir")
    p.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/metrics.png)")
    a = p.parse_args(argv)
    metrics = os.path.join(a.output_dir, METRICS_FILE)
    if not os.path.exists(metrics):
        p.error(f"{metrics} does not exist: is {a.output_dir!r} a grpo_async output_dir?")
    print(plot_metrics(metrics, a.out or os.path.join(a.output_dir, "metrics.png"), title=a.output_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "serve":
        from .generation.serve import main as serve_main

        return serve_main(rest) or 0
    if cmd == "plot":
        return _plot(rest)
    print(f"grpo-async: unknown command {cmd!r} (expected 'serve' or 'plot')", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
