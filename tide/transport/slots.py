"""Leases of an arena's K all-gather slots: the one place that decides which slot an all-gather takes
and when a slot may be reused.

A slot is *held* while storages bound into it are alive and still point at it (FSDP's reshard
``resize_(0)`` drops the pointer, whose deleter only lets go of the arena's leased region:
tide/transport/lease.py; a compiled graph frees the outputs of ``all_gather_start`` when it has read them
last: their storages die). The leases hold the storages weakly, so that they never keep one alive. *Busy*
until the event of its last use on a stream other than the compute stream (the all-gather that filled it, a
Slot-Reuse reduce-scatter that read gradients from it) has completed: the next all-gather into it waits for
that event on its own stream before any rank writes there (csrc/transport/all_gather.cpp). Every decision
depends only on host-side state that evolves identically on every rank (which groups are unsharded), never
on timing, so all ranks choose the same slot for every all-gather: the peers push into that slot index.

The busy events live in the extension's arena (csrc/transport/arena.h), where the ops' C++ kernels wait
for them and record their own uses (an all-gather's slot, the slots a Slot-Reuse reduce-scatter reads)
without entering Python; a stock reduce that read the slot records its use here (:meth:`SlotLeases.used`). An
event belongs to the context it was recorded in: eager work, or one CUDA-graph capture. A stream waits only
for an event of its own context: CUDA refuses a wait across a capture's boundary, and none is needed there.
A capture's first use of a slot lies in a region leased inside that capture (tide/transport/lease.py), and
a replay's work is ordered after everything queued before it on its stream, as work after it is after the
whole replay.

Pure Python but for ``events``: the extension's arena (``slot_used`` / ``slot_uses``,
streams as their ``cuda_stream``), or a stand-in.
"""
from __future__ import annotations

import weakref
from typing import Sequence


class SlotLeases:
    def __init__(self, num_slots: int, events=None) -> None:
        self.num_slots = num_slots
        self._events = events
        self._bound: list = [None] * num_slots  # per slot: [(weak storage, address)] of the bound outputs
        self._last_slot: dict[int, int] = {}  # id(owner key) -> slot its outputs were last bound in
        self._cursor = 0

    def is_held(self, slot: int) -> bool:
        """Whether outputs bound in ``slot`` are alive and still point at it (their group is unsharded)."""
        bound = self._bound[slot]
        return bound is not None and any((st := ref()) is not None and st.data_ptr() == addr and st.nbytes() > 0
                                         for ref, addr in bound)

    def held(self) -> int:
        return sum(self.is_held(i) for i in range(self.num_slots))

    def acquire(self, prefer: int | None = None) -> int | None:
        """A slot no outputs hold: ``prefer`` if free, else the first free one from the round-robin cursor;
        None when every slot is held. The cursor moves past the slot returned."""
        if prefer is not None and 0 <= prefer < self.num_slots and not self.is_held(prefer):
            slot = prefer
        else:
            slot = next((s for s in ((self._cursor + k) % self.num_slots for k in range(self.num_slots))
                         if not self.is_held(s)), None)
            if slot is None:
                return None
        self._cursor = (slot + 1) % self.num_slots
        self._bound[slot] = None
        return slot

    def bind(self, slot: int, storages: Sequence, owners: Sequence = ()) -> None:
        """Record the storages just bound into ``slot`` (and, for each owner key, that it lives there)."""
        self._bound[slot] = [(weakref.ref(st), st.data_ptr()) for st in storages]
        for key in owners:
            self._last_slot[id(key)] = slot

    def used(self, slot: int, stream) -> None:
        """``slot`` is used off the compute stream by the work queued on ``stream`` so far: it is busy until
        that work has completed."""
        self._events.slot_used(slot=slot, stream=stream.cuda_stream)

    def uses(self, slot: int) -> int:
        """How many uses of ``slot`` were recorded so far."""
        return self._events.slot_uses(slot=slot)

    def last_slot(self, owner) -> int | None:
        """The slot ``owner``'s outputs were last bound in."""
        return self._last_slot.get(id(owner))
