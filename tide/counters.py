"""Counters of every decision TIDE takes, read through the one stats API: ``tide.stats()``.

- ``fsdp``: per FSDP2 collective kind (``all_gather``, ``reduce_scatter``), calls per path, ``"tide"`` or
  ``"stock:<reason>"`` (docs/fsdp.md has the reasons);
- ``wiring``: what FSDP2 on the CUDA transport did: ``ag:bound`` (outputs bound in an arena slot, zero-copy
  TIDE-AG), ``ag:direct`` (a group not bound in slots, gathered in place by the op's reference backend),
  ``rs:in_place`` / ``rs:slot_reuse`` (reduce-scatters; Slot-Reuse when the group's gradients were read
  from its slot), ``rs:grad_into_slot`` (gradients the Slot-Reuse hooks moved), ``arena:created``;
- ``ops``: calls of the mutating ``torch.ops.tide`` ops (the functional pair calls them), ``"<op>:tide"``
  (the CUDA transport, counted in C++ for the calls that stayed there: tide/ops/cuda.py), ``"<op>:tide_multinode"`` (the
  multi-node schedule) or ``"<op>:stock:<reason>"`` (a CUDA call on the reference backend), ``"<op>:reference"`` (a CPU
  call); and calls of the graph ops (``all_gather_start``, ``reduce_scatter_start``: :func:`count_graph_op`), which call
  the mutating ops (an all-gather on the direct lane enters the transport itself: counted only as the graph op's);
- ``multinode``: point-to-point rounds of the multi-node schedule per leg and implementation
  (``"rail:p2p"``, ``"intra:p2p_host_staged"``, ...: ``tide/multinode/rails.py``), and its sums by
  implementation (``"sum:kernel"``, ``"sum:torch"``: ``tide/sums.py``);
- ``arenas``: each live arena's own counters (copies, bytes, kernels, host time), by its ranks.

A path other than TIDE's is logged once per reason (INFO for op calls, WARNING for FSDP2 fallbacks of an
opted-in group).
"""
from __future__ import annotations

import logging
from collections import Counter

from tide import registry, trace

log = logging.getLogger("tide")


def count_fsdp(kind: str, reason: str | None, multinode: bool = False) -> None:
    """One FSDP2 collective of ``kind``: on TIDE (``reason`` None; ``"tide_multinode"`` when the group
    spans several nodes) or stock for ``reason``."""
    path = ("tide_multinode" if multinode else "tide") if reason is None else f"stock:{reason}"
    registry.fsdp_calls[kind][path] += 1
    if trace.ENABLED:
        trace.event(f"fsdp {kind}: {path}")
    if reason is not None and ("fsdp", kind, reason) not in registry.logged_reasons:
        registry.logged_reasons.add(("fsdp", kind, reason))
        # A group that never opted in is not a fallback worth a warning.
        level = logging.DEBUG if reason == "not_enabled" else logging.WARNING
        log.log(level, "tide.fsdp: %s takes the stock FSDP2 path (reason: %s); logged once", kind, reason)


def count_wiring(key: str, n: int = 1) -> None:
    registry.wiring_calls[key] += n
    if trace.ENABLED:
        trace.event(f"wiring {key}" + (f" x{n}" if n != 1 else ""))


def count_op(op: str, reason: str | None = None, multinode: bool = False, reference: bool = False) -> None:
    """One call of ``torch.ops.tide.<op>``: on the CUDA transport (``reason`` None), on the multi-node
    schedule (``multinode``: a group spanning nodes), on the reference backend by choice (``reference``: CPU
    tensors), or on the reference for ``reason`` (a CUDA call the transport cannot take)."""
    if multinode:
        path = f"{op}:tide_multinode"
    elif reference:
        path = f"{op}:reference"
    else:
        path = f"{op}:tide" if reason is None else f"{op}:stock:{reason}"
    registry.op_calls[path] += 1
    if trace.ENABLED:
        trace.event(f"op {path}")
    if reason is not None and ("op", op, reason) not in registry.logged_reasons:
        registry.logged_reasons.add(("op", op, reason))
        log.info("tide.transport: %s takes the stock path (%s)", op, reason)


def count_graph_op(op: str, path: str) -> None:
    """One call of the graph op ``op``, counted as ``"<op>:<path>"`` by where its outputs came from (the mutating
    op it calls counts which backend moved the data): ``"reference"`` (CPU: a synchronous call, its work
    complete), ``"slot"`` (CUDA: ``all_gather_start``'s outputs in a free arena slot, written by TIDE-AG),
    ``"allocator"`` / ``"allocator:<why no slot>"`` (CUDA: outputs from the caching allocator, written by the
    transport; the all-gather's on its direct lane: ``no_free_slot``, ``slot_too_small``,
    ``lease_across_capture``), ``"empty"`` (nothing to gather) or ``"reference:<why>"`` (CUDA: gathered by
    the reference backend: ``no_arena``, ``world_size``, ``no_ipc``). Each reason is logged once."""
    registry.op_calls[f"{op}:{path}"] += 1
    if trace.ENABLED:
        trace.event(f"op {op}:{path}")
    kind, _, why = path.partition(":")
    if why and ("op", op, path) not in registry.logged_reasons:
        registry.logged_reasons.add(("op", op, path))
        if kind == "reference":
            log.info("tide.transport: %s runs on the reference backend (%s)", op, why)
        else:
            log.info("tide.transport: %s outputs come from the caching allocator (%s), not an arena slot", op, why)


def count_multinode(key: str) -> None:
    """One point-to-point round of the multi-node schedule, ``"<leg>:<implementation>"``
    (``tide/multinode/rails.py``), or one of its sums, ``"sum:kernel"`` or ``"sum:torch"`` (``tide/sums.py``)."""
    registry.multinode_calls[key] += 1
    if trace.ENABLED:
        trace.event(f"multinode {key}")


def stats() -> dict:
    """Every counter since the last :func:`reset_stats` (see the module docstring)."""
    ops = Counter(registry.op_calls)
    for calls, _ in registry.op_call_sources:
        ops.update(calls())
    return {"fsdp": {kind: dict(c) for kind, c in registry.fsdp_calls.items()}, "wiring": dict(registry.wiring_calls),
            "ops": dict(sorted(ops.items())), "multinode": dict(sorted(registry.multinode_calls.items())),
            "arenas": {a.ranks: a.counters() for a in registry.arenas.values()}}


def reset_stats() -> None:
    """Clear the counters (the arenas' own counters only grow)."""
    for c in (*registry.fsdp_calls.values(), registry.wiring_calls, registry.op_calls, registry.multinode_calls):
        c.clear()
    for _, reset in registry.op_call_sources:
        reset()
