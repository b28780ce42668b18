"""CUDA kernels of the ``tide`` ops: the TIDE transport when the group has an arena.

Two layers. Until the CUDA extension loads (no arena yet: nothing is built) the Python kernels below
serve CUDA calls. When it loads (:func:`hand_over`, a hook of ``tide.extension.load``), its C++
kernels take the CUDA dispatch key (csrc/transport/dispatch.cpp). Every call of the two mutating ops
then asks the gatekeeper (csrc/transport/gate.h) whether it may take the transport; a call it lets
through runs in C++ without entering Python, and every other call enters these Python kernels with the
gate's verdict and what the gate found (the arena, the plan, the all-gather's slot), which :data:`VERDICTS` turns into
what to do: issue through the transport's Python driver (``tide.transport.all_gather``,
``tide.transport.reduce_scatter``) with what the gate found; make what the verdict names as missing (the
group name's binding, a lease, a plan) and ask the gate again; run the reference backend (the stock
collectives, layout-aware; ``tide.stats()["ops"]`` counts why); or raise. Nothing the gate decided is
decided here again. Every call first raises the transport watchdog's error if an earlier TIDE op timed
out (``tide.transport.watchdog``).

The functional ``all_gather`` / ``reduce_scatter`` are the reference's compositions: they call these two
ops, and so do the graph ops ``all_gather_start`` / ``reduce_scatter_start``, whose kernels then register
an event-backed work on their outputs (``tide.ops.works``).
"""
from __future__ import annotations

import torch

from tide import counters, extension, knobs, registry, routes, trace
from tide.meta import checks
from tide.ops import reference, works

# The Python CUDA kernels' own library: dropped when the extension's C++ kernels take the key over.
_python_kernels = torch.library.Library("tide", "IMPL")


class _Transport:
    """The CUDA transport's modules, imported at the first CUDA call (``import tide`` loads none of them)."""

    def __getattr__(self, name: str):
        from tide.transport import all_gather, graph_calls, graph_gather, reduce_scatter, serving, watchdog

        self.all_gather, self.graph_gather, self.graph_calls = all_gather, graph_gather, graph_calls
        self.reduce_scatter, self.serving, self.WATCHDOG = reduce_scatter, serving, watchdog.WATCHDOG
        return getattr(self, name)


_transport = _Transport()


# What the Python kernels do with each verdict of the gatekeeper (csrc/transport/gate.h, whose kVerdicts
# these must name exactly: tests/ops/test_gate.py): issue with what the gate found; make what the verdict
# names as missing (bind the group name, lease, plan), then ask the gate again; run the reference backend
# (counted with the verdict as its reason); raise the argument's error; or word the error of arguments the
# collective refused.
VERDICTS = {
    "transport": "issue",  # the steady path is off (TIDE_TRACE): Python issues what C++ would have
    "no_arena": "bind",  # the reference backend where no arena serves the group's ranks
    "world_size": "raise",
    "grad": "raise",  # worded by the kernel's argument check, which every backend runs first
    "lease_across_capture": "reference",
    "no_lease": "lease",
    "outputs_not_in_slot": "reference",
    "no_plan": "plan",
    "capturing": "issue",  # with a replay mark
    "refused": "refuse",
}


class _Call:
    """One call of a mutating op that the gate did not let through, and what Python does for each action:
    ``gate(arena)`` asks the gate again ((verdict, its arena, plan[, slot])), ``issue(arena, captured, *found)``
    (found: plan[, slot]), ``new_plan(arena)`` and ``refuse(arena)`` are the transport driver's for these
    arguments."""

    def __init__(self, op: str, group_name: str, world_size: int, gate, issue, new_plan, refuse) -> None:
        self.op, self.group_name, self.world_size = op, group_name, world_size
        self.gate, self.issue, self.new_plan, self.refuse = gate, issue, new_plan, refuse


