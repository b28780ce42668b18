"""The FSDP2 seam: dispatching replacements of FSDP2's three ``foreach_*`` collectives.

``install()`` rebinds ``foreach_all_gather``, ``foreach_all_gather_copy_out`` and ``foreach_reduce`` in
``torch.distributed.fsdp._fully_shard._fsdp_param_group``'s namespace, where ``FSDPParamGroup`` looks them
up at call time (whatever was bound there before is kept and called for the stock path, so other
patchers chain). A param group is opted in by carrying TIDE's marker comm objects; every call decides
on its own: the TIDE path when the group is opted in and the case is supported, else the original
function, counted in :func:`stats` under ``"stock:<reason>"`` and logged once per reason.

Everything else FSDP2 owns (streams, events, prefetch, reshard, keep-alives, state) stays stock.

Three functions here are the transport's hooks (module globals looked up at call time, so a transport
may rebind them): :func:`bind_all_gather_outputs` (where each param's all-gather output lives),
:func:`all_gather_into_outputs` and :func:`reduce_scatter_into_shards` (the collective calls; the
latter gets the group's ``rs_mode``).

On CUDA (``enable(..., transport="auto")``) the seam wires in the CUDA transport (section "CUDA transport
wiring" below): it creates the symmetric arena of each set of ranks at their first TIDE
collective, binds the all-gather outputs of groups that reshard after forward into the arena's slots
(zero-copy), and runs the reduce through ``Arena.reduce_scatter_params`` with the group's ``rs_mode``.
"""
from __future__ import annotations

import logging
import os
import socket
import weakref
from collections import Counter
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult
from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from tide import transport
from tide.fsdp import compat
from tide.meta.checks import FLOAT_DTYPES
from tide.ops import reference
from tide.transport import plans, records
from tide.transport.arena import RS_MODES  # noqa: F401  (one definition of the modes)

log = logging.getLogger("tide.fsdp")

TIDE = "tide"

# Every reason a call takes the stock path; docs/fsdp.md has the table.
REASONS = (
    "not_enabled", "unknown_args", "cuda_graph_capture", "compiling", "functorch", "async_op",
    "world_size_1", "compute_capability", "nvlink_domain", "post_forward_mesh", "shard_dim", "cpu_offload", "all_gather_extension",
    "dtensor_param", "mixed_param_dtypes", "mixed_grad_dtypes", "unsupported_dtype", "reduce_dtype",
    "hsdp", "all_reduce_hook", "noncontiguous_grad", "arena_busy",
)
TRANSPORTS = ("auto", "reference")
TRANSPORT_ENV = "TIDE_FSDP_TRANSPORT"


# ---------------------------------------------------------------------------------------------- markers
class TideAllGather(AllGather):
    """Opt-in marker for a param group's all-gather; the stock path still uses ``fallback``."""

    def __init__(self, fallback: AllGather, param_group=None, transport: str = "auto", leaf: bool = False) -> None:
        self.fallback = fallback
        # The FSDPParamGroup, whether its FSDP module has no FSDP module below it (both decide slot
        # binding), and the transport choice: "auto" uses the CUDA transport's arena on CUDA, "reference"
        # never creates one.
        self.param_group = param_group
        self.leaf = leaf
        self.transport = transport
        # (the group's fsdp_params list, its static fallback reason): FSDP passes the same list object on
        # every unshard, and the checked properties are fixed once FSDP's lazy init has set the dtypes.
        self.static_reason: tuple[list, str | None] | None = None
        # (the fsdp_params list, whether the group fits an arena slot), once per list like static_reason.
        self.slot_fit: tuple[list, bool] | None = None

    def allocate(self, size, *, dtype, device):
        return self.fallback.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.fallback(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)


class TideReduceScatter(ReduceScatter):
    """Opt-in marker for a param group's reduce-scatter; carries the group's ``rs_mode``."""

    def __init__(self, fallback: ReduceScatter, rs_mode: str, transport: str = "auto") -> None:
        self.fallback = fallback
        self.rs_mode = rs_mode
        self.transport = transport
        # id(FSDPParam) -> handle of its Slot-Reuse post-accumulate-grad hook (install_slot_reuse_hooks).
        self.grad_hooks: dict = {}
        # FSDPParams whose fixed properties (placement, offload, DTensor) passed: each reduce passes a
        # fresh list (the params that have grads), so the check is remembered per param.
        self.checked_params: set[int] = set()

    def allocate(self, size, *, dtype, device):
        return self.fallback.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.fallback(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                             async_op=async_op)


