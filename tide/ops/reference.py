"""Reference backend of the ``tide`` ops over ``torch.distributed`` (gloo on CPU, gloo or NCCL on CUDA).

Layout-aware like the CUDA transport, only slower: the all-gather writes straight into each parameter's
output (the own shard is cast into its final rows, then gathered in place), and the reduce-scatter
exchanges each gradient's destination rows with ``all_to_all_single`` straight from autograd's tensor,
then sums the W contributions in fp32 in rank order. No flat rank-major buffer and no full-group fp32
buffer is built; the only staging is one bf16 receive buffer per parameter (this rank's rows from all
W ranks) while its exchange is in flight.

Its results define the ops' semantics: the CUDA transport must match them bit for bit. A group whose
ranks span several nodes (``tide.topology``) runs the multi-node schedule instead
(``tide/multinode/schedule.py``), whose fp32 order sums node partials: see the schemas.

On CPU every call is first agreed by its ranks (``tide/ops/calls.py``): each rank's check outcome,
op, layout, declared identity and thread travel in one record per call through the group's store, so a
rank's bad input, a skipped or reordered call or a peer that ended raises on every rank, naming it, before
any collective is issued; and every wait, the exchange's and the collectives', is bounded by
``TIDE_TIMEOUT_S`` (else the process group's timeout). (On CUDA that exchange would stall the host on the
GPU every call; the CUDA path has none.)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tide import counters, knobs, routes, sums
from tide.meta import checks
from tide.meta.layout import rank_row_range, rows_and_row_numel
from tide.multinode import schedule as multinode
from tide.ops import calls, works

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_group(op: str, group_name: str, world_size: int) -> dist.ProcessGroup:
    """The process group registered as ``group_name``, checked against ``world_size``."""
    group = calls.resolve_group(op, group_name)
    error = calls.world_size_error(op, world_size, group)
    if error is not None:
        raise error
    return group


def _first_use_then(check, *args) -> None:
    """``check(*args)`` after the knobs' validation at TIDE's first use (:func:`tide.knobs.validate_once`): a
    bad ``TIDE_*`` value fails this rank's check, which the call's exchange raises on every rank."""
    knobs.validate_once()
    check(*args)


def _count_cpu_call(op: str, tensor: torch.Tensor, route: routes.Route) -> None:
    """Count a CPU call as ``tide/ops/cuda.py`` counts a CUDA one (which counted before calling here):
    the multi-node schedule, else the reference backend."""
    if tensor.is_cuda:
        return
    if route.multinode:
        counters.count_op(op, multinode=True)
    else:
        counters.count_op(op, reference=True)


def all_gather_into_params_(shards, outs, world_size, group_name) -> None:
    op = "all_gather_into_params_"
    with calls.agreed(op, group_name, world_size, (shards, outs), (("outs", outs),), (("shards", shards),),
                      lambda: _first_use_then(checks.check_all_gather_into_params, op, shards, outs, world_size),
                      lambda group: (routes.of(group).topology,),
                      lambda rank: checks.all_gather_own_rows(shards, outs, rank)) as call:
        group = call.group
        route = routes.of(group)
        _count_cpu_call(op, shards[0], route)
        if route.multinode:
            multinode.all_gather(shards, outs, group, route)
            return
        rank = group.rank()
        works = []
        for shard, out in zip(shards, outs):
            n = shard.numel()
            if n == 0:
                continue
            flat = out.view(-1)
            own = flat[rank * n:(rank + 1) * n]
            own.copy_(shard.view(-1))  # the only cast: own shard into its final rows
            works.append(_all_gather_single(flat, own, group=group, async_op=True))
        call.wait(works)


def reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name) -> None:
    op = "reduce_scatter_params_"
    with calls.agreed(op, group_name, world_size, (grads, shard_grads), (("shard_grads", shard_grads),),
                      (("grads", grads),),
                      lambda: _first_use_then(checks.check_reduce_scatter_params, op, grads, shard_grads, world_size),
                      lambda group: (accumulate, f"scale={scale!r}", routes.of(group).topology)) as call:
        group = call.group
        route = routes.of(group)
        _count_cpu_call(op, grads[0], route)
        if route.multinode:
            multinode.reduce_scatter(grads, shard_grads, scale, accumulate, group, route)
            return
        rank = group.rank()
        pending = []
        for grad, shard in zip(grads, shard_grads):
            d0, row = rows_and_row_numel(tuple(grad.shape))
            send = []
            for r in range(world_size):
                start, stop = rank_row_range(d0, world_size, r)
                send.append((stop - start) * row)
            mine = send[rank]
            recv = grad.new_empty((world_size, mine))
            work = None
            if d0 * row:
                work = dist.all_to_all_single(recv.view(-1), grad.reshape(-1), [mine] * world_size, send,
                                              group=group, async_op=True)
            pending.append((work, recv, shard))
        call.wait([work for work, _, _ in pending if work is not None])
        for work, recv, shard in pending:
            flat, n = shard.view(-1), recv.shape[1]
            # the W contributions in rank order
            sums.sum_rows_reference([flat[:n]], recv, scale=scale, accumulate=accumulate)
            if not accumulate:
                flat[n:].zero_()  # padding rows


# The functional pair: a rank whose check fails refuses through the call's exchange (tide/ops/calls.py), so
# that its peers, issuing the mutating op, raise too. Below autograd their inputs may require grad: the
# mutating op gets them detached (it is not differentiable; the pair's autograd is its own).
def all_gather(shards, world_size, group_name) -> list[torch.Tensor]:
    try:
        checks.check_all_gather("all_gather", shards, world_size)
    except (ValueError, TypeError) as e:
        calls.refuse("all_gather", group_name, world_size, (shards,), e)
    shards = [s.detach() for s in shards]
    outs = [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards]
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group_name)
    return outs


def reduce_scatter(inputs, scale, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    try:
        checks.check_reduce_scatter("reduce_scatter", inputs, out_dtype, world_size)
    except (ValueError, TypeError) as e:
        calls.refuse("reduce_scatter", group_name, world_size, (inputs,), e)
    inputs = [x.detach() for x in inputs]
    shards = [x.new_empty((x.shape[0] // world_size, *x.shape[1:]), dtype=torch.float32) for x in inputs]
    torch.ops.tide.reduce_scatter_params_(inputs, shards, scale, False, world_size, group_name)
    return [s if (out_dtype or x.dtype) == torch.float32 else s.to(out_dtype or x.dtype)
            for s, x in zip(shards, inputs)]


# The graph ops' work, on any device: fresh outputs filled by the mutating op through the dispatcher (on CUDA
# the transport's kernels, in C++ where they take the call). Their kernels register the call's work after it.
def checked_shards(op, shards, world_size, group_name) -> list[torch.Tensor]:
    """The graph all-gather's ``shards``, detached, once they pass its checks (else refused on every rank)."""
    try:
        checks.check_all_gather(op, shards, world_size, checks.GATHER_DTYPES)
    except (ValueError, TypeError) as e:
        calls.refuse(op, group_name, world_size, (shards,), e)
    return [s.detach() for s in shards]


