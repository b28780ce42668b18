"""The symmetric arena of one TIDE group, and the registry the ``tide`` ops consult.

One arena per TIDE group, rendezvoused once when TIDE is enabled (never inside CUDA-graph capture),
through torch symmetric memory (CUDA backend; several processes may share one GPU with
``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1`` over a gloo group). Byte layout, identical on every
rank (peers' copies at ``buffer_ptrs[p]``)::

    [0, flags_bytes)                       int32 flag words: ag_free[K][W], ag_ready[K][W],
                                           rs_ready[R][W], rs_free[W][R], W + 1 source words
                                           (W + 4 words allotted)
    slots_off + i * slot_bytes             all-gather slot i < K (param-major, GroupLayout offsets)
    ring_off + (s * W + q) * entry_bytes   reduce-scatter staging entry of ring slot s < R, contributor q

Sizes: K = ``num_slots`` (default 2: FSDP2 holds the current and the prefetched group), ``slot_bytes``
the largest enabled group's ``GroupLayout.slot_bytes``; the staging ring is ``rs_ring_bytes`` in all
(``TIDE_RS_RING_BYTES``, default 32 MiB, independent of the model), R = ``ring_depth`` slots of W entries.
"""
from __future__ import annotations

import logging
import math
import os
from typing import Sequence

import torch
import torch.distributed as dist

from tide.meta import checks
from tide.meta.layout import GroupLayout, align_up
from tide.transport import plans

log = logging.getLogger("tide.transport")

DEFAULT_RS_RING_BYTES = 32 << 20
DEFAULT_RING_DEPTH = 2
DEFAULT_CTAS = 16
DEFAULT_GRAPH_SETS = 32
RS_MODES = ("in_place", "slot_reuse")
RS_RAN = ("in_place", "slot_reuse", "in_place_slot_too_small", "in_place_grads_in_slot")  # by the extension's code
CE_MODES = ("graph", "batch", "loop")  # TIDE_CE_MODE; the index is the extension's code
_COUNTERS = ("ce_copies", "ce_bytes", "kernels", "flags", "graph_launches", "graphs_built", "graph_node_updates",
             "graph_repoints_refused", "memop_calls", "copy_api_calls", "op_calls", "host_ns_total", "host_ns_kernel", "host_ns_memop",
             "host_ns_graph_launch", "host_ns_graph_update", "host_ns_graph_build", "host_ns_copy_api", "host_ns_event")

_ARENAS: dict[str, "Arena"] = {}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def ce_mode_from_env() -> str:
    """``TIDE_CE_MODE``: graph, batch or loop (default graph)."""
    mode = os.environ.get("TIDE_CE_MODE", "") or "graph"
    if mode not in CE_MODES:
        raise ValueError(f"tide.transport: TIDE_CE_MODE must be one of {CE_MODES}, got {mode!r}")
    return mode


