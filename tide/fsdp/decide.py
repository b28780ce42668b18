"""Which FSDP2 param groups are TIDE's, their per-group state, and everything the seam decides about one
FSDP2 collective before it issues anything, in one place.

``tide.fsdp.enable`` gives each param group a :class:`TideAllGather` and a :class:`TideReduceScatter`
(:func:`attach`). They are not FSDP2 comms: the group's own ``_all_gather_comm`` / ``_reduce_scatter_comm``
stay FSDP2's, so every FSDP2 API that sets or checks them (``set_custom_all_gather``,
``set_allocate_memory_from_process_group_for_comm``, ``set_symm_mem_for_comm``, ...) behaves as on stock, in
either order with ``enable``, and the stock path calls whichever comm FSDP2 holds. A call finds its group's
state from the ``fsdp_params`` FSDP2 hands it (:func:`of_params`).

:func:`all_gather` and :func:`reduce` answer a call: its stock reason (``tide.fsdp.fallbacks``; counted in
``tide.stats()["fsdp"]``, a user's own comm warned once per group), or the TIDE call, which carries all
that ``tide.fsdp.seam`` needs to issue it: the arena serving the group (its route, ``tide.routes``; the arena
made at the group's first TIDE collective, ``tide.fsdp.wiring``), the tensor extensions' all-gather inputs,
the all-gather's slot and output specs, where a reduce reads its gradients, and (on CPU) the call's
identity (``tide.meta.call_site``).

A group's collective is decided once: its first TIDE call asks every reason and keeps the verdict, with
the route, the arena and the slot mode, in a :class:`GroupAllGather` or :class:`GroupReduce` on the group's
TIDE state. Each later call whose settings are the same (:meth:`GroupAllGather.holds`: the params list, the
process group, the device, FSDP2's comm, the output function, the reshard-after-forward choice, the
arenas) asks only what can change between calls (``fallbacks.all_gather_call_reason`` /
``reduce_call_reason``: tracing, capture, the params' state, the gradients), takes its slot, counts, and
issues. A group with tensor extensions runs their pre-all-gather per call, so its all-gathers are decided
per call.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
import weakref

import torch
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from tide import counters, registry, routes
from tide.fsdp import comm_debug, extensions, fallbacks, shard_dims, wiring
from tide.meta.call_site import call_identity
from tide.transport.watchdog import WATCHDOG


@dataclasses.dataclass
class AllGatherFacts:
    """What a group's all-gathers rest on that cannot change between its calls, decided once per
    ``fsdp_params`` list (FSDP passes the same list on every unshard, and the properties read are fixed once
    its lazy init has set the dtypes) by :func:`all_gather_facts`."""
    fsdp_params: list
    static_reason: str | None  # tide.fsdp.fallbacks.static_all_gather_reason
    hooked: tuple[bool, ...]  # per param, whether it is a tensor extension; () when none is
    sharded: bool  # a param is sharded on a dim other than 0 (tide.fsdp.shard_dims): never bound into slots
    # Whether the group fits a slot, per (its extensions' input sizes, or None; the arena's slot bytes).
    slot_fits: dict = dataclasses.field(default_factory=dict)


class TideAllGather:
    """TIDE's state of one enabled param group's all-gather."""

    def __init__(self, param_group, transport: str = "auto", leaf: bool = False) -> None:
        # The FSDPParamGroup, whether its FSDP module has no FSDP module below it (both decide slot
        # binding), and the transport choice: "auto" uses the CUDA transport's arena on CUDA, "reference"
        # never creates one.
        self.param_group = param_group
        self.leaf = leaf
        self.transport = transport
        # What the group's all-gathers rest on that no call changes (:func:`all_gather_facts`).
        self.facts: AllGatherFacts | None = None
        # The group's all-gather decided on TIDE, kept for the calls it holds for (:class:`GroupAllGather`).
        self.decided = None
        # The CUDA contract's verdict for this group's ranks (tide.fsdp.fallbacks.contract_reason), once.
        self.contract: tuple[str | None] | None = None
        # (process group, whether its ranks are threads of this process), per process group seen.
        self.threaded: tuple | None = None
        # Whether the user's own comm in the group's slot was warned about (once per group and collective).
        self.custom_comm_warned = False

    def fsdp_comm(self):
        """The comm FSDP2 holds for this group's all-gather (the stock path's)."""
        return self.param_group._all_gather_comm


class TideReduceScatter:
    """TIDE's state of one enabled param group's reduce-scatter; carries the group's ``rs_mode``."""

    def __init__(self, param_group, rs_mode: str, transport: str = "auto") -> None:
        self.param_group = param_group
        self.rs_mode = rs_mode
        self.transport = transport
        # id(FSDPParam) -> handle of its Slot-Reuse post-accumulate-grad hook (tide.fsdp.hooks).
        self.grad_hooks: dict = {}
        # Whether those hooks moved a gradient into the slot since the group's last reduce (tide.stats()["wiring"]
        # then counts the reduce as rs:slot_reuse), so the reduce needs no look at where each gradient lies.
        self.grads_moved_into_slot = False
        # FSDPParams whose fixed properties (placement, offload, DTensor) passed: each reduce passes a
        # fresh list (the params that have grads), so the check is remembered per param.
        self.checked_params: set[int] = set()
        # The group's reduce decided on TIDE, kept for the calls it holds for (:class:`GroupReduce`).
        self.decided = None
        self.contract: tuple[str | None] | None = None
        self.threaded: tuple | None = None
        self.custom_comm_warned = False

    def take_grads_moved_into_slot(self) -> bool:
        """Whether the Slot-Reuse hooks moved any gradient into the slot since the last call (and start over)."""
        moved, self.grads_moved_into_slot = self.grads_moved_into_slot, False
        return moved

    def fsdp_comm(self):
        """The comm FSDP2 holds for this group's reduce-scatter (the stock path's)."""
        return self.param_group._reduce_scatter_comm