class TideAllGatherResult(AllGatherResult):
    """An all-gather whose data TIDE already placed in the params: copy-out only waits its event."""

    __slots__ = ()


# ---------------------------------------------------------------------------------------------- stats
_counts: dict[str, Counter] = {"all_gather": Counter(), "reduce_scatter": Counter()}
_logged: set[tuple[str, str]] = set()


def _count(kind: str, reason: str | None) -> None:
    path = TIDE if reason is None else f"stock:{reason}"
    _counts[kind][path] += 1
    if reason is None or (kind, reason) in _logged:
        return
    _logged.add((kind, reason))
    # A group that never opted in is not a fallback worth a warning.
    level = logging.DEBUG if reason == "not_enabled" else logging.WARNING
    log.log(level, "tide.fsdp: %s takes the stock FSDP2 path (reason: %s); logged once", kind, reason)


def stats() -> dict[str, dict[str, int]]:
    """Calls per path since the last :func:`reset_stats`: ``{"all_gather": {...}, "reduce_scatter": {...}}``
    mapping ``"tide"`` or ``"stock:<reason>"`` to a count."""
    return {kind: dict(c) for kind, c in _counts.items()}


def reset_stats() -> None:
    for c in _counts.values():
        c.clear()
    _arena_counts.clear()


_arena_counts: Counter = Counter()


def arena_stats() -> dict[str, int]:
    """What the CUDA-transport wiring did since the last :func:`reset_stats`: ``ag:bound`` (outputs bound in
    a slot, zero-copy TIDE-AG), ``ag:direct`` (a group not bound in slots: the root, blocks that keep
    their params after forward, groups larger than a slot; its outputs are allocated as stock does and
    gathered in place by the op's reference backend), ``rs:<mode>`` for every reduce-scatter (what
    ``Arena.reduce_scatter_params`` ran, or ``in_place_unbound_group``: Slot-Reuse asked by a group never
    bound in a slot), ``rs:grad_into_slot`` (gradients the Slot-Reuse hooks moved into their slot
    region), ``arena:created``. Empty without a CUDA arena."""
    return dict(_arena_counts)