def gather_into_new(shards, world_size, group_name) -> list[torch.Tensor]:
    """New outputs gathered from ``shards`` (already :func:`checked_shards`)."""
    outs = [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards]
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group_name)
    return outs


def checked_grads(op, grads, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    """The graph reduce-scatter's ``grads``, detached, once they pass its checks (else refused on every rank)."""
    try:
        checks.check_reduce_scatter_start(op, grads, out_dtype, world_size)
    except (ValueError, TypeError) as e:
        calls.refuse(op, group_name, world_size, (grads,), e)
    return [g.detach() for g in grads]


def scatter_into_new(grads, scale, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    """New shards reduced from ``grads`` (already :func:`checked_grads`)."""
    shards = [g.new_empty(checks.padded_shard_shape(g.shape, world_size), dtype=torch.float32) for g in grads]
    torch.ops.tide.reduce_scatter_params_(grads, shards, scale, False, world_size, group_name)
    return shards if out_dtype in (None, torch.float32) else [s.to(out_dtype) for s in shards]


def all_gather_start(shards, world_size, group_name) -> list[torch.Tensor]:
    op = "all_gather_start"
    outs = gather_into_new(checked_shards(op, shards, world_size, group_name), world_size, group_name)
    counters.count_graph_op(op, "reference")
    works.register(outs)
    return outs


def reduce_scatter_start(grads, scale, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    grads = checked_grads("reduce_scatter_start", grads, out_dtype, world_size, group_name)
    shards = scatter_into_new(grads, scale, out_dtype, world_size, group_name)
    counters.count_graph_op("reduce_scatter_start", "reference")
    works.register(shards)
    return shards


for _name, _fn in (
    ("all_gather_into_params_", all_gather_into_params_),
    ("reduce_scatter_params_", reduce_scatter_params_),
    ("all_gather", all_gather),
    ("reduce_scatter", reduce_scatter),
    ("all_gather_start", all_gather_start),
    ("reduce_scatter_start", reduce_scatter_start),
):
    torch.library.impl(f"tide::{_name}", "CPU", _fn)
