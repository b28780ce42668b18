"""TIDE-RS's driver: the reduce-scatter of gradients into this rank's fp32 shard grads (the pushes and
sums themselves are csrc/transport/reduce_scatter.cpp, whose header has the protocol and the staging
layout).

The driver does what the ops' gate asks of it (tide/ops/cuda.py): :func:`new_plan` builds each call shape's
plan the first time (:func:`tide.meta.plans.rs_plan_info`: every destination's rounds, packed for the
arena's staging entries, and this rank's padding), after its arguments are checked and every rank agreed
on it, and the extension keeps it, whose C++ kernel takes later calls of that shape without Python;
:func:`issue_call` enters the extension once with the plan the gate found.
"""
from __future__ import annotations

from typing import Sequence

import torch

from tide.meta import checks, plans
from tide.transport import issue

OP = "reduce_scatter_params_"


def native_rounds(ext, rounds: list) -> list:
    """``rounds[d][j]`` (:class:`tide.meta.plans.RsPiece`) as the extension's named ``RsChunk`` records."""
    return [[[ext.RsChunk(**c._asdict()) for c in rnd] for rnd in per_dest] for per_dest in rounds]


def native_plan(ext, info: plans.RsPlanInfo, dtypes: Sequence[torch.dtype]):
    """The extension's RsPlan of ``info``'s rounds and padding."""
    return ext.RsPlan(rounds=native_rounds(ext, info.rounds), pads=[ext.ShardRange(**p._asdict()) for p in info.pads],
                      grad_dtype=list(dtypes))


def _check(arena, grads, shard_grads):
    return lambda: checks.check_reduce_scatter_params(OP, grads, shard_grads, arena.world_size)


def new_plan(arena, grads, shard_grads):
    """This call shape's plan (the extension's RsPlan), built after its arguments are checked and every rank
    agreed on it, and kept by the extension for every later call of the shape."""
    issue.check_args(arena, OP, _check(arena, grads, shard_grads), ("grads", grads), ("shard_grads", shard_grads))
    issue.agree_plan(arena, OP, (grads,))
    dtypes = [g.dtype for g in grads]
    info = plans.rs_plan_info([g.shape for g in grads], dtypes, arena.world_size, arena.rank, arena.entry_bytes)
    plan = native_plan(arena.ext, info, dtypes)
    arena.native.keep_rs_plan(grads=grads, plan=plan)
    return plan


def issue_call(arena, grads: Sequence[torch.Tensor], shard_grads: Sequence[torch.Tensor], scale: float,
               accumulate: bool, plan, captured: bool) -> None:
    """TIDE-RS into this rank's fp32 ``shard_grads`` with the ``plan`` the gate found, reading every gradient
    where it lies; ``captured``: the gate's ``capturing`` (issued with a replay mark). A slot that holds some
    of the gradients (FSDP's Slot-Reuse hooks put them at their parameters' places there) is busy until the
    reduce-scatter has read them."""
    arena.native.use_region_on_current_stream()  # the lease's user until the stream passes this call
    if issue.watched(arena, OP, arena.native.reduce_scatter, captured, plan=plan, grads=grads, shard_grads=shard_grads,
                     scale=float(scale), accumulate=bool(accumulate)) != "tide":
        refuse(arena, grads, shard_grads)
    arena.read_from_slots(grads)


def refuse(arena, grads, shard_grads) -> None:
    """Raise the error of arguments the extension refused."""
    issue.refuse(arena, OP, _check(arena, grads, shard_grads), ("grads", grads), ("shard_grads", shard_grads))
