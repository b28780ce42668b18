"""Everything the seam decides about one FSDP2 collective before it issues anything, in one place.

:func:`all_gather` and :func:`reduce` answer a call: its stock reason (``tide.fsdp.fallbacks``; counted in
``tide.stats()["fsdp"]``, a user's own comm warned once per group), or the TIDE call, which carries all
that ``tide.fsdp.seam`` needs to issue it: the group's TIDE state, the arena serving it (its route,
``tide.routes``; the arena made at the group's first TIDE collective, ``tide.fsdp.wiring``), the tensor
extensions' all-gather inputs, the all-gather's slot plan, where a reduce reads its gradients, and the
call's identity (``tide.meta.call_site``). What cannot change between calls is decided once per group and
kept (the route; the group's :func:`all_gather_facts`: its fixed reasons, tensor extensions and slot fit),
so a steady call looks facts up and decides only what is its own: the slot it takes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

from tide import counters, registry, routes
from tide.fsdp import comm_debug, comms, extensions, shard_dims, wiring
from tide.fsdp.fallbacks import (all_gather_reason, arena_reason, extension_inputs_reason, reduce_reason,
                                 static_all_gather_reason)
from tide.meta.call_site import call_identity


@dataclasses.dataclass
class AllGatherCall:
    """One ``foreach_all_gather`` call: ``reason`` to take stock, or (None) TIDE's, with what it issues."""
    reason: str | None
    arena: object | None = None
    mode: str = "none"  # tide.fsdp.wiring.plan_all_gather: bound (in ``slot``), direct or none
    slot: int | None = None
    inputs: list | None = None  # the tensor extensions' all-gather inputs (tide.fsdp.extensions)
    identity: contextlib.AbstractContextManager | None = None
    param_group: object | None = None
    slot_reuse: bool = False  # the group's gradients move into its slot (tide.fsdp.hooks)


@dataclasses.dataclass
class ReduceCall:
    """One ``foreach_reduce`` call: ``reason`` to take stock, or (None) TIDE's."""
    reason: str | None
    comm: comms.TideReduceScatter | None
    arena: object | None = None
    from_slot: bool = False  # the Slot-Reuse hooks moved gradients into the slot since the group's last reduce
    identity: contextlib.AbstractContextManager | None = None


def all_gather(fsdp_params, group, async_op: bool, device, copy_in_stream) -> AllGatherCall:
    """The decisions of one all-gather. A group with tensor extensions runs their pre-all-gather here, on
    the copy-in stream as stock runs it: its inputs size the outputs (on stock after it, stock runs it
    again, on every rank alike)."""
    enabled = comms.of_params(fsdp_params)
    comm = enabled[0] if enabled is not None else None
    reason = all_gather_reason(fsdp_params, group, async_op, device, comm)
    facts = all_gather_facts(comm, fsdp_params) if reason is None else None
    reason = reason or facts.static_reason
    arena, plan, inputs, route = None, ("none", None), None, None
    if reason is None:
        route = routes.of(group)
        arena = wiring.arena_for(group, route, device, comm.transport)
        if facts.hooked:
            with _get_device_handle(device.type).stream(copy_in_stream):
                inputs = extensions.pre_all_gather(fsdp_params, facts.hooked)
            reason = extension_inputs_reason(inputs)
        if reason is None:
            plan = wiring.plan_all_gather(arena, comm, facts, group.size(), inputs)
            reason = arena_reason(plan[0])
    counters.count_fsdp("all_gather", reason, reason is None and route.multinode)
    if reason is not None:
        if reason == "custom_comm":
            _warn_custom_comm(comm, "all-gather", "set_custom_all_gather")
        return AllGatherCall(reason)
    _joins_the_step(arena)
    param_group = comm.param_group
    phase = "backward" if param_group._training_state == TrainingState.PRE_BACKWARD else "forward"
    return AllGatherCall(None, arena, plan[0], plan[1], inputs, _identity(param_group, "all_gather", phase, device),
                         param_group, slot_reuse=enabled[1].rs_mode == "slot_reuse")


def all_gather_facts(comm: comms.TideAllGather, fsdp_params) -> comms.AllGatherFacts:
    """The group's :class:`tide.fsdp.comms.AllGatherFacts` for this ``fsdp_params`` list: decided at its first
    all-gather, then kept on ``comm``."""
    facts = comm.facts
    if facts is None or facts.fsdp_params is not fsdp_params:
        facts = comm.facts = comms.AllGatherFacts(fsdp_params, static_all_gather_reason(fsdp_params),
                                                  extensions.hooked(fsdp_params), shard_dims.sharded(fsdp_params))
    return facts


def reduce(fsdp_params, unsharded_grads, group, reduce_dtype, device, custom_input_fn: bool) -> ReduceCall:
    """The decisions of one reduce."""
    enabled = comms.of_params(fsdp_params)
    comm = enabled[1] if enabled is not None else None
    from_slot = comm is not None and comm.take_grads_moved_into_slot()
    reason = reduce_reason(fsdp_params, unsharded_grads, group, comm, reduce_dtype, device, custom_input_fn)
    route = routes.of(group) if reason is None else None
    counters.count_fsdp("reduce_scatter", reason, route is not None and route.multinode)
    if reason is not None:
        if reason == "custom_comm":
            _warn_custom_comm(comm, "reduce-scatter", "set_custom_reduce_scatter")
        return ReduceCall(reason, comm)
    arena = wiring.arena_for(group, route, device, comm.transport)
    _joins_the_step(arena)
    return ReduceCall(None, comm, arena, from_slot, _identity(comm.param_group, "reduce_scatter", "backward", device))


def _joins_the_step(arena) -> None:
    """What a TIDE collective's step needs besides the call: the leases given back when the backward ends
    (with an arena), and ``CommDebugMode`` counting TIDE's collectives once the user has loaded it."""
    if arena is not None:
        wiring.release_at_backward_end()
    comm_debug.register_if_loaded()


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