# The attribute of an FSDPParamGroup holding its (TideAllGather, TideReduceScatter): the state lives and
# dies with the group.
_ATTR = "_tide_comms"


def attach(param_group, all_gather: TideAllGather, reduce_scatter: TideReduceScatter) -> None:
    setattr(param_group, _ATTR, (all_gather, reduce_scatter))
    for p in param_group.fsdp_params:
        registry.groups_of_params[p] = weakref.ref(param_group)


def detach(param_group) -> None:
    if hasattr(param_group, _ATTR):
        delattr(param_group, _ATTR)
    for p in param_group.fsdp_params:
        registry.groups_of_params.pop(p, None)


def of_group(param_group) -> tuple[TideAllGather, TideReduceScatter] | None:
    """The group's TIDE state, or None when it is not enabled."""
    return getattr(param_group, _ATTR, None)


def of_params(fsdp_params) -> tuple[TideAllGather, TideReduceScatter] | None:
    """The TIDE state of the enabled group that holds ``fsdp_params`` (what FSDP2 passes its collectives),
    or None."""
    ref = registry.groups_of_params.get(fsdp_params[0]) if fsdp_params else None
    group = ref() if ref is not None else None
    return None if group is None else of_group(group)


@dataclasses.dataclass
class GroupAllGather:
    """A group's all-gather decided on TIDE, kept on its ``TideAllGather`` for the calls it :meth:`holds` for."""
    comm: TideAllGather
    rs_comm: TideReduceScatter
    facts: AllGatherFacts
    group: object  # the process group
    device: torch.device
    settings: tuple  # _all_gather_settings when decided
    route: routes.Route
    multinode: bool  # the route spans nodes (counted as tide_multinode); kept: the route's property asks topology
    arena: object | None
    mode: str  # wiring.plan_all_gather's: "bound" (a slot per call; "busy" when none is free), "direct", "none"
    specs: list  # wiring.output_specs: per param, its outputs' (numels, dtypes)

    def holds(self, fsdp_params, group, async_op: bool, device) -> bool:
        return (self.facts.fsdp_params is fsdp_params and self.group is group and not async_op and self.device == device
                and self.settings == _all_gather_settings(self.comm.param_group))


def _all_gather_settings(param_group) -> tuple:
    """What the owner of a group can change between its all-gathers that a kept decision rests on: FSDP2's
    comm (``set_custom_all_gather``), the output function, whether it reshards after forward (slot binding),
    and the arenas (``tide.routes``' generation: an arena enabled or dropped)."""
    return (type(param_group._all_gather_comm), getattr(param_group, "_all_gather_output_fn", None),
            param_group.post_forward_mesh_info is not None, registry.route_generation[0])


@dataclasses.dataclass
class GroupReduce:
    """A group's reduce decided on TIDE, kept on its ``TideReduceScatter`` for the calls it :meth:`holds` for."""
    comm: TideReduceScatter
    group: object
    device: torch.device
    settings: tuple  # _reduce_settings when decided
    route: routes.Route
    multinode: bool
    arena: object | None
    blocks: bool  # a param of the group is sharded on a dim other than 0 (tide.fsdp.shard_dims)

    def holds(self, group, device, custom_input_fn: bool) -> bool:
        return (self.group is group and self.device == device and not custom_input_fn
                and self.settings == _reduce_settings(self.comm.param_group))


def _reduce_settings(param_group) -> tuple:
    """What the owner of a group can change between its reduces that a kept decision rests on: FSDP2's comm
    (``set_custom_reduce_scatter``) and the arenas."""
    return type(param_group._reduce_scatter_comm), registry.route_generation[0]