def _serve(call: _Call, verdict: str, native, found: tuple) -> bool:
    """Act on the gate's ``verdict`` (with the extension arena it found bound to the group name, ``native``,
    and the plan and slot it ``found``) until the call is issued through the transport (True) or belongs to
    the reference backend (False, counted with why). A verdict that names something missing is acted on
    once: the gate naming it again after that is a bug, raised."""
    _transport.WATCHDOG.check()
    route = routes.of_name(call.group_name)
    arena = route.arena if route is not None else None
    if native is not None and (arena is None or arena.native is not native):
        # The name is bound to another arena than its group's: a process group re-created under the name of
        # one whose arena is still enabled (destroy_process_group without tide.transport.disable).
        if arena is None:
            now = "no process group has it now" if route is None else "the group of that name now has none"
            raise RuntimeError(f"tide.{call.op}: group name {call.group_name!r} is bound to the arena of a process "
                               f"group destroyed under that name, and {now}: tide.transport.disable (or "
                               "tide.fsdp.disable) before destroy_process_group")
        verdict = "no_arena"  # for its own group's arena: bound below, and the gate asked again
    done = set()
    while True:
        action = VERDICTS[verdict]
        if action == "issue":
            call.issue(arena, verdict == "capturing", *found)
            return True
        if action == "reference":
            counters.count_op(call.op, verdict)
            return False
        if action == "raise":
            if verdict == "world_size":
                raise ValueError(f"tide.{call.op}: world_size={call.world_size} but group {call.group_name!r} has "
                                 f"{len(route.ranks)} ranks")
            raise AssertionError(f"tide.{call.op}: the transport's gate refused an argument ({verdict}) that its "
                                 "check passed")
        if action == "refuse":
            call.refuse(arena)  # raises
        if action in done:
            raise AssertionError(f"tide.{call.op}: the transport's gate answered {verdict!r} again after it was "
                                 "acted on")
        done.add(action)
        if action == "bind" and (route is None or not _transport.serving.bind(route)):
            # No arena of the group's own ranks: the reference backend, which runs a multi-node group's schedule.
            if route is not None and route.multinode:
                counters.count_op(call.op, multinode=True)
            else:
                counters.count_op(call.op, verdict)
            return False
        if action == "lease":
            arena.region()
        elif action == "plan":
            call.new_plan(arena)
        verdict, _, *found = call.gate(arena)


def all_gather_into_params_(shards, outs, world_size, group_name, verdict="no_arena", native=None, plan=None,
                            slot=-1) -> None:
    op = "all_gather_into_params_"
    knobs.validate_once()  # TIDE's first use (a CUDA call enters Python at least at its layout's first call)
    if torch.is_grad_enabled():  # FSDP2 calls under no_grad: nothing to look at on its path
        checks.check_no_grad(op, (("shards", shards), ("outs", outs)))
    driver = _transport.all_gather
    call = _Call(op, group_name, world_size,
                 gate=lambda a: a.ext.gate_all_gather(shards, outs, world_size, group_name),
                 issue=lambda a, captured, plan, slot: driver.issue_call(a, shards, outs, plan, slot, captured),
                 new_plan=lambda a: driver.new_plan(a, shards, outs), refuse=lambda a: driver.refuse(a, shards, outs))
    if _serve(call, verdict, native, (plan, slot)):
        counters.count_op(op)
    else:
        reference.all_gather_into_params_(shards, outs, world_size, group_name)


def reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name, verdict="no_arena",
                           native=None, plan=None) -> None:
    op = "reduce_scatter_params_"
    knobs.validate_once()
    if torch.is_grad_enabled():
        checks.check_no_grad(op, (("grads", grads), ("shard_grads", shard_grads)))
    driver = _transport.reduce_scatter
    call = _Call(op, group_name, world_size,
                 gate=lambda a: a.ext.gate_reduce_scatter(grads, shard_grads, world_size, group_name),
                 issue=lambda a, captured, plan: driver.issue_call(a, grads, shard_grads, scale, accumulate, plan,
                                                                   captured),
                 new_plan=lambda a: driver.new_plan(a, grads, shard_grads),
                 refuse=lambda a: driver.refuse(a, grads, shard_grads))
    if _serve(call, verdict, native, (plan,)):
        counters.count_op(op)
    else:
        reference.reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name)


