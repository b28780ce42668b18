"""The one reader of TIDE's environment variables: each read is validated where it happens.

An unset or empty variable gives the caller's default; any other value must parse as the reader's type
or the read raises ``ValueError`` naming the variable, its value and what is accepted. No other module
reads ``os.environ`` for a setting (tests/test_knobs.py checks it). Only the standard library, so that
``setup.py`` can load this file on its own.
"""
from __future__ import annotations

import os
from typing import Collection, TypeVar

T = TypeVar("T")


def _raw(name: str) -> str | None:
    value = os.environ.get(name, "")
    return value if value != "" else None


def _bad(name: str, value: str, accepted: str) -> ValueError:
    return ValueError(f"tide: {name} must be {accepted}, got {value!r}")


def _number(name: str, default: T, parse, accepted: str, ok) -> int | float | T:
    value = _raw(name)
    if value is None:
        return default
    try:
        number = parse(value)
    except ValueError:
        raise _bad(name, value, accepted) from None
    if not ok(number):
        raise _bad(name, value, accepted)
    return number


def positive_int(name: str, default: T) -> int | T:
    """``name`` as an integer >= 1, else ``default`` when unset."""
    return _number(name, default, int, "an integer >= 1", lambda n: n >= 1)


def positive_float(name: str, default: T) -> float | T:
    """``name`` as a finite number > 0, else ``default`` when unset."""
    return _number(name, default, float, "a number > 0", lambda n: 0 < n < float("inf"))


def choice(name: str, choices: Collection[str], default: str) -> str:
    """``name`` as one of ``choices``, else ``default`` when unset."""
    value = _raw(name)
    if value is None:
        return default
    if value not in choices:
        raise _bad(name, value, f"one of {tuple(choices)}")
    return value


def flag(name: str) -> bool:
    """``name`` as a switch: ``1`` on, ``0`` (or unset) off."""
    value = _raw(name)
    if value is None or value == "0":
        return False
    if value == "1":
        return True
    raise _bad(name, value, "0 or 1")
