"""What a TIDE call is in the caller's program: the identity its ranks compare before any data moves.

Ranks pair collective calls in the order they issue them (gloo and NCCL alike), so two calls with the
same op and layout cannot be told apart by the ops alone: a rank that skipped one pairs its next call
with its peers' skipped one. A caller that knows what a call is in its program declares it::

    with tide.call_identity(fqn="layers.0", phase="forward", count=3):
        torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group_name)

Blocks nest: an inner block adds its fields to the outer ones (and overrides those it names again), so a
training loop can declare its step (``tide.train.train_step`` declares ``step``) while the FSDP2 seam
declares each CPU call's module, phase and per-module count. The reference backend carries the identity in
every call's fingerprint (``tide/ops/calls.py``): ranks whose identities differ all raise, naming both
sides' calls in words, before anything is exchanged. The CUDA transport does not compare identities (it
has no per-call host exchange).

Field values are anything with a stable ``str``; the known fields read as words (:func:`describe`):
``fqn`` (a module's name, "" for the root), ``phase``, ``count`` (the module's n-th call in that phase),
``step``; others as ``name=value``. The identity is a context variable: each thread (and asyncio task) has
its own, and a new thread starts with none.
"""
from __future__ import annotations

import contextvars

_IDENTITY: contextvars.ContextVar[tuple] = contextvars.ContextVar("tide_call_identity", default=())


class call_identity:  # noqa: N801 (a context manager, used like a function)
    """Declare fields of the identity of the TIDE calls issued inside the block (see the module doc).

    A class rather than a generator, so that entering and leaving costs a context variable's set and reset
    (the FSDP2 seam enters one per collective)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields) -> None:
        self._fields = fields
        self._token = None

    def __enter__(self) -> "call_identity":
        outer = _IDENTITY.get()
        if outer:
            merged = dict(outer)
            merged.update(self._fields)
            identity = tuple(merged.items())
        else:
            identity = tuple(self._fields.items())
        self._token = _IDENTITY.set(identity)
        return self

    def __exit__(self, *exc) -> None:
        _IDENTITY.reset(self._token)


def current() -> tuple:
    """The identity declared where this is called: ``((field, value), ...)`` in declaration order."""
    return _IDENTITY.get()


def describe(identity: tuple) -> str:
    """The identity in words: ``"layers.0 forward #3, step 5"`` (``""`` when none was declared)."""
    fields = dict(identity)
    head = []
    if "fqn" in fields:
        head.append(str(fields.pop("fqn")) or "root")
    if "phase" in fields:
        head.append(str(fields.pop("phase")))
    if "count" in fields:
        head.append(f"#{fields.pop('count')}")
    rest = [f"step {fields.pop('step')}"] if "step" in fields else []
    rest += [f"{k}={v}" for k, v in fields.items()]
    return ", ".join(x for x in (" ".join(head), *rest) if x)