# ---------------------------------------------------------------------------------------------- predicates
def _common_reason(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "cuda_graph_capture"
    if compat.is_tracing():
        return "compiling"
    if compat.functorch_active():
        return "functorch"
    return None


# The CUDA contract: Hopper (compute capability 9.0) or newer, and one NVLink domain: at most 8 GPUs,
# all on one host.
MIN_COMPUTE_CAPABILITY = 9
MAX_NVLINK_DOMAIN = 8
_CUDA_REASONS: dict[str, str | None] = {}  # group name -> reason, decided once per group


def nvlink_domain_reason(hosts: Sequence[str]) -> str | None:
    """``"nvlink_domain"`` when the ranks (their host names, in rank order) leave one NVLink domain."""
    if len(hosts) > MAX_NVLINK_DOMAIN or len(set(hosts)) > 1:
        return "nvlink_domain"
    return None


def _device_reason(device: torch.device, group) -> str | None:
    if device.type != "cuda":
        return None
    name = group.group_name
    if name not in _CUDA_REASONS:
        index = device.index if device.index is not None else torch.cuda.current_device()
        major = torch.cuda.get_device_capability(index)[0]
        _CUDA_REASONS[name] = ("compute_capability" if major < MIN_COMPUTE_CAPABILITY
                               else nvlink_domain_reason(group_hosts(group)))
    return _CUDA_REASONS[name]


def group_hosts(group) -> list[str]:
    """Host names of ``group``'s ranks, in group-rank order, exchanged once through the default store
    (no device collective: a CUDA collective on ranks that share a GPU may not be possible). Every rank
    asks at its group's first TIDE collective, the same point of FSDP's schedule on all of them."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"tide/hosts/{group.group_name}/"
    store.set(prefix + str(dist.get_rank()), socket.gethostname())
    return [store.get(prefix + str(r)).decode() for r in dist.get_process_group_ranks(group)]


def _param_reason(p) -> str | None:
    if p.fsdp_placement.dim != 0:
        return "shard_dim"
    if p.offload_to_cpu:
        return "cpu_offload"
    if p.is_dtensor:
        return "dtensor_param"
    return None


def all_gather_fallback_reason(fsdp_params, group, async_op, device, comm, extra: bool) -> str | None:
    """Why this ``foreach_all_gather`` call must take the stock path, or None for TIDE."""
    if extra:
        return "unknown_args"
    if not isinstance(comm, TideAllGather):
        return "not_enabled"
    if (reason := _common_reason(device)) is not None:
        return reason
    if async_op:
        return "async_op"
    if group.size() == 1:
        return "world_size_1"
    if (reason := _device_reason(device, group)) is not None:
        return reason
    for p in fsdp_params:
        if p.sharded_state != ShardedState.SHARDED:
            return "post_forward_mesh"
    if comm.static_reason is None or comm.static_reason[0] is not fsdp_params:
        comm.static_reason = (fsdp_params, _static_all_gather_reason(fsdp_params))
    return comm.static_reason[1]


def _static_all_gather_reason(fsdp_params) -> str | None:
    dtype = None
    for p in fsdp_params:
        if (reason := _param_reason(p)) is not None:
            return reason
        if hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "all_gather_extension"
        d = _group_dtype(p)
        if dtype is not None and d != dtype:
            return "mixed_param_dtypes"
        if d not in FLOAT_DTYPES:
            return "unsupported_dtype"
        dtype = d
    return None


def reduce_fallback_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device, all_reduce_group,
                           all_reduce_hook, extra: bool) -> str | None:
    """Why this ``foreach_reduce`` call must take the stock path, or None for TIDE."""
    if extra:
        return "unknown_args"
    if not isinstance(comm, TideReduceScatter):
        return "not_enabled"
    if (reason := _common_reason(device)) is not None:
        return reason
    if rs_group is None or rs_group.size() == 1:
        return "world_size_1"
    if (reason := _device_reason(device, rs_group)) is not None:
        return reason
    if all_reduce_group is not None:
        return "hsdp"
    if all_reduce_hook is not None:
        return "all_reduce_hook"
    grad_dtype = grads[0].dtype
    for g in grads:
        if g.dtype != grad_dtype:
            return "mixed_grad_dtypes"  # stock raises its own uniform-dtype error
        if not g.is_contiguous():
            return "noncontiguous_grad"
    if grad_dtype not in FLOAT_DTYPES:
        return "unsupported_dtype"
    # TIDE sums in fp32 into fp32 shards; a bf16/fp16 reduce (and fp16's pre/post-divide) stays stock.
    if (reduce_dtype or grad_dtype) != torch.float32:
        return "reduce_dtype"
    checked = comm.checked_params
    for p in fsdp_params:
        if id(p) not in checked:
            if (reason := _param_reason(p)) is not None:
                return reason
            checked.add(id(p))
    return None


# ---------------------------------------------------------------------------------------------- CUDA transport wiring
# Per set of ranks: the FSDP param groups enabled on it, and the one transport arena they share. Keyed by
# ranks, not by process-group name: FSDP2 may give every fully_shard call its own process group over the
# same ranks (torch 2.11 does when the default group is gloo on a CUDA machine), and FSDP issues all their
# collectives in one program order on every rank, so one arena serves them all (registered under each
# group's name for the ops). The arena leases its slots (tide.transport.slots): every choice depends only
# on host-side FSDP state that evolves identically on every rank, so all ranks pick the same slot.
_GROUPS: dict[tuple, list] = {}
_ARENAS: dict[tuple, tuple] = {}  # ranks -> (arena, whether the seam created it)


def group_key(group: dist.ProcessGroup) -> tuple:
    """The global ranks of ``group``, in group-rank order: the key of its arena."""
    return tuple(dist.get_process_group_ranks(group))


def default_transport() -> str:
    value = os.environ.get(TRANSPORT_ENV, "auto") or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"tide.fsdp: {TRANSPORT_ENV} must be one of {TRANSPORTS}, got {value!r}")
    return value


def register_group(param_group) -> None:
    """Remember (weakly) that ``param_group`` is enabled on its shard process group (arena sizing)."""
    groups = _GROUPS.setdefault(group_key(param_group._all_gather_process_group), [])
    if not any(r() is param_group for r in groups):
        groups.append(weakref.ref(param_group))


def enabled_groups(key: tuple) -> list:
    refs = _GROUPS.get(key, [])
    refs[:] = [r for r in refs if r() is not None]
    return [r() for r in refs]


def unregister_group(param_group) -> tuple | None:
    """Forget ``param_group``; returns its ranks' key when no enabled group is left on them."""
    key = group_key(param_group._all_gather_process_group)
    refs = _GROUPS.get(key, [])
    refs[:] = [r for r in refs if r() is not None and r() is not param_group]
    if refs:
        return None
    _GROUPS.pop(key, None)
    return key


def _group_dtype(p) -> torch.dtype:
    return p.param_dtype or p.orig_dtype


def _slot_layout(fsdp_params, world_size: int):
    """The group's all-gather layout as the transport binds it (1-D padded shards, param-major)."""
    return plans.all_gather_layout([(p._sharded_param_data.numel(),) for p in fsdp_params],
                                   [_group_dtype(p) for p in fsdp_params], world_size)


def bindable(param_group) -> bool:
    """Groups whose unsharded params live only while their own module runs: FSDP modules with no FSDP
    module below them (blocks) that reshard after forward (``reshard_after_forward=True``/int). A parent
    (the root: embedding, final norm, head) holds its params across all its children's forward and
    backward, and a ``reshard_after_forward=False`` group from forward to the end of backward: those keep
    their outputs the way stock does (allocator memory, gathered in place), so slots are sized for the
    blocks alone and stay free for the current and the prefetched block."""
    comm = getattr(param_group, "_all_gather_comm", None)
    return (isinstance(comm, TideAllGather) and comm.leaf
            and param_group.post_forward_mesh_info is not None)


def _create_arena(group: dist.ProcessGroup):
    """Rendezvous the arena of ``group`` (collective: every rank reaches its group's first TIDE collective
    at the same point of the step; never under graph capture: that call took the stock path before).
    Slots fit the largest :func:`bindable` group enabled on ``group``; with none, the arena has no slots
    (reduce-scatters only)."""
    arena = transport.get(group.group_name)
    if arena is not None:  # created by someone else (e.g. an op-level user): use it as it is
        return arena, False
    W = group.size()
    layouts = [_slot_layout(g.fsdp_params, W) for g in enabled_groups(group_key(group))
               if g.fsdp_params and bindable(g) and _static_all_gather_reason(g.fsdp_params) is None]
    arena = transport.enable(group, layouts=layouts)
    _arena_counts["arena:created"] += 1
    log.info("tide.fsdp: created %r for %d enabled param groups", arena, len(enabled_groups(group_key(group))))
    return arena, True


def arena_for(group: dist.ProcessGroup, device: torch.device, comm_transport: str):
    """The arena of ``group``'s ranks (created on first use), or None: not CUDA, or the reference transport."""
    if device.type != "cuda" or comm_transport != "auto":
        return None
    key = group_key(group)
    entry = _ARENAS.get(key)
    if entry is not None:
        arena = entry[0]
        if transport.get(arena.group_name) is arena:
            if transport.get(group.group_name) is not arena:
                transport.register(group.group_name, arena)  # another group over the same ranks
            return arena
        _ARENAS.pop(key)  # dropped behind our back (tide.transport.disable): start over
    entry = _ARENAS[key] = _create_arena(group)
    return entry[0]


def check_arenas_idle(param_groups) -> None:
    """Raise (changing nothing) if an arena serving ``param_groups`` still holds unsharded params."""
    for key in {group_key(g._all_gather_process_group) for g in param_groups}:
        entry = _ARENAS.get(key)
        if entry is not None and entry[0].slots.held():
            raise RuntimeError("tide.fsdp.disable: unsharded parameters still live in the transport arena of "
                               f"ranks {list(key)}; call disable between steps (after backward / reshard)")


def drop_arena(key: tuple) -> None:
    """Forget the arena of the ranks ``key`` and release it if the seam created it (after
    :func:`check_arenas_idle`)."""
    entry = _ARENAS.pop(key, None)
    if entry is not None and entry[1] and transport.get(entry[0].group_name) is entry[0]:
        transport.disable(entry[0].group_name)


def _plan_all_gather(arena, comm, fsdp_params, world_size: int) -> tuple[str, int | None]:
    """(how this all-gather uses the arena, its slot): ``bound`` (slot; outputs bound there, zero-copy),
    ``direct`` (outputs allocated as stock does, gathered in place by the op's reference backend: groups
    that are not :func:`bindable` or larger than a slot), ``busy`` (outputs hold every slot: stock),
    ``none`` (no arena)."""
    if arena is None:
        return "none", None
    if comm.slot_fit is None or comm.slot_fit[0] is not fsdp_params:  # FSDP passes the same list every time
        comm.slot_fit = (fsdp_params, _slot_layout(fsdp_params, world_size).slot_bytes <= arena.slot_bytes)
    if not bindable(comm.param_group) or not comm.slot_fit[1]:
        return "direct", None
    slot = arena.slots.acquire()
    return ("busy", None) if slot is None else ("bound", slot)


def _bind_into_slot(arena, fsdp_params, world_size: int, device: torch.device, slot: int) -> list:
    """FSDP's all-gather output tensors, their storages pointed into ``slot`` at param-major addresses.

    ``init_all_gather_outputs`` creates the tensors once (the first call allocates them, and binding frees
    that memory); later unshards find them resharded (storage ``resize_(0)``: the slot pointer is dropped,
    nothing freed) and re-bind them instead of ``alloc_all_gather_outputs`` (which would allocate)."""
    outs = []
    for p in fsdp_params:
        p.init_all_gather_outputs([p._sharded_param_data.numel()], [_group_dtype(p)], world_size, device)
        outs.append(p.all_gather_outputs[0])
    arena.bind_outputs(outs, slot, owners=fsdp_params)
    return outs

# ---------------------------------------------------------------------------------------------- transport hooks
def bind_all_gather_outputs(fsdp_params, world_size: int, device: torch.device,
                            compute_stream: torch.Stream, slot: int | None = None, arena=None) -> list[torch.Tensor]:
    """Each param's 1-D all-gather output (called on the all-gather copy-in stream).

    With an arena slot: FSDP's own output tensors, their storages pointed into the slot at their
    param-major addresses (:func:`_bind_into_slot`; the caller has made the copy-in stream wait for the
    slot's previous users). Otherwise allocated exactly as FSDP's copy-out would (its own
    ``init_all_gather_outputs`` / ``alloc_all_gather_outputs``).

    Stream ownership of allocated outputs: stock allocates these on the compute stream after the
    all-gather; TIDE writes them from the all-gather stream first, so on CUDA each is ``record_stream``-ed
    on the compute stream: its block is not reused before the compute stream's work on it (after reshard)
    has finished.
    """
    if arena is not None and slot is not None:
        return _bind_into_slot(arena, fsdp_params, world_size, device, slot)
    outs = []
    for p in fsdp_params:
        p.init_all_gather_outputs([p._sharded_param_data.numel()], [_group_dtype(p)], world_size,
                                  device)
        p.alloc_all_gather_outputs()
        out = p.all_gather_outputs[0]
        if device.type == "cuda":
            out.record_stream(compute_stream)
        outs.append(out)
    return outs


def all_gather_into_outputs(shards, outs, world_size: int, group: dist.ProcessGroup, via_arena: bool = True) -> None:
    """Gather every rank's padded shard into each param's output (called on the all-gather stream).
    ``via_arena=False`` on CUDA (the reference transport) runs the reference backend directly: the op's
    CUDA kernel would take any arena registered for the group."""
    if not via_arena and outs and outs[0].is_cuda:
        reference.all_gather_into_params_(shards, outs, world_size, group.group_name)
        return
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group.group_name)