_KERNELS = {
    "all_gather_into_params_": all_gather_into_params_,
    "reduce_scatter_params_": reduce_scatter_params_,
    "all_gather": reference.all_gather,
    "reduce_scatter": reference.reduce_scatter,
}
for _name, _fn in _KERNELS.items():
    _python_kernels.impl(_name, _fn, "CUDA")


# The graph ops stay Python kernels (their own library: the extension takes over only the four above). Each
# runs on its kind's side stream and holds its inputs until its wait (tide/ops/works.py).
def all_gather_start(shards, world_size, group_name) -> list[torch.Tensor]:
    """Outputs gathered by the transport in a free slot of the group's arena (``slot``) or in memory of the
    caching allocator (``allocator:<why no slot>``): tide/transport/graph_gather.py. Without an arena, or
    where the ranks cannot export allocator memory, the reference backend gathers into allocator outputs
    (``reference:<why>``)."""
    op = "all_gather_start"
    knobs.validate_once()
    shards = reference.checked_shards(op, shards, world_size, group_name)
    _transport.WATCHDOG.check()
    route = routes.of_name(group_name)
    a = route.arena if route is not None else None
    side = works.side_stream("all_gather", shards[0].device)
    got = None
    with works.issued_on(side):
        if a is None:
            why = "no_arena"
        elif a.world_size != world_size:
            why = "world_size"
        else:
            _transport.graph_calls.check(a, op, shards)
            got = _transport.graph_gather.gather(a, shards, world_size, group_name)
            why = "no_ipc"  # gather gives None only where the ranks cannot export allocator memory
        if got is None:
            outs, where = reference.gather_into_new(shards, world_size, group_name), f"reference:{why}"
        else:
            outs, where = got
    counters.count_graph_op(op, where)
    works.register(outs, side, held=shards)
    return outs


def reduce_scatter_start(grads, scale, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    op = "reduce_scatter_start"
    grads = reference.checked_grads(op, grads, out_dtype, world_size, group_name)
    route = routes.of_name(group_name)
    if route is not None and route.arena is not None and route.arena.world_size == world_size:
        _transport.WATCHDOG.check()
        _transport.graph_calls.check(route.arena, op, grads, (f"scale={scale!r}", f"out_dtype={out_dtype}"))
    side = works.side_stream("reduce_scatter", grads[0].device)
    with works.issued_on(side):
        shards = reference.scatter_into_new(grads, scale, out_dtype, world_size, group_name)
    counters.count_graph_op(op, "allocator")
    works.register(shards, side, held=grads)
    return shards


_graph_kernels = torch.library.Library("tide", "IMPL")
_graph_kernels.impl("all_gather_start", all_gather_start, "CUDA")
_graph_kernels.impl("reduce_scatter_start", reduce_scatter_start, "CUDA")


def hand_over(ext) -> None:
    """Give the CUDA dispatch key to the extension's C++ kernels, which enter the Python kernels above for
    every call they do not take themselves; ``tide.stats()`` counts the calls that stayed in C++. Once
    per process (the extension loads once). With ``TIDE_TRACE=1`` every call enters Python, which traces it,
    and so does every call after a TIDE op timed out (the watchdog's error is raised there)."""
    global _python_kernels
    if _python_kernels is None:
        return
    _python_kernels._destroy()
    _python_kernels = None
    ext.hand_over_kernels(**_KERNELS)
    ext.steady_enable(on=not trace.ENABLED)
    # After a timeout every call enters Python, whose first step raises the watchdog's error.
    _transport.WATCHDOG.on_expiry(lambda: ext.steady_enable(on=False))
    registry.op_call_sources.append((lambda: {f"{op}:tide": n for op, n in ext.steady_calls().items() if n},
                                     ext.steady_reset_calls))


# Whoever loads the extension first (an arena, the summing kernel, the NCCL rails), the ops take it then.
extension.on_load(hand_over)
