"""Reference backend of the ``tide`` ops over ``torch.distributed`` (gloo on CPU, gloo or NCCL on CUDA).

Layout-aware like the CUDA transport, only slower: the all-gather writes straight into each parameter's
output (the own shard is cast into its final rows, then gathered in place), and the reduce-scatter
exchanges each gradient's destination rows with ``all_to_all_single`` straight from autograd's tensor,
then sums the W contributions in fp32 in rank order. No flat rank-major buffer and no full-group fp32
buffer is built; the only staging is one bf16 receive buffer per parameter (this rank's rows from all
W ranks) while its exchange is in flight.

Its results define the ops' semantics: the CUDA transport must match them bit for bit. A group whose
ranks span several nodes (``tide.topology``) runs the multi-node schedule instead
(``tide/ops/reference_multinode.py``), whose fp32 order sums node partials: see the schemas.

On CPU every call first exchanges a fingerprint of itself (the op, the tensors' shapes and dtypes, and the
group's call count) in one small all-gather: ranks that issue different calls (a skipped collective,
another op, another layout) get an error that names the disagreement instead of mismatched data. (On
CUDA that check would stall the host on the GPU every call; the CUDA path has none.)
"""
from __future__ import annotations

import zlib
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tide import topology
from tide.meta import checks
from tide.meta.layout import rank_row_range, rows_and_row_numel
from tide.ops import reference_multinode, sums
from tide.transport.agreement import call_desc

# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def resolve_group(op: str, group_name: str, world_size: int) -> dist.ProcessGroup:
    """The process group registered as ``group_name``, checked against ``world_size``."""
    try:
        group = _resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"tide.{op}: group_name {group_name!r} does not name a registered process group") from e
    if group.size() != world_size:
        raise ValueError(f"tide.{op}: world_size={world_size} but group {group_name!r} has {group.size()} ranks")
    return group


_calls: Counter = Counter()  # process-group name -> reference calls issued on it


def check_same_call(op: str, group: dist.ProcessGroup, tensor_lists, flags=()) -> None:
    """Every rank of ``group`` (CPU: gloo) is issuing this call: the same op on the same shapes and dtypes
    with the same flags, as the group's same numbered call. Raises ``RuntimeError`` on every rank
    otherwise, naming what differs."""
    if tensor_lists[0][0].device.type != "cpu":
        return
    _calls[group.group_name] += 1
    seq = _calls[group.group_name]
    desc = call_desc(op, tensor_lists, flags)
    mine = torch.tensor([zlib.crc32(desc.encode()), seq], dtype=torch.int64)
    every = torch.empty(group.size() * 2, dtype=torch.int64)
    _all_gather_single(every, mine, group=group)
    prints, seqs = every[0::2].tolist(), every[1::2].tolist()
    if len(set(seqs)) > 1:
        raise RuntimeError(f"tide.{op}: ranks of group {group.group_name!r} are at different calls (calls issued "
                           f"per rank: {seqs}): a rank skipped or added a collective")
    if len(set(prints)) > 1:
        raise RuntimeError(f"tide.{op}: ranks of group {group.group_name!r} issued different calls at call {seq} "
                           f"(another op, layout or dtype; fingerprints per rank: {prints}); this rank's: {desc}")


def all_gather_into_params_(shards, outs, world_size, group_name) -> None:
    op = "all_gather_into_params_"
    checks.check_all_gather_into_params(op, shards, outs, world_size)
    group = resolve_group(op, group_name, world_size)
    topo = topology.of_group(group)
    check_same_call(op, group, (shards, outs), (topo,))
    if topology.is_multinode(topo):
        reference_multinode.all_gather(shards, outs, group, topo)
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
    for w in works:
        w.wait()


def reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group_name) -> None:
    op = "reduce_scatter_params_"
    checks.check_reduce_scatter_params(op, grads, shard_grads, world_size)
    group = resolve_group(op, group_name, world_size)
    topo = topology.of_group(group)
    check_same_call(op, group, (grads, shard_grads), (accumulate, topo))
    if topology.is_multinode(topo):
        reference_multinode.reduce_scatter(grads, shard_grads, scale, accumulate, group, topo)
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
    for work, recv, shard in pending:
        if work is not None:
            work.wait()
        flat, n = shard.view(-1), recv.shape[1]
        sums.sum_rows_([flat[:n]], recv, scale=scale, accumulate=accumulate)  # the W contributions in rank order
        if not accumulate:
            flat[n:].zero_()  # padding rows


def all_gather(shards, world_size, group_name) -> list[torch.Tensor]:
    checks.check_all_gather("all_gather", shards, world_size)
    outs = [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards]
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group_name)
    return outs


def reduce_scatter(inputs, scale, out_dtype, world_size, group_name) -> list[torch.Tensor]:
    checks.check_reduce_scatter("reduce_scatter", inputs, out_dtype, world_size)
    shards = [x.new_empty((x.shape[0] // world_size, *x.shape[1:]), dtype=torch.float32) for x in inputs]
    torch.ops.tide.reduce_scatter_params_(inputs, shards, scale, False, world_size, group_name)
    return [s if (out_dtype or x.dtype) == torch.float32 else s.to(out_dtype or x.dtype)
            for s, x in zip(shards, inputs)]


for _name, _fn in (
    ("all_gather_into_params_", all_gather_into_params_),
    ("reduce_scatter_params_", reduce_scatter_params_),
    ("all_gather", all_gather),
    ("reduce_scatter", reduce_scatter),
):
    torch.library.impl(f"tide::{_name}", "CPU", _fn)
