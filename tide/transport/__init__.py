"""TIDE's CUDA transport inside one NVLink domain: a symmetric arena per TIDE group, zero-SM TIDE-AG
(copy-engine copies + stream-memop flags) and TIDE-RS (copy-engine pushes into a bounded staging ring,
a bounded-grid fp32 summing kernel). See docs/design.md ("CUDA transport").

Importing this package builds nothing and needs no GPU: the extension is compiled on first use
(:func:`tide.transport.build.load`).

Functions for the FSDP2 seam:
    enable(group, slot_bytes=... | layouts=[...])  -> Arena   (collective, once, outside graph capture)
    get(group_name) -> Arena | None
    Arena.bind_outputs(outs, slot=None) -> slot               (points FSDP's all-gather outputs into a slot)
    Arena.next_slot()                                         (the slot the next all-gather takes)
    Arena.reduce_scatter_params(..., rs_mode="slot_reuse")    (packs into the just-vacated slot first)
"""
from tide.transport.arena import Arena, arenas, disable, enable, get, register  # noqa: F401
from tide.transport.records import reset as reset_stats  # noqa: F401
from tide.transport.records import stats  # noqa: F401

__all__ = ["Arena", "enable", "disable", "get", "register", "arenas", "stats", "reset_stats"]