def reduce_scatter_into_shards(grads, shard_grads, scale: float, accumulate: bool, world_size: int,
                               group: dist.ProcessGroup, rs_mode: str, fsdp_params=None, arena=None) -> None:
    """Reduce the unsharded ``grads`` into this rank's padded fp32 ``shard_grads`` (on the reduce-scatter
    stream, which has waited for the compute stream).

    ``rs_mode`` is the group's ``tide.fsdp.enable(rs_mode=...)``. Without an arena (CPU, the reference
    transport) the ``tide`` op runs (its reference backend treats both modes alike). With one,
    ``Arena.reduce_scatter_params`` runs with that mode. Slot-Reuse pushes from the slot this group was
    bound in (FSDP reshards before it reduces, and the prefetched group sits in the other slot), where
    :func:`_grad_into_slot` has already put the gradients (any gradient it did not move is copied in
    first), else from any free slot; none free means In-Place for this call (counted in
    :func:`arena_stats`). The next all-gather into that slot waits for this reduce.
    """
    if arena is None:
        # On CUDA this is the reference transport: never the group's arena (see all_gather_into_outputs).
        run = reference.reduce_scatter_params_ if grads and grads[0].is_cuda else torch.ops.tide.reduce_scatter_params_
        run(grads, shard_grads, scale, accumulate, world_size, group.group_name)
        return
    mode, slot = rs_mode, None
    own = arena.slots.last_slot(fsdp_params[0]) if fsdp_params else None
    stream = _get_device_handle(grads[0].device.type).current_stream()
    if rs_mode == "slot_reuse":
        # A group never bound in a slot has no vacated slot to reuse: its gradients live in autograd's
        # memory either way, so copying them into a slot would only add traffic.
        if own is None:
            mode = "in_place"
        else:
            slot = arena.slots.acquire(prefer=own)
            if slot is not None:
                arena.slots.wait(slot, stream)
                if own != slot:
                    arena.slots.wait(own, stream)
    ran = arena.reduce_scatter_params(grads, shard_grads, scale, accumulate, rs_mode=mode, reuse_slot=slot)
    if rs_mode == "slot_reuse" and own is None:
        ran = "in_place_unbound_group"
    records.record("reduce_scatter_params_", "tide", ran)
    _arena_counts[f"rs:{ran}"] += 1
    if own is not None and rs_mode == "slot_reuse":
        # The slot the Slot-Reuse hooks placed gradients in: the next all-gather into it waits for this reduce.
        arena.slots.used(own, stream.record_event())


