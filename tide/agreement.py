"""Ranks agree on a call before any data moves: desynchronisation is an error that names it, not wrong data.

One model of a call for every backend and fault path: :class:`CallRecord` (the op, its number, what it moves,
its digest and its caller's declared identity). Ranks compare it through the store (the reference backend's
every call, tide/ops/calls.py, identity included; a CUDA plan's first use, below, by what it moves) or on the
CUDA transport's issued board (the graph ops, tide/transport/graph_calls.py, by digest); :func:`different_calls`
and :func:`not_reached` word what any of them found (ranks whose calls differ; peers that never came).

A TIDE op's transport plan depends only on its op, shapes and dtypes (and flags). On CUDA every rank
publishes the description of each new plan (the arena's n-th) in the process group's store and compares
it with its peers' before the plan is first used: ranks that issue another op, layout or dtype there
raise, naming both calls, and a peer that never gets there is named after the op's timeout. (Later uses
of a known plan are not checked on the host, which would cost a round trip per op; a peer that skips
one then stalls, and the watchdog reports which of its flags are behind.) The reference backend on CPU
compares every call (tide/ops/reference.py).
"""
from __future__ import annotations

import dataclasses
import zlib
from datetime import timedelta
from typing import Sequence

from tide.meta import call_site


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One call as its ranks compare it: ``op``, its number ``n`` among the calls compared on its group or
    arena, what it moves (``desc``: :func:`call_desc`), the CRC32 of that (``digest``), and the identity its
    caller declared (``tide.call_identity``; "" when none)."""
    op: str
    n: int
    desc: str
    digest: int
    identity: str

    @classmethod
    def of(cls, op: str, n: int, tensor_lists: Sequence[Sequence], flags: Sequence = ()) -> "CallRecord":
        desc = call_desc(op, tensor_lists, flags)
        return cls(op, n, desc, zlib.crc32(desc.encode()), call_site.describe(call_site.current()))


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


def peer_words(peer: int, global_rank: int | None = None, pid: int | None = None,
               process_state: str | None = None) -> str:
    """How both fault backends name a peer of a group in a report: ``peer p (global rank g)``, then its process
    where it is known, ``, process N (state)`` (the state from /proc: ``tide.procfs.state``)."""
    words = f"peer {peer}" if global_rank is None else f"peer {peer} (global rank {global_rank})"
    if pid is not None:
        return f"{words}, process {pid} ({process_state})"
    return words if process_state is None else f"{words} ({process_state})"


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
        raise RuntimeError(f"{not_reached(what, missing, timeout_s)}: {e}") from None
    theirs = iter(store.multi_get(keys[:rank] + keys[rank + 1:]))
    return [value if p == rank else next(theirs).decode() for p in range(world_size)]


def agree(store, prefix: str, rank: int, world_size: int, desc: str, timeout_s: float, what: str) -> None:
    """Check that all ``world_size`` ranks publish the same ``desc`` under ``prefix`` (:func:`exchange`);
    raises ``RuntimeError`` (the message starts with ``what``) on a mismatch or a missing peer."""
    for p, theirs in enumerate(exchange(store, prefix, rank, world_size, desc, timeout_s, what)):
        if theirs != desc:
            raise RuntimeError(different_calls(f"{what}: ranks", None, rank, repr(desc[:200]), p, repr(theirs[:200]))
                               + f" (they first differ at {first_difference(desc, theirs)})")


def different_calls(ranks: str, n: int | None, rank: int, mine: str, peer: int, theirs: str,
                    kind: str = "calls") -> str:
    """The one wording of ranks that issued different calls at the same point (their ``n``-th compared call,
    when numbered): ``ranks`` names them, ``mine`` and ``theirs`` are this rank's and ``peer``'s calls in words."""
    at = "at the same point" if n is None else f"at call {n}"
    return f"{ranks} issued different {kind} {at}: this rank {rank} issued {mine}, rank {peer} issued {theirs}"


def not_reached(what: str, missing: Sequence[int], timeout_s: float) -> str:
    """The one wording of peers that did not reach a call (an exchange, a lease) within the timeout."""
    return (f"{what}: rank(s) {list(missing)} did not reach this call within {timeout_s:g} s (a peer died or issued "
            "fewer TIDE ops)")
