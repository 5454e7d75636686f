"""Derived values of `GRPOConfig`: a value `__post_init__` computed from other fields, marked so that a copy derives it
again instead of keeping a stale number (`dataclasses.replace(cfg, per_device_train_batch_size=8)`)."""

from __future__ import annotations

from typing import Any


class _Derived:
    """Marks a value that `__post_init__` derived from other fields rather than one the user gave.

    The value behaves exactly like its base type (`==`, arithmetic, `json.dumps`, `repr`); a config constructed from
    it (`dataclasses.replace`, `copy`, `GRPOConfig(**cfg.to_dict())`) derives the field again from the new values.
    """

    __slots__ = ()


class _DerivedInt(_Derived, int):
    __slots__ = ()


class _DerivedFloat(_Derived, float):
    __slots__ = ()


class _DerivedStr(_Derived, str):
    __slots__ = ()


def derived(value: Any) -> Any:
    """`value` marked as derived (ints, floats and strings; `None` and bools stay as they are)."""
    if value is None or isinstance(value, (bool, _Derived)):
        return value
    for base, marked in ((int, _DerivedInt), (float, _DerivedFloat), (str, _DerivedStr)):
        if isinstance(value, base):
            return marked(value)
    return value


def given(value: Any) -> Any:
    """What the user gave: `None` for a value an earlier `__post_init__` derived."""
    return None if isinstance(value, _Derived) else value


def is_derived(config: Any, name: str) -> bool:
    """Whether `config.<name>` was derived by `__post_init__` (from other fields) rather than set by the user."""
    return isinstance(getattr(config, name), _Derived)