# ---------------------------------------------------------------------------------------------- Slot-Reuse hooks
def install_slot_reuse_hooks(param_group) -> None:
    """Give each unsharded param of a bound Slot-Reuse group a post-accumulate-grad hook
    (:func:`_grad_into_slot`), once; the hooks stay until :func:`remove_slot_reuse_hooks` and do
    nothing while the group is in another mode."""
    comm = param_group._reduce_scatter_comm
    for p in param_group.fsdp_params:
        if id(p) in comm.grad_hooks or not hasattr(p, "_unsharded_param") or not p._unsharded_param.requires_grad:
            continue
        key = group_key(param_group._all_gather_process_group)
        comm.grad_hooks[id(p)] = p._unsharded_param.register_post_accumulate_grad_hook(
            lambda param, g=param_group, fp=p, k=key: _grad_into_slot(g, fp, k, param))


def remove_slot_reuse_hooks(param_group) -> None:
    comm = param_group._reduce_scatter_comm
    for handle in getattr(comm, "grad_hooks", {}).values():
        handle.remove()
    if isinstance(comm, TideReduceScatter):
        comm.grad_hooks.clear()


def _grad_into_slot(param_group, fsdp_param, key: tuple, param) -> None:
    """Slot-Reuse: move ``param``'s finished gradient into the slot region its own values occupy, and
    let autograd's gradient storage go (the peak then holds at most one parameter's gradient outside
    the arena).

    A post-accumulate-grad hook: autograd has summed every contribution to this gradient, so the
    backward no longer needs the parameter's values (their last readers produced this gradient). The
    copy goes through ``param`` itself, which bumps its version counter: a backward node that still
    held the values (say a second backward with ``retain_graph=True``) fails autograd's in-place check
    instead of reading gradients. ``param.grad`` becomes a view of the arena (not of the all-gather
    output, whose storage FSDP's reshard empties before the reduce reads the gradients).
    Only when this backward reduces and reshards the group (``reduce_grads``, ``reshard_after_backward``;
    no gradient accumulated from an earlier no-sync backward), the reduce is fp32 (TIDE's), and the
    params are bound in a slot. Reentrant activation checkpointing (``use_reentrant=True``) accumulates a
    parameter once per checkpointed region: a parameter used in two regions of one FSDP module would be
    overwritten before the second region recomputes, so use non-reentrant checkpointing (torch's
    default) or In-Place with it.
    """
    grad = param.grad
    comm = param_group._reduce_scatter_comm
    reduce_dtype = getattr(getattr(param_group, "mp_policy", None), "reduce_dtype", None)
    if (grad is None or not isinstance(comm, TideReduceScatter) or comm.rs_mode != "slot_reuse"
            or (reduce_dtype or grad.dtype) != torch.float32  # TIDE reduces into fp32 only; others stay stock
            or not param_group.reduce_grads or not param_group.reshard_after_backward
            or fsdp_param.unsharded_accumulated_grad is not None or grad.dtype != param.dtype
            or grad.shape != param.shape or not grad.is_contiguous() or torch.cuda.is_current_stream_capturing()):
        return
    entry = _ARENAS.get(key)
    out = fsdp_param.all_gather_outputs[0] if fsdp_param.all_gather_outputs else None
    if entry is None or out is None or out.untyped_storage().nbytes() == 0 or grad.data_ptr() == out.data_ptr():
        return
    place = entry[0].view_at(out, param.shape, param.dtype)
    if place is None:  # not bound in a slot
        return
    with torch.no_grad():
        param.detach().copy_(grad)
    param.grad = place
    _arena_counts["rs:grad_into_slot"] += 1


