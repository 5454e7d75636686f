"""`grpo-async` console script.

```
grpo-async serve PATH_OR_HUB_ID [vLLM server flags] [--host 127.0.0.1] [--port 8000] [--api-key KEY]
grpo-async plot OUTPUT_DIR            # PNG plots of reward, KL, length, timings, overlap from OUTPUT_DIR/metrics.jsonl
grpo-async grpo --model_name_or_path PATH --dataset_name DATA --reward_funcs math_reward [any GRPOConfig flag]
```

`grpo-async` alone prints the usage to stderr and exits 2 (as argparse does for a missing argument);
`grpo-async --help` prints the commands as plain text and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys

#: the commands and their one-line help, as `grpo-async --help` lists them
COMMANDS = {
    "serve": "vLLM's OpenAI-compatible server plus weight-update endpoints for the trainer "
    "(takes every `vllm serve` flag; `grpo-async serve --help` lists them)",
    "plot": "PNG plots of reward, KL, completion length, timings and overlap from OUTPUT_DIR/metrics.jsonl",
    "grpo": "train with GRPO from the command line, as TRL's `trl grpo` (every GRPOConfig and ModelConfig field is "
    "a flag, --config YAML; `grpo-async grpo --help` lists them)",
}

EPILOG = """examples:
  grpo-async serve PATH_OR_HUB_ID --port 8000 --api-key SECRET
  grpo-async plot OUTPUT_DIR [--out PNG]
  grpo-async grpo --model_name_or_path PATH --dataset_name DATA --reward_funcs math_reward --max_steps 10"""


def make_parser() -> argparse.ArgumentParser:
    """The top-level parser: a command, then that command's own arguments (parsed by the command)."""
    p = argparse.ArgumentParser(
        prog="grpo-async",
        description="Asynchronous GRPO: generation servers, training from the command line and training plots.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # each command parses (and helps with) its own flags
    return p


def _plot(argv: list[str]) -> int:
    from .plotting import METRICS_FILE, PLOT_FILE, plot_metrics

    p = argparse.ArgumentParser(prog="grpo-async plot", description="Plot the metrics of a training run.")
    p.add_argument("output_dir")
    p.add_argument("--out", default=None, help="PNG path (default OUTPUT_DIR/metrics.png)")
    a = p.parse_args(argv)
    metrics = os.path.join(a.output_dir, METRICS_FILE)
    if not os.path.exists(metrics):
        p.error(f"{metrics} does not exist: is {a.output_dir!r} a grpo_async output_dir?")
    print(plot_metrics(metrics, a.out or os.path.join(a.output_dir, PLOT_FILE), title=a.output_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; `argv` excludes the program name (defaults to `sys.argv[1:]`). A usage error exits 2
    (`SystemExit`), `--help` exits 0."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = make_parser()
    if not argv or argv[0].startswith("-"):  # no command (or only top-level flags such as --help)
        parser.parse_args(argv)  # --help: prints the help, exits 0; otherwise: usage + error, exits 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        parser.parse_args([cmd])  # "invalid choice: ... (choose from serve, plot)", exits 2
    if cmd == "serve":
        from .generation.serve import main as serve_main

        return serve_main(rest) or 0
    if cmd == "grpo":
        from .scripts.grpo import main as grpo_main

        return grpo_main(rest)
    return _plot(rest)


if __name__ == "__main__":
    sys.exit(main())
