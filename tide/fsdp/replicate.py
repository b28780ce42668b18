"""What stock FSDP2's ``foreach_reduce`` does after its reduce-scatter, for TIDE's reduce: HSDP's all-reduce of
the fp32 shard gradients across the replicate group, the user's all-reduce hook, the gradient divide
factors and a no-all-reduce step's partial output (``set_requires_all_reduce(False)``), with stock's
streams, ops and order, so that a replica group sums exactly what stock's would.

TIDE-RS reduces over the shard group into a flat fp32 buffer of padded shards (stock's reduce output
layout); then, as stock:

- no all-reduce this step: the buffer is added to the partial output (on the reduce-scatter stream)
  and returned as it, nothing assigned;
- else the partial output is added in, and on the all-reduce stream ``dist.all_reduce`` runs over the
  replicate group with stock's op, then the hook, then the post-divide; the caller's epilogue (casts,
  sharded gradient views, accumulation) runs on that stream.

Every rank of a replica issues its all-reduces in one order (FSDP's, group by group), so every replica
adds the same shards in the same rank order: deterministic.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_collectives

ReduceOp = dist.ReduceOp


class Across(NamedTuple):
    """``foreach_reduce``'s arguments beyond the reduce-scatter."""
    group: dist.ProcessGroup | None = None  # the replicate group (HSDP), else None
    stream: object = None  # the all-reduce stream
    all_reduce_grads: bool = True
    partial: torch.Tensor | None = None  # the partial reduce output of earlier no-all-reduce steps
    hook: Callable[[torch.Tensor], None] | None = None
    force_sum: bool = False

    @property
    def needs_buffer(self) -> bool:
        """Whether the reduce-scatter must write a buffer of its own (not accumulate into the grads)."""
        return self.group is not None or self.hook is not None


NONE = Across()


class Factors(NamedTuple):
    scale: float  # applied by TIDE-RS to its fp32 sum
    all_reduce_op: object
    post_divide: float | None

    @property
    def divides_after(self) -> bool:
        return self.post_divide is not None and self.post_divide > 1


def factors(rs_group, across: Across, divide_factor: float | None, device_type: str) -> Factors:
    """Stock's divide factors for an fp32 reduce (``_get_gradient_divide_factors``, looked up at call time as
    stock looks it up), as TIDE-RS applies them: a reduce-scatter AVG is a scale of 1 / shard-group size,
    PREMUL_SUM(1 / f) one of 1 / f, SUM none; the post-divide stays a divide after the reduce, as stock's."""
    pre, post, rs_op, ar_op = _fsdp_collectives._get_gradient_divide_factors(
        rs_group, across.group, torch.float32, device_type, divide_factor, across.force_sum)
    if pre is not None:  # only for reduce dtypes that risk overflow, which keep stock
        raise AssertionError("tide.fsdp: a pre-divide factor for an fp32 reduce")
    if rs_op == ReduceOp.SUM:
        scale = 1.0
    elif rs_op == ReduceOp.AVG:
        scale = 1.0 / rs_group.size()
    else:  # PREMUL_SUM(1 / f), only with a divide factor f
        scale = 1.0 / divide_factor
    return Factors(scale, ar_op, post)


class AfterReduceScatter(NamedTuple):
    stream: object  # where the epilogue runs
    all_reduce_input: torch.Tensor | None
    all_reduce_event: object
    partial: torch.Tensor | None  # set: a no-all-reduce step, nothing more to do


def finish(flat: torch.Tensor, across: Across, f: Factors, rs_stream, handle) -> AfterReduceScatter:
    """The steps after the reduce-scatter into ``flat`` (issued on ``rs_stream``), as stock takes them."""
    stream, ar_input, ar_event = rs_stream, None, None
    if across.group is not None:
        with handle.stream(rs_stream):  # accumulations run in the reduce-scatter stream
            if not across.all_reduce_grads:
                partial = flat if across.partial is None else across.partial.add_(flat)
                return AfterReduceScatter(rs_stream, None, None, partial)
            if across.partial is not None:
                flat += across.partial
        stream = across.stream
        stream.wait_stream(rs_stream)
        with handle.stream(stream):
            dist.all_reduce(flat, group=across.group, op=f.all_reduce_op)
            ar_input, ar_event = flat, stream.record_event()
    if across.hook is not None:
        stream = across.stream
        stream.wait_stream(rs_stream)
        with handle.stream(stream):
            across.hook(flat)
            ar_input, ar_event = flat, stream.record_event()  # held as the all-reduce's buffer is
    if f.divides_after:
        with handle.stream(stream):
            flat.div_(f.post_divide)
    return AfterReduceScatter(stream, ar_input, ar_event, None)