# ---------------------------------------------------------------------------------------------- TIDE paths
def _tide_all_gather(fsdp_params, group, copy_in_stream, all_gather_stream, device, arena=None,
                     plan=("none", None)) -> TideAllGatherResult:
    handle = _get_device_handle(device.type)
    world_size = group.size()
    compute_stream = handle.current_stream()
    mode, slot = plan
    with handle.stream(copy_in_stream):
        if mode == "bound":
            # The slot's previous occupant was read on the compute stream (FSDP has resharded it on the
            # host, its kernels may still run), and its last all-gather or Slot-Reuse reduce elsewhere.
            copy_in_stream.wait_stream(compute_stream)
            arena.slots.wait(slot, copy_in_stream)
            outs = bind_all_gather_outputs(fsdp_params, world_size, device, compute_stream, slot, arena)
        else:
            outs = bind_all_gather_outputs(fsdp_params, world_size, device, compute_stream)
    all_gather_stream.wait_stream(copy_in_stream)
    shards = [p._sharded_param_data for p in fsdp_params]
    # The unsharded params alias these outputs and autograd may have saved them (re-gather in
    # backward): keep their version counters as stock copy-out does. Inference tensors have none.
    preserved = tuple(o for o in outs if not o.is_inference())
    with handle.stream(all_gather_stream):
        if preserved:
            with torch.autograd._unsafe_preserve_version_counter(preserved):
                all_gather_into_outputs(shards, outs, world_size, group, arena is not None)
        else:
            all_gather_into_outputs(shards, outs, world_size, group, arena is not None)
        event = all_gather_stream.record_event()
    if mode == "bound":
        arena.slots.used(slot, event)
    if mode != "none":
        _arena_counts[f"ag:{mode}"] += 1
    return TideAllGatherResult(outs[0].new_empty(0), event, None, [], [], [])


