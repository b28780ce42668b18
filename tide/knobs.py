"""The one reader of TIDE's environment variables, each declared once in :data:`KNOBS`.

A knob is a positive integer, a count (an integer >= 0), a positive number, one of its choices,
or a flag (``0`` or ``1``). :func:`get` reads one by name: an unset or empty variable gives its declared default (None
for a number: its reader's own default, a tuning constant beside the code it tunes or worked out from the device or the
group); any other value must parse as its kind or the read raises ``ValueError`` naming the variable, its
value and what is accepted. :func:`validate_all` reads every knob, and TIDE's first use in a process
(``tide.fsdp.enable``, the first call of an op kernel) runs it through :func:`validate_once`: a bad value
raises there whatever the device, also for a knob whose reader never runs on it. No other module reads
``os.environ`` for a setting (tests/test_knobs.py checks it). Only the standard library, so that
``setup.py`` can load this file on its own.
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

RS_MODES = ("in_place", "slot_reuse")  # tide.fsdp.enable's rs_mode
TRANSPORTS = ("auto", "reference")  # tide.fsdp.enable's transport
RAILS_CHOICES = ("auto", "p2p", "nccl")  # the multi-node rails (tide/multinode/rails.py)


class Knob(NamedTuple):
    kind: str  # "positive_int", "count", "positive_float", "choice" or "flag"
    default: object = None  # what an unset or empty variable reads as
    choices: tuple = ()  # a choice's accepted values


KNOBS: dict[str, Knob] = {
    "TIDE_FSDP_TRANSPORT": Knob("choice", "auto", TRANSPORTS),
    "TIDE_RS_MODE": Knob("choice", "in_place", RS_MODES),  # tide.torchtitan
    "TIDE_TIMEOUT_S": Knob("positive_float"),  # default: the process group's timeout
    "TIDE_TRACE": Knob("flag", False),
    "LOCAL_WORLD_SIZE": Knob("positive_int"),  # torchrun's ranks per node; default: one node
    "TIDE_MULTINODE_PACE_BYTES": Knob("positive_int"),  # default: tide.meta.multinode.DEFAULT_PACE_BYTES
    "TIDE_MULTINODE_RAILS": Knob("choice", "auto", RAILS_CHOICES),
    "TIDE_CUDA_MULTINODE": Knob("flag", False),
    "TIDE_RS_CTAS": Knob("positive_int"),  # default: one per SM
    "TIDE_RS_RING_BYTES": Knob("positive_int"),  # default: tide.transport.arena.DEFAULT_RS_RING_BYTES
    "TIDE_RS_RING_DEPTH": Knob("positive_int"),  # default: tide.transport.arena.DEFAULT_RING_DEPTH
    "TIDE_AG_CAST_CTAS": Knob("positive_int"),  # default: tide.transport.arena.CAST_CTAS_PER_SM per SM
    "TIDE_COMPILE_PREFETCH": Knob("count", 1),  # tide.compile: all-gather buckets issued ahead
    "TIDE_ALLOW_MULTICAST": Knob("flag", False),
    "TIDE_BUILD_VERBOSE": Knob("flag", False),
    "TIDE_BUILD_CUDA": Knob("flag", False),  # setup.py: compile the CUDA extension at install time
}


def _positive_int(value: str, knob: Knob) -> int:
    number = int(value)
    if number < 1:
        raise ValueError
    return number


def _count(value: str, knob: Knob) -> int:
    number = int(value)
    if number < 0:
        raise ValueError
    return number


def _positive_float(value: str, knob: Knob) -> float:
    number = float(value)
    if not 0 < number < math.inf:
        raise ValueError
    return number


def _choice(value: str, knob: Knob) -> str:
    if value not in knob.choices:
        raise ValueError
    return value


def _flag(value: str, knob: Knob) -> bool:
    if value not in ("0", "1"):
        raise ValueError
    return value == "1"


_KINDS = {  # kind -> (its parser, what it accepts)
    "positive_int": (_positive_int, lambda knob: "an integer >= 1"),
    "count": (_count, lambda knob: "an integer >= 0"),
    "positive_float": (_positive_float, lambda knob: "a number > 0"),
    "choice": (_choice, lambda knob: f"one of {knob.choices}"),
    "flag": (_flag, lambda knob: "0 or 1"),
}


def get(name: str):
    """The declared knob ``name`` from the environment: its default when unset or empty, else its value
    parsed as its kind (a bad value raises ``ValueError`` naming ``name``, the value and what is accepted)."""
    knob = KNOBS.get(name)
    if knob is None:
        raise KeyError(f"tide.knobs.get: {name!r} is not a declared knob (declare it in tide.knobs.KNOBS)")
    value = os.environ.get(name, "")
    if value == "":
        return knob.default
    parse, accepted = _KINDS[knob.kind]
    try:
        return parse(value, knob)
    except ValueError:
        raise ValueError(f"tide: {name} must be {accepted(knob)}, got {value!r}") from None


def flag(name: str) -> bool:
    """:func:`get` of a knob declared a flag: whether it is on."""
    if KNOBS.get(name, Knob("")).kind != "flag":
        raise KeyError(f"tide.knobs.flag: {name!r} is not a declared flag")
    return get(name)


def validate_all() -> None:
    """Read every declared knob: the first bad value raises its ``ValueError``."""
    for name in KNOBS:
        get(name)


# Whether validate_all passed in this process. It is kept here, not in tide.registry: this file loads alone.
_validated = False


def validate_once() -> None:
    """:func:`validate_all` at TIDE's first use; after it passed, a flag test. A bad value raises at every
    use until it is fixed."""
    global _validated
    if not _validated:
        validate_all()
        _validated = True