class Arena:
    """Symmetric memory, flags and CUDA streams of one TIDE group.

    Arguments:
        group: the group's process group (gloo or NCCL); every rank must construct its arena together.
        slot_bytes: bytes of one all-gather slot (the largest ``GroupLayout.slot_bytes`` to serve).
        num_slots: K, the all-gather slot ring.
        rs_ring_bytes: bytes of the reduce-scatter staging ring (``TIDE_RS_RING_BYTES``).
        ring_depth: R, staging slots per destination (each holds W entries).
        ctas: CTAs of the summing kernel (``TIDE_RS_CTAS``, default 16).
        rs_mode: ``"in_place"`` or ``"slot_reuse"`` for op-level calls (``TIDE_RS_MODE``).
        ce_mode: how the copy-engine copies are issued (``TIDE_CE_MODE``): ``"graph"`` (default) replays a
            CUDA graph of memcpy nodes cached per (plan, slot) for all-gathers and per (plan, ring phase,
            gradient addresses) for reduce-scatters; ``"batch"`` issues one
            ``cudaMemcpyBatchAsync`` per run of pieces; ``"loop"`` one ``cudaMemcpyAsync`` per piece.
        max_graph_sets: graph mode, reduce-scatter push graphs kept per (plan, ring phase), one set per
            gradient address set (``TIDE_RS_GRAPH_SETS``, default 32): FSDP's blocks share a plan, and a
            block whose gradients come back at the same addresses replays its graphs unchanged; past
            this many address sets the least recently used set is re-pointed (one driver call per
            copy node).
    """

    def __init__(self, group: dist.ProcessGroup, slot_bytes: int, *, num_slots: int = 2,
                 rs_ring_bytes: int | None = None, ring_depth: int = DEFAULT_RING_DEPTH, ctas: int | None = None,
                 rs_mode: str | None = None, ce_mode: str | None = None, max_graph_sets: int | None = None) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tide.transport.Arena: cannot rendezvous during CUDA-graph capture; enable TIDE before capturing")
        from torch.distributed import _symmetric_memory as symm_mem

        from tide.transport import build

        self.ext = build.load()
        self.group = group
        self.group_name = group.group_name
        self.world_size = group.size()
        self.rank = group.rank()
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.rs_mode = rs_mode or os.environ.get("TIDE_RS_MODE", "in_place")
        if self.rs_mode not in RS_MODES:
            raise ValueError(f"tide.transport.Arena: rs_mode must be one of {RS_MODES}, got {self.rs_mode!r}")
        W = self.world_size
        self.num_slots = num_slots
        self.ring_depth = ring_depth
        self.ctas = ctas or _env_int("TIDE_RS_CTAS", DEFAULT_CTAS)
        self.max_graph_sets = max_graph_sets or _env_int("TIDE_RS_GRAPH_SETS", DEFAULT_GRAPH_SETS)
        ring = rs_ring_bytes or _env_int("TIDE_RS_RING_BYTES", DEFAULT_RS_RING_BYTES)
        self.entry_bytes = max(4096, (ring // (ring_depth * W)) // 4096 * 4096)
        self.slot_bytes = align_up(max(int(slot_bytes), 16), 4096)
        flag_words = 2 * num_slots * W + 2 * ring_depth * W + W + 4
        self.flags_bytes = align_up(4 * flag_words, 4096)
        self.slots_off = self.flags_bytes
        self.ring_off = self.slots_off + num_slots * self.slot_bytes
        self.total_bytes = self.ring_off + ring_depth * W * self.entry_bytes
        self.ce_mode = ce_mode or ce_mode_from_env()
        if self.ce_mode not in CE_MODES:
            raise ValueError(f"tide.transport.Arena: ce_mode must be one of {CE_MODES}, got {self.ce_mode!r}")

        self.buffer = symm_mem.empty(self.total_bytes, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        bases = [int(p) for p in self.handle.buffer_ptrs]
        if bases[self.rank] != self.buffer.data_ptr():
            raise RuntimeError("tide.transport.Arena: symmetric buffer does not start at its allocation base")
        self.buffer[: self.flags_bytes].zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)  # no peer writes a flag before every rank has zeroed its own
        self._c = self.ext.Arena(self.rank, W, bases, self.device.index, 0, self.slots_off, self.slot_bytes,
                                 num_slots, self.ring_off, self.entry_bytes, ring_depth, self.ctas,
                                 CE_MODES.index(self.ce_mode), self.max_graph_sets)
        assert self._c.flag_words() == flag_words
        self._logged = False
        self._bind_places: dict = {}  # (numel, dtype) of each output -> (slot offset, bytes) of each

    def __repr__(self) -> str:
        return (f"Arena(group={self.group_name!r}, W={self.world_size}, rank={self.rank}, slots={self.num_slots}x"
                f"{self.slot_bytes}, ring={self.ring_depth}x{self.world_size}x{self.entry_bytes}, ctas={self.ctas}, "
                f"ce_mode={self.ce_mode!r})")

    # ------------------------------------------------------------------------------------ ops
    # The extension checks the arguments and looks the plan up (one C++ call per op); a layout it has
    # no plan for yet is planned here once (tide/transport/plans.py) and handed over. Bad arguments come
    # back as a code, nothing issued on any rank; the error raised is tide.meta.checks', which words
    # every argument error of every backend (only this rare path pays for the Python checks).
    def _log_once(self) -> None:
        if not self._logged:
            self._logged = True
            log.info("tide.transport: %r, %d bytes of symmetric memory", self, self.total_bytes)

    def _add_ag_plan(self, shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
        out_dtypes = [o.dtype for o in outs]
        layout = plans.all_gather_layout([s.shape for s in shards], out_dtypes, self.world_size)
        info = plans.ag_plan_info(layout, out_dtypes, self.rank)
        self._c.add_ag_plan(shards, outs, self.ext.AgPlan(info.own_off, info.own_bytes, info.out_off, info.out_numel,
                                                          [plans.DTYPE_CODES[d] for d in out_dtypes], layout.slot_bytes))
        self._log_once()

    def _add_rs_plan(self, grads: Sequence[torch.Tensor]) -> None:
        dtypes = [g.dtype for g in grads]
        info = plans.rs_plan_info([g.shape for g in grads], dtypes, self.world_size, self.rank, self.entry_bytes)
        flat = [[[x for chunk in rnd for x in chunk] for rnd in per_dest] for per_dest in info.rounds]
        self._c.add_rs_plan(grads, self.ext.RsPlan(flat, [list(p) for p in info.pads],
                                                   [plans.DTYPE_CODES[d] for d in dtypes],
                                                   [p.slot_offset for p in info.layout.params], info.layout.slot_bytes))
        self._log_once()

    def all_gather_into_params(self, shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> int | None:
        """TIDE-AG of ``shards`` into ``outs`` (zero-copy when ``outs`` are bound in a slot, else gathered in
        the next slot and copied out). Returns the slot, or None when the group does not fit a slot
        (nothing was issued)."""
        slot = self._c.all_gather(shards, outs)
        if slot == self.ext.Arena.NO_PLAN:
            self._add_ag_plan(shards, outs)
            slot = self._c.all_gather(shards, outs)
        if slot == self.ext.Arena.BAD_ARGS:
            checks.check_all_gather_into_params("all_gather_into_params_", shards, outs, self.world_size)
            self._raise_device_error("all_gather_into_params_", ("shards", shards), ("outs", outs))
        return None if slot == self.ext.Arena.NO_FIT else slot

    def reduce_scatter_params(self, grads: Sequence[torch.Tensor], shard_grads: Sequence[torch.Tensor], scale: float,
                              accumulate: bool, rs_mode: str | None = None, reuse_slot: int | None = None) -> str:
        """TIDE-RS into this rank's fp32 ``shard_grads``. ``rs_mode="slot_reuse"`` pushes from slot
        ``reuse_slot`` (default: the slot the next all-gather takes, i.e. the one just vacated), each
        gradient at its param's all-gather output address there, copied in first unless it already lies
        there. Returns what ran: ``"in_place"``, ``"slot_reuse"``, ``"in_place_slot_too_small"`` (Slot-Reuse
        asked, the group does not fit a slot) or ``"in_place_grads_in_slot"`` (Slot-Reuse asked, some
        gradient already lies in that slot away from its place in this call's layout: read where it lies)."""
        mode = rs_mode or self.rs_mode
        if mode not in RS_MODES:
            raise ValueError(f"tide.transport.reduce_scatter_params: rs_mode must be one of {RS_MODES}, got {mode!r}")
        slot = -1
        if mode == "slot_reuse":
            slot = self._c.next_slot() if reuse_slot is None else self._check_slot("reduce_scatter_params", reuse_slot)
        scale, accumulate = float(scale), bool(accumulate)
        ran = self._c.reduce_scatter(grads, shard_grads, scale, accumulate, slot)
        if ran == self.ext.Arena.NO_PLAN:
            self._add_rs_plan(grads)
            ran = self._c.reduce_scatter(grads, shard_grads, scale, accumulate, slot)
        if ran == self.ext.Arena.BAD_ARGS:
            checks.check_reduce_scatter_params("reduce_scatter_params_", grads, shard_grads, self.world_size)
            self._raise_device_error("reduce_scatter_params_", ("grads", grads), ("shard_grads", shard_grads))
        if not 0 <= ran < len(RS_RAN):
            raise RuntimeError(f"tide.transport.reduce_scatter_params: unexpected extension answer {ran}")
        return RS_RAN[ran]

    def _raise_device_error(self, op: str, *named_lists) -> None:
        """The one condition the extension checks beyond tide.meta.checks: every tensor on the arena's device."""
        for name, tensors in named_lists:
            for i, t in enumerate(tensors):
                if t.device != self.device:
                    raise ValueError(f"tide.{op}: {name}[{i}] is on {t.device} but the group's arena is on {self.device}")
        raise AssertionError(f"tide.{op}: the extension refused arguments that pass every check")

    # ------------------------------------------------------------------------------------ zero-copy binding
    def next_slot(self) -> int:
        """The slot the next unbound all-gather takes."""
        return self._c.next_slot()

    def _check_slot(self, op: str, slot: int) -> int:
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"tide.transport.{op}: slot must be in [0, {self.num_slots}), got {slot}")
        return slot

    def slot_views(self, layout: GroupLayout, dtypes: Sequence[torch.dtype], slot: int) -> list[torch.Tensor]:
        """1-D views of this rank's slot ``slot`` at every param's all-gather output (param-major)."""
        slot = self._check_slot("slot_views", slot)
        if layout.slot_bytes > self.slot_bytes:
            raise ValueError(f"tide.transport: group needs {layout.slot_bytes} slot bytes, the arena has {self.slot_bytes}")
        base = self.slots_off + slot * self.slot_bytes
        views = []
        for p, dt in zip(layout.params, dtypes):
            start = base + p.slot_offset
            views.append(self.buffer[start:start + p.out_bytes].view(dt))
        return views

    def grad_views(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype], slot: int) -> list[torch.Tensor]:
        """Tensors of the given gradient shapes at their params' all-gather output addresses in slot
        ``slot`` (param-major): where Slot-Reuse reads gradients (FSDP's hooks put them there)."""
        slot = self._check_slot("grad_views", slot)
        layout = GroupLayout([tuple(s) for s in shapes], [d.itemsize for d in dtypes], self.world_size)
        if layout.slot_bytes > self.slot_bytes:
            raise ValueError(f"tide.transport.grad_views: group needs {layout.slot_bytes} slot bytes, the arena has "
                             f"{self.slot_bytes}")
        base = self.slots_off + slot * self.slot_bytes
        views = []
        for shape, dt, p in zip(shapes, dtypes, layout.params):
            start = base + p.slot_offset
            numel = math.prod(shape)
            views.append(self.buffer[start:start + numel * dt.itemsize].view(dt).view(tuple(shape)))
        return views

    def bind_outputs(self, outs: Sequence[torch.Tensor], slot: int | None = None) -> int:
        """Point the storages of the 1-D all-gather outputs ``outs`` (their views see it too) into slot
        ``slot`` (default: the next slot) at their param-major addresses; returns the slot. Each output
        must own its whole storage (storage offset 0, ``W*shard_numel`` elements)."""
        slot = self.next_slot() if slot is None else self._check_slot("bind_outputs", slot)
        W = self.world_size
        key = tuple([(o.numel(), o.dtype) for o in outs])
        places = self._bind_places.get(key)
        if places is None:
            if any(o.numel() % W for o in outs):
                raise ValueError("tide.transport.bind_outputs: outputs must have W*c elements")
            layout = plans.all_gather_layout([(o.numel() // W,) for o in outs], [o.dtype for o in outs], W)
            if layout.slot_bytes > self.slot_bytes:
                raise ValueError(f"tide.transport.bind_outputs: group needs {layout.slot_bytes} slot bytes, "
                                 f"the arena has {self.slot_bytes}")
            places = self._bind_places[key] = ([p.slot_offset for p in layout.params],
                                               [p.out_bytes for p in layout.params])
        base = self.buffer.data_ptr() + self.slots_off + slot * self.slot_bytes
        if not self.ext.bind_storages(outs, self.device.index, base, *places):  # all checked before any is bound
            raise ValueError("tide.transport.bind_outputs: outputs must be 1-D, on the arena's device, and start "
                             "their storage")
        return slot

    def counters(self) -> dict[str, int]:
        """Cumulative counts of this arena's ops: copies, bytes, kernels, flag copies, graph launches /
        builds / node updates / re-points the runtime refused (that set rebuilt), stream-memop and
        copy-API calls, op calls, and the host nanoseconds spent
        in the ops' C++ part (``host_ns_total``) split by kind of call."""
        out = dict(zip(_COUNTERS, self._c.counters()))
        out.update(ctas=self.ctas, arena_bytes=self.total_bytes, ce_mode=self.ce_mode,
                   ce_mode_now=CE_MODES[self._c.ce_mode()], graph_error=self._c.graph_error(),
                   batched_memop_writes=self._c.batched_writes())
        return out


# ---------------------------------------------------------------------------------------- registry
def enable(group: dist.ProcessGroup, *, slot_bytes: int | None = None, layouts: Sequence[GroupLayout] = (),
           **kwargs) -> Arena:
    """Create (collectively) and register the arena of ``group``; its slots fit ``slot_bytes`` or the
    largest of ``layouts``. Must be called by every rank of ``group``, outside CUDA-graph capture; a group
    that already has an arena is refused (``disable`` it first), on every rank alike."""
    need = max([slot_bytes or 0] + [l.slot_bytes for l in layouts])
    if need <= 0:
        raise ValueError("tide.transport.enable: give slot_bytes or layouts")
    if group.group_name in _ARENAS:
        raise ValueError(f"tide.transport.enable: group {group.group_name!r} already has an arena; "
                         "tide.transport.disable it first")
    arena = Arena(group, need, **kwargs)
    _ARENAS[group.group_name] = arena
    return arena


def register(group_name: str, arena: Arena) -> None:
    """Serve another process group over the same ranks (in the same order) with ``arena``: its ops then
    use the arena too. Safe when every rank issues the collectives of all those groups in one order, as
    FSDP2 does for the groups of one model."""
    ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group_name))
    if ranks != dist.get_process_group_ranks(arena.group):
        raise ValueError(f"tide.transport.register: group {group_name!r} has ranks {ranks}, the arena serves "
                         f"{dist.get_process_group_ranks(arena.group)}")
    _ARENAS[group_name] = arena


def disable(group_name: str) -> None:
    """Unregister (and drop) the arena of ``group_name`` under every group name it serves; their ops take
    the stock path afterwards."""
    arena = _ARENAS.pop(group_name, None)
    if arena is not None:
        for name in [n for n, a in _ARENAS.items() if a is arena]:
            del _ARENAS[name]
        torch.cuda.synchronize(arena.device)


def get(group_name: str) -> Arena | None:
    return _ARENAS.get(group_name)


def arenas() -> dict[str, Arena]:
    return dict(_ARENAS)