def _accumulates_in_place(fsdp_params, grads, orig_dtype, world_size: int) -> list[torch.Tensor] | None:
    """The existing sharded grads' local tensors when the op can add straight into them, else None.

    Decided identically on every rank (all ranks must issue the same collectives): every param already
    has an fp32 DTensor grad and shards evenly, so no rank's local grad is shorter than its padded shard.
    """
    if orig_dtype not in (None, torch.float32):
        return None
    locals_ = []
    for p, g in zip(fsdp_params, grads):
        existing = p.sharded_param.grad
        if existing is None or g.dim() == 0 or g.shape[0] % world_size:
            return None
        local = existing._local_tensor
        if local.dtype != torch.float32 or not local.is_contiguous():
            return None
        locals_.append(local)
    return locals_


def _tide_reduce(fsdp_params, unsharded_grads, rs_group, rs_stream, comm, orig_dtype, device, divide_factor,
                 arena=None):
    handle = _get_device_handle(device.type)
    world_size = rs_group.size()
    # With an fp32 reduce and no all-reduce group, every branch of FSDP's _get_gradient_divide_factors
    # (AVG, PREMUL_SUM(1/f), force-sum with post-divide by f) amounts to sum / f with f defaulting to
    # the world size; TIDE applies it as one fp32 scale inside the reduction.
    scale = 1.0 / (divide_factor if divide_factor is not None else world_size)
    # The grads are the reduce input and the keep-alive FSDP holds until the compute stream has waited
    # the reduce-scatter event (as stock does with its packed buffer).
    grads = list(unsharded_grads)
    unsharded_grads.clear()
    rs_stream.wait_stream(handle.current_stream())
    with handle.stream(rs_stream):
        in_place = _accumulates_in_place(fsdp_params, grads, orig_dtype, world_size)
        if in_place is not None:
            reduce_scatter_into_shards(grads, in_place, scale, True, world_size, rs_group, comm.rs_mode,
                                       fsdp_params, arena)
            rs_event = rs_stream.record_event()
        else:
            # Stock's reduce-output layout: padded shards back to back, each (c, *rest) (dim-0 sharding,
            # so the contiguous strides of the unpadded shard are those of the padded one too).
            offsets, total = [], 0
            for p in fsdp_params:
                offsets.append(total)
                total += p.padded_sharded_param_size.numel()
            flat = torch.empty(total, dtype=torch.float32, device=device)
            as_strided = flat.as_strided
            shards = [as_strided(p.padded_sharded_param_size, p.contiguous_sharded_stride, o)
                      for p, o in zip(fsdp_params, offsets)]
            reduce_scatter_into_shards(grads, shards, scale, False, world_size, rs_group, comm.rs_mode,
                                       fsdp_params, arena)
            rs_event = rs_stream.record_event()
            # Stock epilogue: cast to the orig dtype, view each unpadded shard, accumulate or assign.
            output = _to_dtype_if_needed(flat, orig_dtype)
            for p, shard, o in zip(fsdp_params, shards, offsets):
                if output is flat and p.sharded_size == p.padded_sharded_param_size:
                    new_grad = shard  # already the unpadded shard's view: saves a view op per param
                else:
                    new_grad = torch.as_strided(output, size=p.sharded_size, stride=p.contiguous_sharded_stride,
                                                storage_offset=o)
                if p.sharded_param.grad is not None:
                    p.sharded_param.grad._local_tensor += new_grad
                else:
                    p.sharded_param.grad = p.to_sharded_dtensor(new_grad)
        for p in fsdp_params:
            for hook in (getattr(p.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                hook(p.sharded_param)
        post_event = rs_stream.record_event()
    return compat.reduce_result(grads, rs_event, rs_stream, post_event)


# ---------------------------------------------------------------------------------------------- wrappers
_ORIG: dict[str, object] = {}


@torch.no_grad()
def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
                       all_gather_comm, *args, **kwargs):
    reason = all_gather_fallback_reason(fsdp_params, group, async_op, device, all_gather_comm,
                                        bool(args or kwargs))
    arena, plan = None, ("none", None)
    if reason is None:
        arena = arena_for(group, device, all_gather_comm.transport)
        plan = _plan_all_gather(arena, all_gather_comm, fsdp_params, group.size())
        if plan[0] == "busy":
            reason = "arena_busy"
    _count("all_gather", reason)
    if reason is not None:
        return _ORIG["foreach_all_gather"](fsdp_params, group, async_op, all_gather_copy_in_stream,
                                           all_gather_stream, device, all_gather_comm, *args, **kwargs)
    result = _tide_all_gather(fsdp_params, group, all_gather_copy_in_stream, all_gather_stream, device, arena, plan)
    param_group = all_gather_comm.param_group
    if plan[0] == "bound" and getattr(param_group._reduce_scatter_comm, "rs_mode", None) == "slot_reuse":
        install_slot_reuse_hooks(param_group)
    return result


@torch.no_grad()
def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *args, **kwargs):
    # Dispatch on the result type, so a stock all-gather always meets the stock copy-out.
    if isinstance(all_gather_result, TideAllGatherResult) and not args and not kwargs:
        device = all_gather_result.all_gather_output.device
        _get_device_handle(device.type).current_stream().wait_event(all_gather_result.all_gather_event)
        return None
    return _ORIG["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group, *args, **kwargs)


@torch.no_grad()
def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
                   all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output, all_reduce_hook,
                   force_sum_reduction_for_comms=False, *args, **kwargs):
    reason = reduce_fallback_reason(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_comm,
                                    reduce_dtype, device, all_reduce_group, all_reduce_hook, bool(args or kwargs))
    _count("reduce_scatter", reason)
    if reason is not None:
        out = _ORIG["foreach_reduce"](
            fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream, reduce_scatter_comm,
            orig_dtype, reduce_dtype, device, gradient_divide_factor, all_reduce_group, all_reduce_stream,
            all_reduce_grads, partial_reduce_output, all_reduce_hook, force_sum_reduction_for_comms, *args, **kwargs)
        _order_slot_after_stock_reduce(fsdp_params, reduce_scatter_comm, reduce_scatter_group, reduce_scatter_stream)
        return out
    arena = arena_for(reduce_scatter_group, device, getattr(reduce_scatter_comm, "transport", "auto"))
    return _tide_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                        reduce_scatter_comm, orig_dtype, device, gradient_divide_factor, arena)


def _order_slot_after_stock_reduce(fsdp_params, comm, group, stream) -> None:
    """A stock reduce may read gradients that the Slot-Reuse hooks put in the group's slot: the next
    all-gather into that slot waits for what stock issued on the reduce-scatter stream (it reads the
    gradients there, within the call)."""
    if not (isinstance(comm, TideReduceScatter) and comm.grad_hooks and fsdp_params and group is not None):
        return
    entry = _ARENAS.get(group_key(group))
    own = entry[0].slots.last_slot(fsdp_params[0]) if entry is not None else None
    if own is not None:
        entry[0].slots.used(own, stream.record_event())


_WRAPPERS = {
    "foreach_all_gather": foreach_all_gather,
    "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
    "foreach_reduce": foreach_reduce,
}


def install() -> None:
    """Rebind the three functions in ``_fsdp_param_group`` once, keeping whatever was bound before as the
    stock path. Later calls change nothing: a patcher installed after TIDE chains to TIDE's wrapper, and
    re-capturing it as "stock" would make the two call each other forever."""
    if _ORIG:
        return
    for name, wrapper in _WRAPPERS.items():
        _ORIG[name] = getattr(_pg, name)
        setattr(_pg, name, wrapper)
