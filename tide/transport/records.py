"""Which path every CUDA call of a ``tide`` op took: ``"tide"`` or ``"stock"`` with the reason."""
from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("tide.transport")

_calls: Counter = Counter()
_warned: set = set()


def record(op: str, path: str, reason: str | None = None) -> None:
    key = (op, path, reason)
    _calls[key] += 1
    if path == "stock" and key not in _warned:
        _warned.add(key)
        log.info("tide.transport: %s takes the stock path (%s)", op, reason)


def stats() -> dict:
    """``{"calls": {"<op>:<path>[:<reason>]": n}, "arenas": {group_name: counters}}`` since the last reset."""
    from tide.transport import arena

    calls = {":".join(x for x in k if x): n for k, n in sorted(_calls.items(), key=lambda kv: str(kv[0]))}
    return {"calls": calls, "arenas": {name: a.counters() for name, a in arena.arenas().items()}}


def reset() -> None:
    _calls.clear()
