"""The arena of one set of ranks: its memory and identity (flags, the leased data region, slots, the
direct lane), built in named steps (:class:`Arena`). Which arena serves a group is its route's
(:mod:`tide.routes`, by ranks: every process group over the same ranks, in the same order, finds the same
arena; :mod:`tide.transport.serving` makes them, :mod:`tide.registry` holds them). The collectives that run on
an arena are drivers of their own: :mod:`tide.transport.all_gather`, :mod:`tide.transport.reduce_scatter`
and :mod:`tide.transport.node_leg`.

One arena per set of ranks, rendezvoused once (never inside CUDA-graph capture; its ops may be captured:
docs/design.md, "Captured into a CUDA graph"). Its byte layout and
flag words are defined once, in ``csrc/transport/flags.h``; this module asks the extension for the
offsets. Two regions per rank:

- flags, in torch symmetric memory for the arena's life (CUDA backend; several processes may share one
  GPU with ``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` over a gloo group)::

    [0, flags_bytes)                       int32 flag words

- data, leased from the caching allocator per phase and released between phases
  (:mod:`tide.transport.lease`; :meth:`Arena.release`)::

    slots_off + i * slot_bytes             all-gather slot i < K (param-major, GroupLayout offsets)
    ring_off + (s * W + q) * entry_bytes   reduce-scatter staging entry of ring slot s < R, contributor q

Sizes: K = ``num_slots`` (default 2: FSDP2 holds the current and the prefetched block; 0 when no group
is bound in slots), ``slot_bytes`` the largest group bound in a slot; the staging ring is at most
``rs_ring_bytes`` in all (``TIDE_RS_RING_BYTES``, default 64 MiB), R = ``ring_depth``
(``TIDE_RS_RING_DEPTH``, default 2) slots of W entries, each entry cut to ``rs_piece_bytes`` when the
caller knows the reduce-scatters it serves (FSDP: its largest block's, one round per destination; a
small model's ring is then no larger than its blocks need, and the root's once-a-step reduce-scatter
may take several rounds). At W = 2 the default gives 16 MiB entries, because
every round costs its push stream about 11 us beside its data (a stream-memop wait, then the ready-flag
copy; bench/timeline.py, docs/performance.md), so fewer, larger rounds win from 256 MiB up (the plans
cut an op's rounds equal, :func:`tide.meta.plans.pack_rounds`). The arena alone leases its slots
(:class:`tide.transport.slots.SlotLeases`) and hands out views of its memory; a reduce-scatter that
reads gradients lying in a slot (where FSDP's Slot-Reuse hooks put them) keeps that slot busy until it
has read them.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from tide import agreement, knobs, registry, sums, timeouts
from tide.meta import plans
from tide.meta.layout import GroupLayout, align_up
from tide.transport import board, issue, watchdog
from tide.transport.lease import Leases
from tide.transport.slots import SlotLeases

DEFAULT_RS_RING_BYTES = 64 << 20
DEFAULT_RING_DEPTH = 2
CAST_CTAS_PER_SM = 4
DIRECT_MAPPINGS_PER_PEER = 8  # the direct lane's outputs come from several allocator segments a step


class Arena:
    """Flags (symmetric memory), the leased data region and the CUDA streams of one set of ranks.

    Arguments:
        group: the ranks' process group (gloo or NCCL); every rank must construct its arena together.
        slot_bytes: bytes of one all-gather slot (the largest ``GroupLayout.slot_bytes`` bound in a slot);
            0 gives an arena without slots (reduce-scatters only; all-gathers take the reference path).
        num_slots: K, the all-gather slots.
        rs_ring_bytes: bytes of the reduce-scatter staging ring at most (``TIDE_RS_RING_BYTES``).
        rs_piece_bytes: one destination's bytes of the largest reduce-scatter the ring is for
            (:func:`tide.meta.plans.rs_piece_bytes`): the entries are cut to it (None: not known,
            the entries fill ``rs_ring_bytes``).
        ring_depth: R, staging slots per destination, each of W entries (``TIDE_RS_RING_DEPTH``): up to R
            rounds of a reduce-scatter are in flight.
        sum_ctas: CTAs of the summing kernel (``TIDE_RS_CTAS``, default one per SM: :func:`tide.sums.summing_ctas`).
        cast_ctas: at most this many CTAs for TIDE-AG's own-shard kernel (``TIDE_AG_CAST_CTAS``, default 4 per
            SM: a short burst on every SM); fewer leave SMs and HBM bandwidth to the work beside it.
    """

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int, *, num_slots: int = 2,
                 rs_ring_bytes: int | None = None, rs_piece_bytes: int | None = None, ring_depth: int | None = None,
                 sum_ctas: int | None = None, cast_ctas: int | None = None) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tide.transport.Arena: cannot rendezvous during CUDA-graph capture; enable TIDE "
                               "before capturing")
        from tide import extension

        self.ext = extension.load()
        self._identify(group)
        self._size(slot_bytes, num_slots, rs_ring_bytes, rs_piece_bytes, ring_depth, sum_ctas, cast_ctas)
        self._agree_layout()
        bases = self._rendezvous_flags()
        self._build_native(bases)
        self._make_leases()
        self._watch()

    # ------------------------------------------------------------------------------------ construction steps
    def _identify(self, group: dist.ProcessGroup) -> None:
        """Who: the group, its ranks, this rank's device and the store."""
        self.group = group
        self.group_name = group.group_name
        self.world_size = group.size()
        self.rank = group.rank()
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.timeout_s = timeouts.timeout_for(group)
        self.label = f"{self.group_name!r} (ranks {list(self.ranks)}, this rank {self.rank})"
        self.store = dist.distributed_c10d._get_default_store()
        self.plans: dict = {}  # the node leg's plans (tide/transport/node_leg.py); the collectives' are the extension's
        self.plans_agreed = 0  # plans agreed on so far, every kind (numbers their store keys)
        self.graph_calls = 0  # graph-op calls issued on the arena (numbers them: tide/transport/graph_calls.py)
        self._bind_places: dict = {}  # (W, (numel, dtype) of each output) -> (slot offset, bytes) of each

    def _size(self, slot_bytes, num_slots, rs_ring_bytes, rs_piece_bytes, ring_depth, sum_ctas, cast_ctas) -> None:
        """How big: slots, ring and CTAs from the arguments, else the knobs; the byte layout from the extension."""
        W = self.world_size
        self.slot_bytes = align_up(int(slot_bytes), 4096)
        self.num_slots = num_slots if self.slot_bytes > 0 else 0
        self.ring_depth = ring_depth or knobs.get("TIDE_RS_RING_DEPTH") or DEFAULT_RING_DEPTH
        self.sum_ctas = sum_ctas or sums.summing_ctas(self.device)
        ring = rs_ring_bytes or knobs.get("TIDE_RS_RING_BYTES") or DEFAULT_RS_RING_BYTES
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.cast_ctas = cast_ctas or knobs.get("TIDE_AG_CAST_CTAS") or CAST_CTAS_PER_SM * sms
        if self.ring_depth < 1 or self.sum_ctas < 1 or self.cast_ctas < 1 or self.num_slots < 0:
            raise ValueError("tide.transport.Arena: ring_depth, sum_ctas and cast_ctas must be >= 1, num_slots >= 0")
        self.entry_bytes = max(4096, (ring // (self.ring_depth * W)) // 4096 * 4096)
        if rs_piece_bytes:
            self.entry_bytes = min(self.entry_bytes, align_up(rs_piece_bytes, 4096))
        layout = self.ext.arena_layout(num_slots=self.num_slots, ring_depth=self.ring_depth, world=W,
                                       slot_bytes=self.slot_bytes, entry_bytes=self.entry_bytes)
        self.flags_bytes, self.slots_off = layout["flags_bytes"], layout["slots_off"]
        self.data_bytes = layout["data_bytes"]
        self.flag_words, self.flag_index = layout["flag_words"], layout["flag_index"]
        self.ring_off = layout["ring_off"]

    def _agree_layout(self) -> None:
        """This arena's generation of its ranks (its store keys); then the layout, agreed: ranks laid out
        differently would push into each other's wrong addresses."""
        registry.arena_generations[self.ranks] += 1
        self.store_prefix = f"tide/arena/{'_'.join(map(str, self.ranks))}/{registry.arena_generations[self.ranks]}"
        agreement.agree(self.store, f"{self.store_prefix}/layout", self.rank, self.world_size,
                        f"Arena(num_slots={self.num_slots}, slot_bytes={self.slot_bytes}, "
                        f"ring_depth={self.ring_depth}, entry_bytes={self.entry_bytes})", self.timeout_s,
                        f"tide.transport.enable (group {self.label}): the arena's layout must be the same on every "
                        "rank (TIDE_RS_RING_BYTES, TIDE_RS_RING_DEPTH and the slot size)")

    def _rendezvous_flags(self) -> list[int]:
        """The issued board, then the flag words in symmetric memory, zeroed on every rank: every rank's base."""
        from torch.distributed import _symmetric_memory as symm_mem

        # One lane per slot and the direct lane.
        self.board = board.IssuedBoard.rendezvous(self.store, f"{self.store_prefix}/board", self.rank,
                                                  self.world_size, self.num_slots + 1)
        try:
            self.flags = symm_mem.empty(self.flags_bytes, dtype=torch.uint8, device=self.device)
            self.handle = symm_mem.rendezvous(self.flags, self.group)
        except BaseException:
            if self.board is not None and self.rank == 0:
                self.board.unlink()  # a peer that never reached the board leaves no count to unlink it
            raise
        bases = [int(p) for p in self.handle.buffer_ptrs]
        if bases[self.rank] != self.flags.data_ptr():
            raise RuntimeError("tide.transport.Arena: symmetric buffer does not start at its allocation base")
        self.flags.zero_()
        self.flags.view(torch.int32)[self.flag_index["one"]] = 1  # the captured "ready" copies' source (flags.h)
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)  # no peer writes a flag before every rank has zeroed its own
        return bases

    def _build_native(self, flag_bases: list[int]) -> None:
        """The extension's arena (streams, flag handshakes, what was issued) and the slots' leases."""
        self.native = self.ext.Arena(rank=self.rank, world=self.world_size, flag_bases=flag_bases,
                                     device=self.device.index, num_slots=self.num_slots, slot_bytes=self.slot_bytes,
                                     ring_depth=self.ring_depth, entry_bytes=self.entry_bytes, sum_ctas=self.sum_ctas,
                                     cast_ctas=self.cast_ctas)
        if self.board is not None:
            self.native.publish_progress_to(self.board.progress_address())
        self.slots = SlotLeases(self.num_slots, events=self.native)

    def _make_leases(self) -> None:
        """The data region's leases, and the direct lane's: one lease per all-gather that finds no slot
        (tide/transport/all_gather.py)."""
        c, W = self.native, self.world_size
        lease_board = self.board if self.board is not None and board.ORDERED_STORES else None
        capture = functools.partial(self.ext.capture_id, self.device.index)
        self.leases = Leases(self.ext, self.group, self.store, self.store_prefix, self.rank, W, self.device,
                             self.data_bytes, self.timeout_s, self.label,
                             set_region=c.set_region, sync_pushes=c.sync_pushes, context=capture,
                             held_here=c.region_held_here, board=lease_board)
        self.direct = Leases(self.ext, self.group, self.store, f"{self.store_prefix}/direct", self.rank, W, self.device,
                             0, self.timeout_s, self.label, set_region=c.set_direct, sync_pushes=c.sync_pushes,
                             context=capture, board=lease_board, channel=1, symmetric_fallback=False,
                             mappings_per_peer=DIRECT_MAPPINGS_PER_PEER)

    def _watch(self) -> None:
        # The watchdog's flag report allocates nothing when it runs (the driver may be wedged by then).
        self.report_host = torch.empty(self.flag_words, dtype=torch.int32, pin_memory=True)
        arena = weakref.ref(self)  # the watchdog keeps no arena alive

        def describe():
            live = arena()
            return issue.report(live) if live is not None else iter(["  (the arena was dropped)"])

        watchdog.WATCHDOG.track_in_flight(self.native.in_flight, self.label, self.timeout_s, describe,
                                          owner=self.store_prefix)

    def __repr__(self) -> str:
        return (f"Arena(group={self.group_name!r}, W={self.world_size}, rank={self.rank}, slots={self.num_slots}x"
                f"{self.slot_bytes}, ring={self.ring_depth}x{self.world_size}x{self.entry_bytes}, "
                f"sum_ctas={self.sum_ctas}, cast_ctas={self.cast_ctas}, data={self.leases.mode})")

    @property
    def symmetric_bytes(self) -> int:
        """This rank's symmetric memory, which the caching allocator's counters do not see: the flag words,
        plus the data region when it fell back to symmetric memory (:mod:`tide.transport.lease`)."""
        return self.flags_bytes + (self.data_bytes if self.leases.mode != "allocator" else 0)

    def region(self) -> torch.Tensor:
        """This rank's data region (slots and ring), leased if none is held (collective then: every rank
        at the same point); the current stream is recorded as a user of it. A held region is found in one
        call of the extension, which asks the lease rule (``Arena::held_in``); only a call it refuses enters
        :class:`tide.transport.lease.Leases` (a new lease, or the rule's error)."""
        region = self.native.region_here()
        if region is None:
            watchdog.WATCHDOG.check()  # a lease waits for every peer: none comes once a TIDE op has timed out
            region = self.leases.acquire()
            self.native.use_region_on_current_stream()  # the allocator keeps the set: once per lease suffices
        return region

    def release(self) -> None:
        """Let the data region go back to the caching allocator once nothing points into it any more (bound
        outputs and gradient views keep it alive). Every rank must release at the same point: the next
        op or view leases again, collectively. FSDP releases after the root's forward and at the end of
        backward (tide/fsdp/wiring.py)."""
        self.leases.release()

    def close(self) -> None:
        """Wait for this arena's work and release its memory and streams (after :func:`disable`). After a
        TIDE op timed out this raises the watchdog's error at once instead: that work never completes, and
        the process is about to end."""
        if self.native is None:
            return
        watchdog.WATCHDOG.check()
        torch.cuda.synchronize(self.device)  # nothing of this rank writes into a peer's region any more
        self.native.publish_progress_to(0)
        watchdog.WATCHDOG.forget(self.store_prefix)  # its graphs cannot replay once it is closed
        self.leases.close()
        self.direct.close()
        self.slots = None  # its events are the extension arena's
        self.native = None  # destroys the streams and events
        self.plans.clear()
        if self.board is not None:
            self.board.close()
            self.board = None
        self.handle = None
        self.flags = None  # the symmetric allocation goes back to the driver

    # ------------------------------------------------------------------------------------ slots and views
    def _check_slot(self, op: str, slot: int) -> int:
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"tide.transport.{op}: slot must be in [0, {self.num_slots}), got {slot}")
        return slot

    def read_from_slots(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Keep every slot that holds one of ``tensors`` busy until the current stream has passed this point
        (work queued there read them); whether any did."""
        slots = {s for s in map(self.slot_of, tensors) if s is not None}
        stream = torch.cuda.current_stream(self.device)
        for slot in slots:
            self.slots.used(slot, stream)
        return bool(slots)

    def _slot_base(self, slot: int) -> int:
        return self.slots_off + slot * self.slot_bytes

    def slot_of(self, tensor: torch.Tensor) -> int | None:
        """The slot of the held region whose bytes ``tensor`` starts in, or None (the extension's rule,
        which the ops' C++ kernels apply too)."""
        slot = self.native.slot_of(ptr=tensor.data_ptr())
        return None if slot < 0 else slot

    def slot_views(self, layout: GroupLayout, dtypes: Sequence[torch.dtype], slot: int) -> list[torch.Tensor]:
        """1-D views of this rank's slot ``slot`` at every param's all-gather output (param-major)."""
        slot = self._check_slot("slot_views", slot)
        if layout.slot_bytes > self.slot_bytes:
            raise ValueError(f"tide.transport: group needs {layout.slot_bytes} slot bytes, the arena has "
                             f"{self.slot_bytes}")
        base, region = self._slot_base(slot), self.region()
        return [region[base + p.slot_offset:base + p.slot_offset + p.out_bytes].view(dt)
                for p, dt in zip(layout.params, dtypes)]

    def grad_views(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype],
                   slot: int) -> list[torch.Tensor]:
        """Tensors of the given gradient shapes at their params' all-gather output addresses in slot
        ``slot`` (param-major): where Slot-Reuse reads gradients (FSDP's hooks put them there)."""
        slot = self._check_slot("grad_views", slot)
        layout = GroupLayout([tuple(s) for s in shapes], [d.itemsize for d in dtypes], self.world_size)
        if layout.slot_bytes > self.slot_bytes:
            raise ValueError(f"tide.transport.grad_views: group needs {layout.slot_bytes} slot bytes, the arena has "
                             f"{self.slot_bytes}")
        base, region = self._slot_base(slot), self.region()
        return [region[base + p.slot_offset:base + p.slot_offset + math.prod(s) * d.itemsize].view(d).view(tuple(s))
                for s, d, p in zip(shapes, dtypes, layout.params)]

    def view_at(self, tensor: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor of ``shape`` and ``dtype`` over the arena bytes where ``tensor`` starts, or None when
        those bytes do not lie inside one slot."""
        slot = self.slot_of(tensor)
        if slot is None:
            return None
        region = self.region()
        offset = tensor.data_ptr() - region.data_ptr()
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > self._slot_base(slot) + self.slot_bytes:
            return None
        return region[offset:offset + nbytes].view(dtype).view(tuple(shape))

    def _places(self, outs: Sequence[torch.Tensor], world_size: int) -> tuple[list, list, int] | None:
        """(slot offset, bytes) of each 1-D all-gather output of a ``world_size``-rank group, param-major, and
        the slot bytes the group needs; None when an output has no W*c elements."""
        W = world_size
        key = (W, *[(o.numel(), o.dtype) for o in outs])
        places = self._bind_places.get(key)
        if places is None and not any(o.numel() % W for o in outs):
            layout = plans.all_gather_layout([(o.numel() // W,) for o in outs], [o.dtype for o in outs], W)
            places = self._bind_places[key] = ([p.slot_offset for p in layout.params],
                                               [p.out_bytes for p in layout.params], layout.slot_bytes)
        return places

    def bound_slot(self, outs: Sequence[torch.Tensor], world_size: int) -> int | None:
        """The slot in which every output of ``outs`` (1-D, of a ``world_size``-rank all-gather) lies at its
        param-major address, or None (the extension's rule: ``placed_slot``, csrc/transport/arena.h)."""
        places = self._places(outs, world_size)
        slot = -1 if places is None else self.native.placed_slot(outs=outs, offsets=places[0], need=places[2])
        return None if slot < 0 else slot

    def bind_outputs(self, outs: Sequence[torch.Tensor], slot: int, owners: Sequence = (),
                     world_size: int | None = None) -> None:
        """Point the storages of the 1-D all-gather outputs ``outs`` (their views see it too) into slot
        ``slot`` at their param-major addresses, and lease the slot to them until they are resharded;
        ``owners`` (one key per output, e.g. FSDP's params) remember the slot. Each output must own its
        whole storage (storage offset 0, ``W*shard_numel`` elements), W = ``world_size``: the arena's
        ranks by default, a multi-node group's for a node arena (:mod:`tide.transport.node_leg`). The slot is
        one of the held data region (:meth:`region`, on the current stream: leased there if none is held)."""
        slot = self._check_slot("bind_outputs", slot)
        W = world_size or self.world_size
        places = self._places(outs, W)
        if places is None:
            raise ValueError(f"tide.transport.bind_outputs: outputs must have W*c elements (W = {W})")
        if places[2] > self.slot_bytes:
            raise ValueError(f"tide.transport.bind_outputs: group needs {places[2]} slot bytes, the arena has "
                             f"{self.slot_bytes}")
        region = self.region()
        base = region.data_ptr() + self._slot_base(slot)
        # All outputs are checked before any is bound; each keeps the region alive until it is resharded.
        if not self.ext.bind_storages(outs=outs, device=self.device.index, region=region, base=base,
                                      offsets=places[0], nbytes=places[1]):
            raise ValueError("tide.transport.bind_outputs: outputs must be 1-D, on the arena's device, and start "
                             "their storage")
        self.slots.bind(slot, [o.untyped_storage() for o in outs], owners)

    def counters(self) -> dict[str, int]:
        """Cumulative counts of this arena's ops (copy-engine copies and bytes, flag copies, copy-API,
        kernel and stream-memop calls, op calls), its leases and peer segments mapped (the data region's,
        the direct lane's), and the host nanoseconds spent in the ops' C++ part (``host_ns_total``), split
        by kind of call."""
        out = dict(self.native.counters())
        out.update(sum_ctas=self.sum_ctas, symmetric_bytes=self.symmetric_bytes, data_bytes=self.data_bytes,
                   leases=self.leases.count, peer_maps=self.leases.maps_opened, direct_leases=self.direct.count,
                   direct_peer_maps=self.direct.maps_opened)
        return out