@dataclasses.dataclass
class AllGatherCall:
    """One ``foreach_all_gather`` call: ``reason`` to take stock, or (None) TIDE's, with what it issues."""
    reason: str | None
    arena: object | None = None
    mode: str = "none"  # tide.fsdp.wiring.plan_all_gather: bound (in ``slot``), direct or none
    slot: int | None = None
    specs: list | None = None  # per param, its outputs' (numels, dtypes): tide.fsdp.wiring.output_specs
    inputs: list | None = None  # the tensor extensions' all-gather inputs (tide.fsdp.extensions)
    blocks: bool = False  # a param is sharded on a dim other than 0: the op takes its blocks (tide.fsdp.shard_dims)
    identity: contextlib.AbstractContextManager | None = None
    param_group: object | None = None
    install_hooks: bool = False  # a Slot-Reuse group has params without their hook yet (tide.fsdp.hooks)


@dataclasses.dataclass
class ReduceCall:
    """One ``foreach_reduce`` call: ``reason`` to take stock, or (None) TIDE's."""
    reason: str | None
    comm: TideReduceScatter | None
    arena: object | None = None
    from_slot: bool = False  # the Slot-Reuse hooks moved gradients into the slot since the group's last reduce
    identity: contextlib.AbstractContextManager | None = None
    blocks: bool = False  # the op takes the group's Shard(i > 0) params as dim-0 blocks (tide.fsdp.shard_dims)


def all_gather(fsdp_params, group, async_op: bool, device, copy_in_stream) -> AllGatherCall:
    """The decisions of one all-gather: the group's kept decision and this call's own reasons, or (the
    group's first call, or its settings changed) every reason."""
    enabled = of_params(fsdp_params)
    kept = enabled[0].decided if enabled is not None else None
    if kept is not None and kept.holds(fsdp_params, group, async_op, device):
        reason = fallbacks.all_gather_call_reason(fsdp_params, group, device, kept.route)
        if reason is None and kept.mode == "bound":
            mode, slot = wiring.take_slot(kept.arena)
            reason = fallbacks.arena_reason(mode)
        else:
            mode, slot = kept.mode, None
        return _all_gather_call(kept, reason, mode, slot, kept.specs, None)
    return _decide_all_gather(enabled, fsdp_params, group, async_op, device, copy_in_stream)


def _decide_all_gather(enabled, fsdp_params, group, async_op: bool, device, copy_in_stream) -> AllGatherCall:
    """Every reason of an all-gather, and the group's decision kept when it holds for later calls. A group with
    tensor extensions runs their pre-all-gather here, on the copy-in stream as stock runs it: its inputs size
    the outputs (on stock after it, stock runs it again, on every rank alike)."""
    WATCHDOG.check()  # every peer may be needed below (the joined check, the arena's rendezvous)
    comm = enabled[0] if enabled is not None else None
    reason = fallbacks.all_gather_reason(fsdp_params, group, async_op, device, comm)
    facts = all_gather_facts(comm, fsdp_params) if reason is None else None
    reason = reason or facts.static_reason
    if reason is not None:
        counters.count_fsdp("all_gather", reason)
        if reason == "custom_comm":
            _warn_custom_comm(comm, "all-gather", "set_custom_all_gather")
        return AllGatherCall(reason)
    arena = wiring.arena_for(group, routes.of(group), device, comm.transport)
    route = routes.of(group)  # resolved again: making the arena changed it
    inputs = None
    if facts.hooked:
        with _get_device_handle(device.type).stream(copy_in_stream):
            inputs = extensions.pre_all_gather(fsdp_params, facts.hooked)
        reason = fallbacks.extension_inputs_reason(inputs)
    mode, slot = wiring.plan_all_gather(arena, comm, facts, group.size(), inputs) if reason is None else ("none", None)
    decided = GroupAllGather(comm, enabled[1], facts, group, device, _all_gather_settings(comm.param_group), route,
                             route.multinode, arena, "bound" if mode == "busy" else mode,
                             wiring.output_specs(fsdp_params, inputs))
    if not facts.hooked:
        comm.decided = decided
    return _all_gather_call(decided, reason or fallbacks.arena_reason(mode), mode, slot, decided.specs, inputs)


def _all_gather_call(decided: GroupAllGather, reason: str | None, mode: str, slot: int | None, specs,
                     inputs) -> AllGatherCall:
    """The call of a group decided on TIDE: counted, and stock for this call's own ``reason``."""
    counters.count_fsdp("all_gather", reason, reason is None and decided.multinode)
    if reason is not None:
        return AllGatherCall(reason)
    _joins_the_step(decided.arena)
    param_group = decided.comm.param_group
    phase = "backward" if param_group._training_state == TrainingState.PRE_BACKWARD else "forward"
    return AllGatherCall(None, decided.arena, mode, slot, specs, inputs, decided.facts.sharded,
                         _identity(param_group, "all_gather", phase, decided.device), param_group,
                         install_hooks=(mode == "bound" and decided.rs_comm.rs_mode == "slot_reuse"
                                        and len(decided.rs_comm.grad_hooks) < len(decided.facts.fsdp_params)))


