"""Command-line parsing for the recipes and `grpo-async grpo`: TRL's `TrlParser` convention without depending on
`trl`. Every field of the given dataclasses (the script's own arguments, `GRPOConfig`, `ModelConfig`) is a flag;
`--config <yaml>` sets defaults for any of them, flags on the command line override the file.

```bash
accelerate launch recipes/gsm8k.py --config recipes/configs/gsm8k.yaml --learning_rate 1e-6 --max_steps 10
```

Precedence, lowest first: the dataclasses' defaults, the recipe's own defaults (`defaults=`, e.g. the demo's
learning rate), the YAML file, the command line. An unknown YAML key or flag is an error naming it, so a typo never
silently falls back to a default. As in TRL, a YAML key `env:` (a mapping) sets environment variables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import yaml
from transformers import HfArgumentParser

CONFIG_FLAG = "--config"


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions}  # noqa: SLF001 (argparse has no public list of its actions)


def _read_yaml(path: str) -> dict:
    with open(path) as f:
        values = yaml.safe_load(f) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of flag names to values, got {type(values).__name__}")
    return values


def _rename(values: dict, aliases: dict[str, str], where: str) -> dict:
    """`values` with alias keys renamed to the flag they stand for; both names given is an error."""
    out = dict(values)
    for alias, name in aliases.items():
        if alias in out:
            if name in out:
                raise ValueError(f"{where}: both {alias!r} and {name!r} given; {alias!r} is another name of {name!r}")
            out[name] = out.pop(alias)
    return out


def _rename_argv(argv: list[str], aliases: dict[str, str]) -> list[str]:
    """`--alias X` / `--alias=X` rewritten as the flag it stands for (both given: an error naming them)."""
    out = []
    for token in argv:
        flag, eq, value = token.partition("=")
        if flag.startswith("--") and flag[2:] in aliases:
            name = aliases[flag[2:]]
            if any(t == f"--{name}" or t.startswith(f"--{name}=") for t in argv):
                raise ValueError(f"both --{flag[2:]} and --{name} given; --{flag[2:]} is another name of --{name}")
            token = f"--{name}{eq}{value}"
        out.append(token)
    return out


def apply_yaml_defaults(
    parser: argparse.ArgumentParser, argv: list[str] | None = None, aliases: dict[str, str] | None = None
) -> str | None:
    """Add `--config` to `parser` and, when `argv` names a YAML file with it, make the file's values the parser's
    defaults (an `env:` mapping sets environment variables instead). Returns the file's path (or `None`).

    Raises:
        `ValueError`: the file is not a mapping, or has a key that is not one of the parser's flags (named).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(CONFIG_FLAG, default=None)
    path = pre.parse_known_args(argv)[0].config
    parser.add_argument(CONFIG_FLAG, default=None, help="YAML file of defaults for any flag; flags override it")
    if path is None:
        return None
    values = _rename(_read_yaml(path), aliases or {}, path)
    env = values.pop("env", None) or {}
    if not isinstance(env, dict):
        raise ValueError(f"{path}: `env` must be a mapping of environment variables to values, got {env!r}")
    unknown = sorted(k for k in values if k not in _flags(parser))
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; every key must be one of the script's flags (see --help)")
    os.environ.update({str(k): str(v) for k, v in env.items()})
    parser.set_defaults(**values)
    return path


def make_recipe_parser(
    dataclass_types,
    description: str | None = None,
    defaults: dict | None = None,
    prog: str | None = None,
    epilog: str | None = None,
) -> HfArgumentParser:
    """An `HfArgumentParser` over `dataclass_types` whose defaults are the dataclasses' own overridden by
    `defaults` (each key must be a flag: a recipe that names a field that does not exist fails at once)."""
    for t in dataclass_types:
        if "config" in {f.name for f in dataclasses.fields(t)}:
            raise ValueError(f"{t.__name__} has a field named 'config': the name is reserved for --config <yaml>")
    parser = HfArgumentParser(  # "resolve": a field in two dataclasses (trust_remote_code) is one flag for both
        dataclass_types,
        prog=prog,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        conflict_handler="resolve",
        allow_abbrev=False,  # a misspelt or shortened flag is an error, never another field
    )
    if defaults:
        unknown = sorted(set(defaults) - _flags(parser))
        if unknown:
            raise ValueError(f"recipe defaults name unknown fields {unknown}")
        parser.set_defaults(**defaults)
    return parser


def parse_recipe_args(
    dataclass_types,
    argv: list[str] | None = None,
    description: str | None = None,
    defaults: dict | None = None,
    aliases: dict[str, str] | None = None,
    prog: str | None = None,
) -> tuple:
    """Instances of `dataclass_types` from the recipe's `defaults`, `--config <yaml>` and the other flags.

    Args:
        dataclass_types (`tuple[type, ...]`): dataclasses whose fields are the flags (e.g. the script's arguments,
            `GRPOConfig`, `ModelConfig`); a field two of them have is one flag whose value goes to both.
        argv (`list[str]`, *optional*): the arguments, without the program name; defaults to `sys.argv[1:]`.
        description (`str`, *optional*): the text `--help` prints above the flags.
        defaults (`dict`, *optional*): the recipe's own defaults, overriding the dataclasses' (YAML and flags
            override these).
        aliases (`dict[str, str]`, *optional*): other names of flags, `{alias: flag}`, accepted on the command line
            and in the YAML file (e.g. the demo's `--backend` for `--generation_backend`).
        prog (`str`, *optional*): the program name `--help` shows.

    Returns:
        `tuple`: one instance per dataclass type, in order.

    Raises:
        `SystemExit`: (exit 2, argparse's message on stderr) an unknown flag or a bad value.
        `ValueError`: an unknown YAML key (named with the file).

    Example:

    >>> from grpo_async import GRPOConfig
    >>> (args,) = parse_recipe_args((GRPOConfig,), ["--seed", "3", "--use_cpu", "true"], defaults={"max_steps": 2})
    >>> args.seed, args.max_steps
    (3, 2)
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    aliases = aliases or {}
    parser = make_recipe_parser(dataclass_types, description, defaults, prog)
    apply_yaml_defaults(parser, argv, aliases)
    namespace = parser.parse_args(_rename_argv(argv, aliases))
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
