"""TIDE-AG's driver: the all-gather of shards into outputs bound in an arena slot (the copy itself is
csrc/transport/all_gather.cpp, whose header has the protocol).

Outputs are bound at their param-major places of one slot (``Arena.bind_outputs``: param j's output at
``out_offset[j]``, rank r's shard of it ``r * shard_bytes[j]`` further). Whether a call's outputs lie
there is the extension arena's one rule (``placed_slot``, csrc/transport/arena.h), which the ops' gate
(csrc/transport/gate.h) applies to every call. This driver does what the gate's verdict asks of it
(tide/ops/cuda.py): :func:`new_plan` builds a call shape's plan the first time (:func:`tide.meta.plans.ag_plan_info`,
agreed by every rank first, then kept by the extension, whose C++ kernel takes later calls of that shape
without Python), and :func:`issue_call` enters the extension once with the plan and slot the gate found.

The graph op ``all_gather_start`` makes its own outputs (tide/transport/graph_gather.py): in a free slot,
else on the arena's direct lane (:func:`all_gather_direct`): a region of the caching allocator leased for
this one call on every rank and mapped by the peers (tide/transport/lease.py), which the same protocol
fills on flag lane K (csrc/transport/flags.h).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tide.meta import checks, plans
from tide.meta.layout import GroupLayout
from tide.transport import issue

OP = "all_gather_into_params_"


def _lists(shards, outs) -> tuple:
    return ("shards", shards), ("outs", outs)


def _check(arena, shards, outs):
    """The op's argument check of these arguments (run it later: a thunk)."""
    return lambda: checks.check_all_gather_into_params(OP, shards, outs, arena.world_size)


def new_plan(arena, shards, outs):
    """This call shape's plan (the extension's AgPlan), built after its arguments are checked and every rank
    agreed on it, and kept by the extension for every later call of the shape."""
    issue.check_args(arena, OP, _check(arena, shards, outs), *_lists(shards, outs))
    issue.agree_plan(arena, OP, (shards, outs))
    dtypes = [o.dtype for o in outs]
    layout = plans.all_gather_layout([s.shape for s in shards], dtypes, arena.world_size)
    info = plans.ag_plan_info(layout, arena.rank)
    native = arena.ext.AgPlan(own_offset=info.own_offset, out_offset=info.out_offset, out_numel=info.out_numel,
                              out_dtype=dtypes, slot_bytes=layout.slot_bytes,
                              chunks=[[arena.ext.ShardRange(**r._asdict()) for r in chunk] for chunk in info.chunks])
    arena.native.keep_ag_plan(shards=shards, outs=outs, plan=native)
    return native


def issue_call(arena, shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], plan, slot: int,
               captured: bool) -> None:
    """TIDE-AG of ``shards`` into ``outs``, which the gate found at ``plan``'s places of ``slot`` of the held
    lease; ``captured``: the gate's ``capturing`` (issued with a replay mark)."""
    arena.native.use_region_on_current_stream()  # the lease's user until the stream passes this call
    if issue.watched(arena, OP, arena.native.all_gather, captured, plan=plan, shards=shards, outs=outs,
                     lane=slot) != "tide":
        refuse(arena, shards, outs)


def refuse(arena, shards, outs) -> None:
    """Raise the error of arguments the extension refused."""
    issue.refuse(arena, OP, _check(arena, shards, outs), *_lists(shards, outs))


def all_gather_direct(arena, shards: Sequence[torch.Tensor], layout: GroupLayout) -> list[torch.Tensor] | None:
    """The flat all-gather outputs of ``shards`` (checked, contiguous; ``layout`` their
    :func:`tide.meta.plans.all_gather_layout`) in a region of the caching allocator leased for this call
    (collective: every rank at the same call), gathered by the transport on the direct lane; None when the
    ranks cannot export allocator memory (``arena.direct.mode`` says why; nothing issued). The region lives
    while any of the outputs does."""
    region = arena.direct.acquire(layout.slot_bytes)
    if region is None:
        return None
    try:
        # Each output a storage of its own (a custom op's outputs may not alias), pointed at its place in the
        # region, which each keeps alive.
        outs = [torch.empty(arena.world_size * s.numel(), dtype=s.dtype, device=arena.device) for s in shards]
        if not arena.ext.bind_storages(outs=outs, device=arena.device.index, region=region, base=region.data_ptr(),
                                       offsets=[p.slot_offset for p in layout.params],
                                       nbytes=[p.out_bytes for p in layout.params]):
            raise RuntimeError(f"tide.{OP}: the direct lane's outputs could not be pointed into its lease")
        plan = arena.native.ag_plan(shards=shards, outs=outs) or new_plan(arena, shards, outs)
        if issue.watched(arena, OP, arena.native.all_gather, issue.capturing(), plan=plan, shards=shards, outs=outs,
                         lane=arena.num_slots) != "tide":
            refuse(arena, shards, outs)
    finally:
        arena.direct.release()  # the peers' pushes were issued; the lane's addresses go with the lease
    return outs
