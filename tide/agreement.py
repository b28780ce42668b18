"""Ranks agree on a call before any data moves: desynchronisation is an error that names it, not wrong data.

A TIDE op's transport plan depends only on its op, shapes and dtypes (and flags). On CUDA every rank
publishes the description of each new plan (the arena's n-th) in the process group's store and compares
it with its peers' before the plan is first used: ranks that issue another op, layout or dtype there
raise, naming both calls, and a peer that never gets there is named after the op's timeout. (Later uses
of a known plan are not checked on the host, which would cost a round trip per op; a peer that skips
one then stalls, and the watchdog reports which of its flags are behind.) The reference backend on CPU
compares every call (tide/ops/reference.py).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Sequence


def call_desc(op: str, tensor_lists: Sequence[Sequence], flags: Sequence = ()) -> str:
    """What the ranks must agree on: the op, every tensor's shape and dtype, and the flags."""
    lists = "; ".join(", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in ts)
                      for ts in tensor_lists)
    return f"{op}({lists}{''.join(f'; {f}' for f in flags)})"


def first_difference(a: str, b: str, context: int = 60) -> str:
    """The two descriptions around where they first differ (they may be long: one entry per parameter)."""
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, i - context // 2)
    cut = lambda s: ("..." if start else "") + s[start:start + context] + ("..." if start + context < len(s) else "")
    return f"{cut(a)!r} vs {cut(b)!r}"


def exchange(store, prefix: str, rank: int, world_size: int, value: str, timeout_s: float, what: str) -> list[str]:
    """Publish ``value`` under ``prefix`` for ``rank`` and return every rank's value, in rank order; raises
    ``RuntimeError`` (the message starts with ``what``) when a peer has not published within ``timeout_s``.
    Three store requests whatever the world size (set, wait, one multi-get); the keys stay (a call site
    numbers its prefixes)."""
    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{p}" for p in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as e:
        missing = [p for p in range(world_size) if not store.check([keys[p]])]
        raise RuntimeError(f"{what}: rank(s) {missing} did not reach this call within {timeout_s:g} s (a peer "
                           f"died or issued fewer TIDE ops): {e}") from None
    theirs = iter(store.multi_get(keys[:rank] + keys[rank + 1:]))
    return [value if p == rank else next(theirs).decode() for p in range(world_size)]


def agree(store, prefix: str, rank: int, world_size: int, desc: str, timeout_s: float, what: str) -> None:
    """Check that all ``world_size`` ranks publish the same ``desc`` under ``prefix`` (:func:`exchange`);
    raises ``RuntimeError`` (the message starts with ``what``) on a mismatch or a missing peer."""
    for p, theirs in enumerate(exchange(store, prefix, rank, world_size, desc, timeout_s, what)):
        if theirs != desc:
            raise RuntimeError(f"{what}: ranks issued different calls at the same point: this rank {rank} issued "
                               f"{desc[:200]!r}, rank {p} issued {theirs[:200]!r} (they first differ at "
                               f"{first_difference(desc, theirs)})")
