"""Command-line parsing for the recipes: a YAML file of defaults, then flags that override it (like TRL's
`TrlParser`, without depending on `trl`).

```bash
accelerate launch recipes/gsm8k.py --config recipes/configs/gsm8k.yaml --learning_rate 1e-6 --max_steps 10
```

Every key of the YAML file is a flag of the parser (`GRPOConfig`, `ModelConfig`, the recipe's own arguments); an
unknown key is an error naming it, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import yaml
from transformers import HfArgumentParser


def apply_yaml_defaults(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> str | None:
    """Add `--config` to `parser` and, when `argv` names a YAML file with it, make the file's values the parser's
    defaults. Returns the file's path (or `None`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    parser.add_argument("--config", default=None, help="YAML file of defaults for any flag; flags override it")
    if path is None:
        return None
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values, got {type(values).__name__}")
    flags = {a.dest for a in parser._actions}
    unknown = sorted(k for k in values if k not in flags)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; every key must be one of the script's flags (see --help)")
    parser.set_defaults(**values)
    return path


def parse_recipe_args(dataclass_types, argv: list[str] | None = None, description: str | None = None) -> tuple:
    """Instances of `dataclass_types` from `--config <yaml>` (defaults) and the other flags (overrides)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser(  # "resolve": a field in two dataclasses (trust_remote_code) is one flag for both
        dataclass_types,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",
    )
    apply_yaml_defaults(parser, argv)
    namespace = parser.parse_args(argv)
    # one instance per dataclass from the shared namespace (a field two of them have goes to both)
    return tuple(
        t(
            **{
                f.name: getattr(namespace, f.name)
                for f in dataclasses.fields(t)
                if f.init and hasattr(namespace, f.name)
            }
        )
        for t in dataclass_types
    )
