"""Leases of an arena's K all-gather slots: the one place that decides which slot an all-gather takes
and when a slot may be reused.

A slot is *held* while storages bound into it still point at it (FSDP's reshard ``resize_(0)`` drops the
pointer, whose deleter only lets go of the arena's leased region: tide/transport/lease.py), and *busy* until the event
of its last use on a stream other than the compute stream (the all-gather that filled it, a Slot-Reuse
reduce-scatter that read gradients from it) has completed: the next user's stream waits for that
event. Every decision depends only on host-side state that evolves identically on every rank (which
groups are unsharded), never on timing, so all ranks choose the same slot for every all-gather: the
peers push into that slot index.

An event belongs to the context it was recorded in: eager work, or one CUDA-graph capture
(``context()``, the capture's id; 0 when eager). A stream waits only for an event of its own context:
CUDA refuses a wait across a capture's boundary, and none is needed there. A capture's first use of a
slot lies in a region leased inside that capture (tide/transport/lease.py), and a replay's work is
ordered after everything queued before it on its stream, as work after it is after the whole replay.

Pure Python; streams and events are whatever the caller passes (``stream.wait_event(event)``).
"""
from __future__ import annotations

from typing import Callable, Sequence


class SlotLeases:
    def __init__(self, num_slots: int, context: Callable[[], int] = lambda: 0) -> None:
        self.num_slots = num_slots
        self._context = context
        self._bound: list = [None] * num_slots  # per slot: [(storage, address)] of the bound outputs
        self._event: list = [None] * num_slots  # per slot: (event, context) of its last use off the compute stream
        self._last_slot: dict[int, int] = {}  # id(owner key) -> slot its outputs were last bound in
        self._cursor = 0

    def is_held(self, slot: int) -> bool:
        """Whether outputs bound in ``slot`` still point at it (their group is unsharded)."""
        bound = self._bound[slot]
        return bound is not None and any(st.data_ptr() == addr and st.nbytes() > 0 for st, addr in bound)

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

    def wait(self, slot: int, stream) -> None:
        """Order ``stream`` after the last use of ``slot`` off the compute stream, if that use was in the
        current context."""
        last = self._event[slot]
        if last is not None and last[1] == self._context():
            stream.wait_event(last[0])

    def bind(self, slot: int, storages: Sequence, owners: Sequence = ()) -> None:
        """Record the storages just bound into ``slot`` (and, for each owner key, that it lives there)."""
        self._bound[slot] = [(st, st.data_ptr()) for st in storages]
        for key in owners:
            self._last_slot[id(key)] = slot

    def used(self, slot: int, event) -> None:
        """``event`` completes the latest use of ``slot`` off the compute stream."""
        self._event[slot] = (event, self._context())

    def event(self, slot: int):
        """The event of ``slot``'s latest use off the compute stream (None before any)."""
        last = self._event[slot]
        return None if last is None else last[0]

    def last_slot(self, owner) -> int | None:
        """The slot ``owner``'s outputs were last bound in."""
        return self._last_slot.get(id(owner))