def all_gather_facts(comm: TideAllGather, fsdp_params) -> AllGatherFacts:
    """The group's :class:`tide.fsdp.AllGatherFacts` for this ``fsdp_params`` list: decided at its first
    all-gather, then kept on ``comm``."""
    facts = comm.facts
    if facts is None or facts.fsdp_params is not fsdp_params:
        facts = comm.facts = AllGatherFacts(fsdp_params, fallbacks.static_all_gather_reason(fsdp_params),
                                                  extensions.hooked(fsdp_params), shard_dims.sharded(fsdp_params))
    return facts


def reduce(fsdp_params, unsharded_grads, group, reduce_dtype, device, custom_input_fn: bool) -> ReduceCall:
    """The decisions of one reduce: the group's kept decision and this call's own reasons (its gradients), or
    (the group's first call, or its settings changed) every reason."""
    enabled = of_params(fsdp_params)
    comm = enabled[1] if enabled is not None else None
    from_slot = comm is not None and comm.take_grads_moved_into_slot()
    kept = comm.decided if comm is not None else None
    if kept is not None and kept.holds(group, device, custom_input_fn):
        reason = fallbacks.reduce_call_reason(fsdp_params, unsharded_grads, group, comm, reduce_dtype, device,
                                              kept.route)
    else:
        WATCHDOG.check()
        reason = fallbacks.reduce_reason(fsdp_params, unsharded_grads, group, comm, reduce_dtype, device,
                                         custom_input_fn)
        kept = None
        if reason is None:
            arena = wiring.arena_for(group, routes.of(group), device, comm.transport)
            route = routes.of(group)  # resolved again: making the arena changed it
            kept = comm.decided = GroupReduce(comm, group, device, _reduce_settings(comm.param_group), route,
                                              route.multinode, arena, shard_dims.sharded(comm.param_group.fsdp_params))
    counters.count_fsdp("reduce_scatter", reason, reason is None and kept.multinode)
    if reason is not None:
        if reason == "custom_comm":
            _warn_custom_comm(comm, "reduce-scatter", "set_custom_reduce_scatter")
        return ReduceCall(reason, comm)
    _joins_the_step(kept.arena)
    identity = _identity(comm.param_group, "reduce_scatter", "backward", device)
    return ReduceCall(None, comm, kept.arena, from_slot, identity, kept.blocks)


def _joins_the_step(arena) -> None:
    """What a TIDE collective's step needs besides the call: the leases given back when the backward ends
    (with an arena), and ``CommDebugMode`` counting TIDE's collectives once the user has loaded it."""
    if arena is not None:
        wiring.release_at_backward_end()
    if not registry.comm_debug_rules and comm_debug.COMM_MODE_MODULE in sys.modules:
        comm_debug.register()


# What each TIDE collective is in the program, declared to the ops (tide.meta.call_site): the module's FQN,
# the phase and the module's count of such calls (all-gathers, reduce-scatters) in that phase. Ranks that
# skipped or reordered a module's call then raise on every rank, naming both modules, instead of pairing
# it with another module's call of the same layout (the reference backend compares them; the CUDA path
# does not). A step declared around the training step (tide.train does) nests outside.
_UNREAD = contextlib.nullcontext()  # what a call off CPU declares: no backend reads an identity there


def _identity(param_group, op: str, phase: str, device) -> contextlib.AbstractContextManager:
    """The identity of ``param_group``'s next TIDE ``op`` in ``phase`` (its count of those) on a CPU ``device``,
    where the reference backend's call agreement compares it (tide/ops/calls.py); elsewhere nothing: no
    backend compares calls' identities off CPU (a CUDA plan or graph call compares what it moves)."""
    if device.type != "cpu":
        return _UNREAD
    counts = registry.call_counts.setdefault(param_group, {})
    count = counts[op, phase] = counts.get((op, phase), 0) + 1
    return call_identity(fqn=param_group._module_fqn or "", phase=phase, count=count)


def _warn_custom_comm(comm, collective: str, setter: str) -> None:
    """A group's collective left TIDE because its FSDP2 comm is the user's own: say so, once per group."""
    if comm.custom_comm_warned:
        return
    comm.custom_comm_warned = True
    warnings.warn(f"tide.fsdp: the {collective} of FSDP module {comm.param_group._module_fqn or '<root>'!r} uses a "
                  f"custom comm ({type(comm.fsdp_comm()).__name__}, FSDPModule.{setter}), so it takes stock FSDP2 "
                  "with that comm (tide.stats(): stock:custom_comm)", RuntimeWarning, stacklevel=3)
