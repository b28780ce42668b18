"""The issued board: what every rank of an arena has issued, in host memory that all its processes map,
so that a stalled rank's watchdog says which peer is behind, and whether that peer's process is still
there, with no CUDA call. The flag words need one (a copy from the GPU), and a launch spinning on a
stream queue full behind a dead peer holds the driver lock that copy needs.

One file in /dev/shm per arena: rank 0 creates it and names it through the store, every rank maps it,
and the last rank to have tried unlinks it (a count in the store), so a rank that dies afterwards leaves
nothing behind; the arena's rank 0 also unlinks it should its rendezvous fail. Rank r's
record starts with ``2 + L + W`` uint32 words (L all-gather lanes: the K slots and the direct lane,
csrc/transport/flags.h):

    + 0          the rank's process id
    + 1          1 once the rank has mapped the board
    + 2 + i      all-gather uses of lane i < L   (the arena's ``ag_uses``, mirrored by the extension
    + 2 + L + d  reduce-scatter rounds toward destination d < W    under its progress lock: ``rs_rounds``)

After them, per lease channel (:data:`LEASE_CHANNELS`: the data region's leases, the direct lane's), two
lease slots of 64 words each: ``(number, length, value bytes)``, where the ranks
exchange each lease's handle and offset (:meth:`IssuedBoard.exchange_lease`) with plain memory reads
instead of a store round trip: lease n goes in slot n % 2 of its channel, its number written last. A peer publishes
lease n + 2 only after it has read every rank's lease n + 1, which this rank publishes only after it has
read lease n: no slot is overwritten before every rank has read it. Plain stores become visible in
program order only on x86-64 (:data:`ORDERED_STORES`); elsewhere the leases go through the store.

Last, the graph calls (tide/transport/graph_calls.py): the number of the call this rank refused (0: none),
then a ring of :data:`GRAPH_CALLS` entries of 18 words ``(number, digest, length, description bytes)``: graph
call n in entry n % GRAPH_CALLS, its number cleared first and written last.

A rank that cannot open the file (a process on another host) has no board; the others' reports say its
record is missing.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import time
import uuid
from dataclasses import dataclass

from tide import agreement, procfs

_DIR = "/dev/shm"
_HEADER = 2  # pid, mapped
_LEASE_SLOT_WORDS = 64  # number, length, then the value's bytes
_LEASE_VALUE_BYTES = 4 * (_LEASE_SLOT_WORDS - 2)
LEASE_CHANNELS = 2  # the arena's data region (0) and its direct lane (1), each numbering its own leases
GRAPH_CALLS = 512  # graph calls a rank's ring keeps: a peer this many calls ahead can no longer be compared
_CALL_WORDS = 18  # number, digest, length, then the call's description (its first 60 bytes)
_CALL_TEXT_BYTES = 4 * (_CALL_WORDS - 3)
ORDERED_STORES = platform.machine() in ("x86_64", "AMD64")


@dataclass(frozen=True)
class Record:
    """One rank's words as read from the board."""
    pid: int
    mapped: bool
    ag_uses: list[int]  # per all-gather lane: the slots, then the direct lane
    rs_rounds: list[int]
    graph_call: int = 0  # the last graph call it published (tide/transport/graph_calls.py)
    refused_call: int = 0  # the graph call it refused, its peers' being another


