"""The arena's data region (its all-gather slots and reduce-scatter ring), leased per phase of a step.

A persistent region would sit beside the activations at their high-water mark (the loss) and beside
AdamW's step, where stock FSDP2 holds no communication buffer at all (docs/performance.md, Memory). So
the region is an ordinary tensor of torch's caching allocator, taken when an op or a view first needs
it and given back by :meth:`Leases.release` (FSDP: after the root's forward and at the end of backward,
tide/fsdp/wiring.py); the freed block then serves the activations.

- **Mapping.** Each rank exports the allocator segment that holds its region with legacy CUDA IPC
  (csrc/transport/ipc.h: torch never learns the segment is shared, so a freed lease is never parked).
  At each lease the ranks exchange handle and offset: on the arena's issued board (host memory every
  rank maps, tide/transport/board.py: plain reads, microseconds) after the first lease, else through the
  store (:func:`tide.agreement.exchange`: three requests whatever the world size, about 0.7 ms a lease on
  the GPU machine), and map peers' segments they have not mapped yet: the allocator hands the same block back
  phase after phase (``bench/lease_probe.py``), so a step maps nothing. A peer's mapping is closed when it
  drops out of the last ``MAPPINGS_PER_PEER`` handles seen, after this rank's pushes have drained: a segment a
  peer maps cannot go back to the device (``empty_cache``, the allocator's retry after a failed allocation),
  so few stay mapped.
- **Collective.** Every rank leases at the same point of its program (FSDP's decisions are identical on
  every rank); a rank that leases alone waits for its peers' keys and raises after the group's timeout,
  naming the lease.
- **Safety.** No peer writes into a region its owner has not leased: an all-gather's "free" flag is
  posted on the op's own stream after the lease and the op's issue, and after a lease the round
  counters skip R rounds, so a reduce-scatter's first rounds wait for permits its destination posts at
  the op's start (csrc/transport/flags.h; a rank that releases alone is the exception docs/design.md
  names). A released region stays alive while outputs bound into its slots or
  gradient views point into it (their storages hold it), and the allocator reuses it only after every
  stream that used it (``record_stream``) has passed that use.
- **Under CUDA-graph capture.** A lease taken while the step is captured is an ordinary lease of the
  graph's private pool, exchanged at capture; its addresses are baked into the graph and stay valid
  for the graph's life (the pool keeps its segments). A mapping opened or used inside a capture is kept
  for the arena's life (a replay writes through it), and none is closed during a capture (closing waits
  for this rank's pushes, which a capture cannot). A region held across a capture's boundary is refused:
  the capture would bake in memory that eager work uses too.
- **Fallback.** Legacy IPC cannot export expandable segments or cudaMallocAsync pools. When any rank's
  export fails at the first lease, every rank puts the region in symmetric memory for the arena's life
  instead (its peak then includes the region, as before leasing), and :attr:`Leases.mode` says why.
- **The direct lane.** An arena's second :class:`Leases` (``Arena.direct``) leases the outputs of one
  all-gather whose outputs lie in no slot: a region of that call's size, leased and released around the
  call (the outputs keep it alive), on the board's second channel. It has no symmetric fallback: where
  export fails, :meth:`Leases.acquire` returns None and the call gathers another way.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from tide import agreement

MAPPINGS_PER_PEER = 2  # a forward and a backward lease in different segments


class Leases:
    """The data region of one arena on this rank: leased, exchanged, mapped and released.

    Arguments:
        ext: the CUDA extension (ipc_export / ipc_open / ipc_close).
        group: the arena's process group (the symmetric fallback rendezvous over it).
        store, prefix: where the ranks exchange their handles.
        nbytes: the region's size (identical on every rank).
        set_region: called at each new lease with this rank's region, every rank's region address and the
            CUDA-graph capture it was leased in (0: eagerly); with None, zeros and 0 at its release.
        sync_pushes: waits until none of this rank's copies still writes into a peer's region.
        context: the id of the CUDA-graph capture in progress, 0 when none.
        held_here: whether the held region may be used in the current context (the lease rule, written once in
            the extension: ``Arena::held_in``, csrc/transport/arena.h); None for leases given back within the
            call that took them (the direct lane's), which no other context can find held.
        board: the arena's issued board (its ``exchange_lease``), which carries every lease after the first;
            None: the store carries them all.
        channel: the board's lease channel (``tide.transport.board.LEASE_CHANNELS``) these leases use.
        symmetric_fallback: whether a region that cannot be exported goes to symmetric memory (else
            :meth:`acquire` returns None).
        mappings_per_peer: peer segments kept mapped per peer (the oldest closes beyond it).
    """

    def __init__(self, ext, group, store, prefix: str, rank: int, world: int, device: torch.device, nbytes: int,
                 timeout_s: float, label: str, set_region: Callable[[torch.Tensor | None, list[int], int], None],
                 sync_pushes: Callable[[], None], context: Callable[[], int] = lambda: 0,
                 held_here: Callable[[], bool] | None = None, board=None,
                 channel: int = 0, symmetric_fallback: bool = True,
                 mappings_per_peer: int = MAPPINGS_PER_PEER) -> None:
        self._ext, self._group, self._store, self._prefix = ext, group, store, prefix
        self.rank, self.world, self.device, self.nbytes = rank, world, device, nbytes
        self._timeout_s, self._label = timeout_s, label
        self._set_region, self._sync_pushes, self._context, self._board = set_region, sync_pushes, context, board
        self._held_here = held_here
        self._channel, self._symmetric_fallback = channel, symmetric_fallback
        self._mappings_per_peer = mappings_per_peer
        self._leased_in = 0  # the context the held region was leased in
        self._kept: set[bytes] = set()  # handles a captured graph writes through: never closed
        self.mode = "allocator"  # or "symmetric (<why>)" / "none (<why>)" once any rank's export failed
        self.count = 0  # leases taken, all ranks alike
        self.maps_opened = 0  # peer segments mapped so far (the allocator moved a lease when this grows)
        self.seconds = 0.0  # wall time spent leasing so far (the exchange with the peers included)
        self._failed: str | None = None  # a lease failed: the ranks' lease numbers may differ from now on
        self._region: torch.Tensor | None = None
        self._symmetric = None  # the fallback's rendezvous handle, kept with the region
        self._mapped: list[dict[bytes, int]] = [{} for _ in range(world)]  # per peer: handle -> base, oldest first

    @property
    def held(self) -> torch.Tensor | None:
        """The region while leased, else None."""
        return self._region

    def acquire(self, nbytes: int | None = None) -> torch.Tensor | None:
        """The leased region; a new lease (collective: every rank at the same point) when none is held, of
        ``nbytes`` when given (the same on every rank). None when the region cannot be exported and there is
        no symmetric fallback. After a failed lease every later one raises that error: the ranks' lease
        numbers may differ."""
        if self.held_elsewhere():
            raise RuntimeError(f"tide.transport: the data region of the arena of {self._label} was leased "
                               f"{'inside a' if self._leased_in else 'outside the'} CUDA-graph capture "
                               "and is still held: capture whole phases (a lease ends after the root's forward and "
                               "at the end of backward), or release the arena's lease first")
        if self._region is None:
            if self._failed is not None:
                raise RuntimeError(self._failed)
            if self.mode.startswith("none"):
                return None
            self.nbytes = self.nbytes if nbytes is None else int(nbytes)
            start = time.perf_counter()
            try:
                self._leased_in = self._context()
                self._lease()
            except Exception as e:
                self._failed = f"{e} (the arena cannot lease again; disable it)"
                raise
            finally:
                self.seconds += time.perf_counter() - start
        return self._region

    def held_elsewhere(self) -> bool:
        """Whether the held region was leased in another context than the current one: outside the
        CUDA-graph capture in progress, or inside one when none is (a capture must not bake in memory
        that eager work uses, nor eager work use a graph's). The extension's rule (``held_here``), which the
        ops' gate applies too."""
        return self._region is not None and self._held_here is not None and not self._held_here()

    def release(self) -> None:
        """Give the region back to the caching allocator once nothing points into it (in symmetric mode it
        stays). Local, but every rank must release at the same point: the next acquire is collective."""
        if self._symmetric is None and self._region is not None:
            self._region = None
            self._set_region(None, [0] * self.world, 0)  # no op may address a released region, here or at a peer

    def close(self) -> None:
        """Release the region and unmap every peer (the arena is closing; its work has completed)."""
        self._region, self._symmetric = None, None
        self._set_region(None, [0] * self.world, 0)  # the extension's copy of the region goes too
        # They hold the extension's arena, which closes now.
        self._set_region = self._sync_pushes = self._held_here = None
        for maps in self._mapped:
            for base in maps.values():
                self._ext.ipc_close(base=base, device=self.device.index)
            maps.clear()

    # ------------------------------------------------------------------------------------ one lease
    def _lease(self) -> None:
        self.count += 1
        what = f"tide.transport: lease #{self.count} of the arena of {self._label}"
        if self.count == 3 or (self.count > 3 and self._board is None):
            # every peer has read lease n-2's key: it published lease n-1's after reading it
            self._store.delete_key(f"{self._prefix}/lease{self.count - 2}/{self.rank}")
        if self.mode == "allocator":
            region = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            handle, offset, error = self._ext.ipc_export(tensor=region)
            mine = f"error:{error.splitlines()[0]}" if error else f"{handle.hex()}:{offset}"
            try:
                if self._board is not None and self.count > 1:
                    theirs = self._board.exchange_lease(self.count, mine, self._timeout_s, what, self._channel)
                else:
                    theirs = self._exchange_by_store(mine, what)
            except RuntimeError as e:
                raise RuntimeError(f"{e}{self._refusals()}") from None
            errors = [(p, v[len("error:"):]) for p, v in enumerate(theirs) if v.startswith("error:")]
            if not errors:
                self._region = region
                self._set_region(region, [region.data_ptr() if p == self.rank else self._map(p, v)
                                          for p, v in enumerate(theirs)], self._leased_in)
                return
            if self.count > 1:  # the mode was agreed at the first lease; a later failure is not expected
                raise RuntimeError(f"{what}: rank(s) {[p for p, _ in errors]} cannot export the region: {errors[0][1]}")
            why = f"rank {errors[0][0]} cannot export allocator memory by CUDA IPC: {errors[0][1]}"
            if not self._symmetric_fallback:
                self.mode = f"none ({why})"
                return
            self.mode = f"symmetric ({why})"
            del region
        from torch.distributed import _symmetric_memory as symm_mem

        self._region = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._symmetric = symm_mem.rendezvous(self._region, self._group)
        # Never freed, so any context may use it (the extension's rule says so for EVERY_CONTEXT).
        self._set_region(self._region, [int(p) for p in self._symmetric.buffer_ptrs], self._ext.EVERY_CONTEXT)

    def _refusals(self) -> str:
        """Why peers that never came to a lease may be missing: the graph calls they refused (their compiled
        graph issued another collective here, tide/transport/graph_calls.py), as the issued board shows."""
        if self._board is None:
            return ""
        return "".join(f"; {agreement.peer_words(p)} refused its graph call {rec.refused_call} (the ranks' compiled "
                       "graphs issue their collectives in different orders)"
                       for p, rec in enumerate(self._board.records()) if p != self.rank and rec.refused_call)

    def _exchange_by_store(self, mine: str, what: str) -> list[str]:
        """Every rank's lease value through the store. The first lease, which fixes the mode, also settles
        whether the later ones go by the board: only if every rank mapped it."""
        if self.count > 1:
            return agreement.exchange(self._store, f"{self._prefix}/lease{self.count}", self.rank, self.world, mine,
                                      self._timeout_s, what)
        values = agreement.exchange(self._store, f"{self._prefix}/lease1", self.rank, self.world,
                                    f"{mine};board={int(self._board is not None)}", self._timeout_s, what)
        theirs = [v.rpartition(";board=") if ";board=" in v else (v, "", "0") for v in values]
        if not all(flag == "1" for _, _, flag in theirs):
            self._board = None
        return [v for v, _, _ in theirs]

    def _map(self, peer: int, value: str) -> int:
        """Peer ``peer``'s region address here, mapping its segment unless this handle is mapped already."""
        hex_handle, offset = value.split(":")
        handle = bytes.fromhex(hex_handle)
        maps = self._mapped[peer]
        base = maps.pop(handle, None)
        capturing = self._leased_in != 0
        if capturing:
            self._kept.add(handle)
        if base is None:
            base = self._ext.ipc_open(handle=handle, device=self.device.index)
            self.maps_opened += 1
            closable = [h for h in maps if h not in self._kept]
            # The oldest goes, once no push can target it.
            if len(closable) >= self._mappings_per_peer and not capturing:
                self._sync_pushes()
                self._ext.ipc_close(base=maps.pop(closable[0]), device=self.device.index)
        maps[handle] = base  # the most recent last
        return base + int(offset)
