"""CUDA kernels of the ``tide`` ops: the TIDE transport when the group has an arena.

Two layers. Until the CUDA extension loads (no arena yet: nothing is built) the Python kernels below
serve CUDA calls. When it loads (:func:`hand_over`, a hook of ``tide.extension.load``), its C++
kernels take the CUDA dispatch key (csrc/transport/dispatch.cpp): a call on a layout seen before runs
in C++ without entering Python, and every other call enters these Python kernels, which take the
decisions that need Python (the lease, a new plan, capture, a fallback, the argument errors) and
leave behind what the next call of that layout needs in C++.

For a CUDA call here: if ``tide.transport`` holds an arena for ``group_name`` (``tide.transport.enable``),
the transport runs (the all-gather when its outputs are bound in an arena slot: zero-copy), eagerly or
captured into the CUDA graph the current stream is capturing (docs/design.md, "Captured into a CUDA
graph"); otherwise the reference backend runs (the stock collectives, layout-aware), and
``tide.stats()["ops"]`` counts why. Every call first raises the transport watchdog's error if an
earlier TIDE op timed out (``tide.transport.watchdog``). The drivers (``tide.transport.all_gather``,
``tide.transport.reduce_scatter``) find the plan and the slot and enter the extension once. The
functional ``all_gather`` / ``reduce_scatter`` are the reference's compositions: they call these two ops,
and so do the graph ops ``all_gather_start`` / ``reduce_scatter_start``, whose kernels then register an
event-backed work on their outputs (``tide.ops.works``).
"""
from __future__ import annotations

import torch

from tide import counters, extension, knobs, registry, topology, trace
from tide.meta import checks
from tide.ops import reference, works

# The Python CUDA kernels' own library: dropped when the extension's C++ kernels take the key over.
_python_kernels = torch.library.Library("tide", "IMPL")


class _Transport:
    """The CUDA transport's modules, imported at the first CUDA call (``import tide`` loads none of them)."""

    def __getattr__(self, name: str):
        from tide.transport import all_gather, graph_gather, reduce_scatter, serving, watchdog

        self.all_gather, self.serving, self.graph_gather = all_gather, serving, graph_gather
        self.reduce_scatter, self.WATCHDOG = reduce_scatter, watchdog.WATCHDOG
        return getattr(self, name)


_transport = _Transport()


def _arena_for(op: str, group_name: str, world_size: int):
    _transport.WATCHDOG.check()
    a = _transport.serving.get(group_name)
    if a is None:
        group = reference.resolve_group(op, group_name, world_size)
        if topology.is_multinode(topology.of_group(group)):  # the reference runs the multi-node schedule
            counters.count_op(op, multinode=True)
        else:
            counters.count_op(op, "no_arena")
        return None
    if a.world_size != world_size:
        raise ValueError(f"tide.{op}: world_size={world_size} but group {group_name!r} has {a.world_size} ranks")
    if a.leases.held_elsewhere():  # e.g. outputs bound in an eager lease, gathered inside a capture
        counters.count_op(op, "lease_across_capture")
        return None
    a.ext.steady_bind_group(group_name=group_name, arena=a.native, world_size=world_size)
    return a


def all_gather_into_params_(shards, outs, world_size, group_name) -> None:
    op = "all_gather_into_params_"
    knobs.validate_once()  # TIDE's first use (a CUDA call enters Python at least at its layout's first call)
    if torch.is_grad_enabled():  # FSDP2 calls under no_grad: nothing to look at on its path
        checks.check_no_grad(op, (("shards", shards), ("outs", outs)))
    a = _arena_for(op, group_name, world_size)
    if a is not None:
        if _transport.all_gather.all_gather_into_params(a, shards, outs):
            counters.count_op(op)
            return
        counters.count_op(op, "outputs_not_in_slot")
    reference.all_gather_into_params_(shards, outs, world_size, group_name)


def reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name) -> None:
    op = "reduce_scatter_params_"
    knobs.validate_once()
    if torch.is_grad_enabled():
        checks.check_no_grad(op, (("grads", grads), ("shard_grads", shard_grads)))
    a = _arena_for(op, group_name, world_size)
    if a is None:
        reference.reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name)
        return
    _transport.reduce_scatter.reduce_scatter_params(a, grads, shard_grads, scale, accumulate)
    counters.count_op(op)


_KERNELS = {
    "all_gather_into_params_": all_gather_into_params_,
    "reduce_scatter_params_": reduce_scatter_params_,
    "all_gather": reference.all_gather,
    "reduce_scatter": reference.reduce_scatter,
}
for _name, _fn in _KERNELS.items():
    _python_kernels.impl(_name, _fn, "CUDA")


# The graph ops stay Python kernels (their own library: the extension takes over only the four above).
def all_gather_start(shards, world_size, group_name) -> list[torch.Tensor]:
    """Outputs gathered by the transport in a free slot of the group's arena (``slot``) or in memory of the
    caching allocator (``allocator:<why no slot>``): tide/transport/graph_gather.py. Without an arena, or
    where the ranks cannot export allocator memory, the reference backend gathers into allocator outputs
    (``reference:<why>``)."""
    op = "all_gather_start"
    knobs.validate_once()
    shards = reference.checked_shards(op, shards, world_size, group_name)
    _transport.WATCHDOG.check()
    a = _transport.serving.get(group_name)
    got = None
    if a is None:
        why = "no_arena"
    elif a.world_size != world_size:
        why = "world_size"
    else:
        got = _transport.graph_gather.gather(a, shards, world_size, group_name)
        why = "no_ipc"  # gather gives None only where the ranks cannot export allocator memory
    if got is None:
        outs, where = reference.gather_into_new(shards, world_size, group_name), f"reference:{why}"
    else:
        outs, where = got
    counters.count_graph_op(op, where)
    works.register(outs)
    return outs


def reduce_scatter_start(grads, scale, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    shards = reference.reduce_scatter_into_new("reduce_scatter_start", grads, scale, out_dtype, world_size,
                                               group_name)
    counters.count_graph_op("reduce_scatter_start", "allocator")
    works.register(shards)
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