class IssuedBoard:
    """This process's mapping of an arena's board (see the module docstring)."""

    def __init__(self, path: str, rank: int, world: int, ag_lanes: int, create: bool) -> None:
        self.path, self.rank, self.world, self.ag_lanes = path, rank, world, ag_lanes
        self.progress_words = _HEADER + ag_lanes + world
        self.graph_words = self.progress_words + LEASE_CHANNELS * 2 * _LEASE_SLOT_WORDS
        self.record_words = self.graph_words + 1 + _CALL_WORDS * GRAPH_CALLS
        size = 4 * self.record_words * world
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:  # pages reserved now: a full /dev/shm raises here instead of a SIGBUS at a write
                os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)
        except OSError:
            if create:
                _unlink(path)
            raise
        finally:
            os.close(fd)
        struct.pack_into("<2I", self._map, 4 * self.record_words * rank, os.getpid(), 1)

    @classmethod
    def rendezvous(cls, store, key: str, rank: int, world: int, ag_lanes: int) -> "IssuedBoard | None":
        """Every rank of the arena calls this together; rank 0 names the file through ``store``. None where
        the file cannot be created or opened (no /dev/shm, a full one, or a rank on another host)."""
        board = None
        if rank == 0:
            path = os.path.join(_DIR, f"tide-board-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                board = cls(path, rank, world, ag_lanes, create=True)
            except OSError:
                path = ""
            store.set(key, path)
        else:
            path = store.get(key).decode()
            try:
                board = cls(path, rank, world, ag_lanes, create=False) if path else None
            except OSError:
                board = None
        if path and store.add(f"{key}/tried", 1) == world:
            _unlink(path)  # every rank has mapped it, or failed to: the mappings outlive the name
        return board

    def unlink(self) -> None:
        """Remove the name (the arena's rank 0, when its rendezvous failed before every rank tried)."""
        _unlink(self.path)

    def progress_address(self) -> int:
        """Address of this rank's ``ag_uses`` words, for the extension's mirror (``publish_progress_to``)."""
        view = ctypes.c_char.from_buffer(self._map, 4 * (self.record_words * self.rank + _HEADER))
        address = ctypes.addressof(view)
        del view  # the mapping stays; only the export that would keep it from closing goes
        return address

    def _lease_slot(self, rank: int, n: int, channel: int) -> int:
        return 4 * (self.record_words * rank + self.progress_words + (2 * channel + n % 2) * _LEASE_SLOT_WORDS)

    def exchange_lease(self, n: int, value: str, timeout_s: float, what: str, channel: int = 0) -> list[str]:
        """Publish this rank's ``value`` (at most 248 bytes are kept) for lease ``n`` of ``channel`` and return every
        rank's, in rank order; raises ``RuntimeError`` (starting with ``what``) when a peer has not published it
        within ``timeout_s``."""
        data = value.encode()[:_LEASE_VALUE_BYTES]
        mine = self._lease_slot(self.rank, n, channel)
        self._map[mine + 8:mine + 8 + len(data)] = data
        struct.pack_into("<I", self._map, mine + 4, len(data))
        struct.pack_into("<I", self._map, mine, n)  # last: the record is complete
        deadline, spins = time.monotonic() + timeout_s, 0
        waiting = [p for p in range(self.world) if p != self.rank]
        while waiting:
            waiting = [p for p in waiting
                       if struct.unpack_from("<I", self._map, self._lease_slot(p, n, channel))[0] != n]
            if waiting:
                if time.monotonic() > deadline:
                    raise RuntimeError(agreement.not_reached(what, waiting, timeout_s))
                spins += 1
                time.sleep(0 if spins < 1000 else 5e-5)
        out = []
        for p in range(self.world):
            at = self._lease_slot(p, n, channel)
            length = struct.unpack_from("<I", self._map, at + 4)[0]
            out.append(bytes(self._map[at + 8:at + 8 + length]).decode(errors="replace"))
        return out

    def _call_entry(self, rank: int, n: int) -> int:
        return 4 * (self.record_words * rank + self.graph_words + 1 + _CALL_WORDS * (n % GRAPH_CALLS))

    def publish_call(self, n: int, digest: int, description: str) -> None:
        """This rank's graph call ``n`` (numbered from 1): its ``digest`` and the start of its ``description``;
        the number written last."""
        at = self._call_entry(self.rank, n)
        text = description.encode()[:_CALL_TEXT_BYTES]
        struct.pack_into("<I", self._map, at, 0)  # the entry's old call (n - GRAPH_CALLS) is gone first
        self._map[at + 12:at + 12 + len(text)] = text
        struct.pack_into("<2I", self._map, at + 4, digest, len(text))
        struct.pack_into("<I", self._map, at, n)

    def call_of(self, rank: int, n: int) -> tuple[int, str] | None:
        """``rank``'s (digest, start of the description) of its graph call ``n``, or None while it has not
        published it (or when its ring has moved past it)."""
        at = self._call_entry(rank, n)
        number, digest, length = struct.unpack_from("<3I", self._map, at)
        if number != n:
            return None
        return digest, bytes(self._map[at + 12:at + 12 + min(length, _CALL_TEXT_BYTES)]).decode(errors="replace")

    def refuse_call(self, n: int) -> None:
        """This rank refused its graph call ``n`` (for its peers' reports)."""
        struct.pack_into("<I", self._map, 4 * (self.record_words * self.rank + self.graph_words), n)

    def records(self) -> list[Record]:
        words = struct.unpack_from(f"<{self.record_words * self.world}I", self._map)
        out = []
        for r in range(self.world):
            base = r * self.record_words
            w = words[base:base + self.progress_words]
            ring = words[base + self.graph_words + 1:base + self.record_words:_CALL_WORDS]
            out.append(Record(pid=w[0], mapped=w[1] == 1, ag_uses=list(w[_HEADER:_HEADER + self.ag_lanes]),
                              rs_rounds=list(w[_HEADER + self.ag_lanes:]), graph_call=max(ring),
                              refused_call=words[base + self.graph_words]))
        return out

    def close(self) -> None:
        """After the extension's mirror has stopped (``publish_progress_to(0)``)."""
        self._map.close()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _compare(peer: list[int], mine: list[int], what: str) -> str | None:
    """How a peer's per-lane (or per-destination) counts stand against this rank's: None when equal."""
    diff = [p - m for p, m in zip(peer, mine)]
    if not any(diff):
        return None
    if all(d <= 0 for d in diff):
        return f"{-sum(diff)} {what} behind this rank"
    if all(d >= 0 for d in diff):
        return f"{sum(diff)} {what} ahead of this rank"
    return f"{what} in another order than this rank's {mine}"


def report(records: list[Record], rank: int, ranks, state=procfs.state) -> list[str]:
    """One line per peer for the watchdog's report: its process and its state (``state(pid)``, from
    /proc), and how its issued work stands against this rank's, lane by lane and destination by
    destination."""
    mine = records[rank]
    lines = []
    for p, rec in enumerate(records):
        if p == rank:
            continue
        who = f"  {agreement.peer_words(p, ranks[p])}"
        if not rec.mapped:
            lines.append(f"{who}: no record on the issued board (another host, or it could not map the board)")
            continue
        lags = [c for c in (_compare(rec.ag_uses, mine.ag_uses, "all-gather use(s)"),
                            _compare(rec.rs_rounds, mine.rs_rounds, "reduce-scatter round(s)")) if c]
        lines.append(f"  {agreement.peer_words(p, ranks[p], rec.pid, state(rec.pid))}: "
                     + (f"issued all-gather uses {rec.ag_uses} per lane and reduce-scatter rounds {rec.rs_rounds}, "
                        + ", ".join(lags) if lags else "issued as far as this rank"))
        if rec.refused_call:
            lines.append(f"{who} refused its graph call {rec.refused_call}: the call this rank issued there was "
                         "another (the ranks' compiled graphs issue their collectives in different orders)")
        elif rec.graph_call != mine.graph_call:
            lines.append(f"{who} is at graph call {rec.graph_call}, this rank at {mine.graph_call}")
    return lines
