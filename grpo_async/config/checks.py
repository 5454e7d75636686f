"""Per-field constraints of `GRPOConfig`, declared on the field and checked in one pass by [`check_fields`].

A field declares its constraint where it is declared, with [`checked_field`] (`dataclasses.field` plus the
constraint), or by a `Literal[...]` type (its choices). `check_fields` runs them in field order and raises a
`ValueError` naming the field:

```txt
temperature: float = checked_field(Number(gt=0), default=1.0, metadata={"help": ...})
GRPOConfig(temperature=0.0)  →  ValueError: GRPOConfig.temperature: must be a number > 0, got 0.0
```
The constraint is not kept in `metadata`: `transformers.HfArgumentParser` passes a field's metadata to argparse's
`add_argument`, which accepts only its own keywords. Rules that relate several fields live in `rules.py`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal


def config_error(name: str, message: str) -> ValueError:
    """The `ValueError` every config check raises: `GRPOConfig.<name>: <message>`."""
    return ValueError(f"GRPOConfig.{name}: {message}")


@dataclass(frozen=True)
class Number:
    """A number within bounds (an `int`, never a `bool`, when `integer`); `None` too when `optional`.

    Args:
        ge, gt, le, lt (`float`, *optional*):
            Bounds: `>=`, `>`, `<=`, `<`.
        integer (`bool`, *optional*, defaults to `False`):
            The value must be an `int`.
        optional (`bool`, *optional*, defaults to `False`):
            `None` is accepted (off, or derived from other fields).
        what (`str`, *optional*):
            What the error says the value must be; default: written from the bounds ("an int >= 1").
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    integer: bool = False
    optional: bool = False
    what: str = ""

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def describe(self) -> str:
        if self.what:
            return self.what
        bounds = [
            f"{op} {b}"
            for op, b in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if b is not None
        ]
        text = ("an int " if self.integer else "a number ") + " and ".join(bounds)
        return text + (" or None" if self.optional else "")


@dataclass(frozen=True)
class OneOf:
    """One of `choices` (a tuple, or a function returning the names a registry holds now); `None` too when `optional`.

    `hint` is appended to the list of choices in the error.
    """

    choices: tuple | Callable[[], tuple]
    optional: bool = False
    hint: str = ""

    def names(self) -> tuple:
        return tuple(self.choices()) if callable(self.choices) else tuple(self.choices)

    def accepts(self, value: Any) -> bool:
        return (value is None and self.optional) or value in self.names()

    def describe(self) -> str:
        return f"one of {self.names()}{self.hint}"


@dataclass(frozen=True)
class InstanceOf:
    """An instance of `types` (or `None`, unless `optional=False`); `what` says it in words."""

    types: type | tuple[type, ...]
    what: str
    optional: bool = True

    def accepts(self, value: Any) -> bool:
        return (value is None and self.optional) or isinstance(value, self.types)

    def describe(self) -> str:
        return self.what


Check = Number | OneOf | InstanceOf
#: the constraint of each field declared with `checked_field` (a dataclass keeps the `Field` object it was given)
_FIELD_CHECKS: dict[dataclasses.Field, Check] = {}


def checked_field(check: Check, **kwargs: Any) -> Any:
    """`dataclasses.field(**kwargs)` whose value must satisfy `check` (see [`check_fields`])."""
    f = dataclasses.field(**kwargs)
    _FIELD_CHECKS[f] = check
    return f


def field_check(f: dataclasses.Field) -> Check | None:
    """The constraint `f` declares: its `checked_field` constraint, else its `Literal[...]` choices, else `None`."""
    check = _FIELD_CHECKS.get(f)
    if check is None and typing.get_origin(f.type) is Literal:
        check = OneOf(typing.get_args(f.type))
    return check


def check_fields(config: Any, extra: Mapping[str, Check] = {}) -> None:  # noqa: B006 (read only)
    """Check every field of `config` against its declared constraint (and the fields of `extra`, constraints on
    inherited fields); raise a `ValueError` naming the first field that violates its constraint."""
    for f in dataclasses.fields(config):
        check = extra.get(f.name) or field_check(f)
        if check is None:
            continue
        value = getattr(config, f.name)
        if not check.accepts(value):
            raise config_error(f.name, f"must be {check.describe()}, got {value!r}")
