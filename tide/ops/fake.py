"""Fake (meta) kernels of the ``tide`` ops, one per op: shapes and checks only, no data, no collective
(FakeTensor tracing and ``torch.compile`` run these).

The same kernels serve calls on real meta tensors, which hold no data, so no rank could issue such a call:
it is refused, on every rank of a group with CPU collectives (through the call's exchange,
``tide/ops/calls.py``), instead of returning here while its peers wait.
"""
import torch
from torch._subclasses.fake_tensor import is_fake

from tide.meta import checks
from tide.ops import calls


def _checked(op, check, group_name, world_size, named_lists) -> None:
    """``check()``; for a call on real meta tensors, the refusal of the call on every rank."""
    meta = next(((name, i) for name, ts in named_lists for i, t in enumerate(ts)
                 if t.device.type == "meta" and not is_fake(t)), None)
    if meta is None:
        check()
        return
    try:
        check()
        name, i = meta
        raise ValueError(f"tide.{op}: {name}[{i}] is a meta tensor, which holds no data: a TIDE op moves data "
                         f"between ranks (trace with FakeTensorMode instead)")
    except (ValueError, TypeError) as e:
        calls.refuse(op, group_name, world_size, [ts for _, ts in named_lists], e)


@torch.library.register_fake("tide::all_gather_into_params_")
def all_gather_into_params_fake(shards, outs, world_size, group_name):
    op = "all_gather_into_params_"
    named = (("shards", shards), ("outs", outs))
    _checked(op, lambda: checks.check_all_gather_into_params(op, shards, outs, world_size), group_name, world_size,
             named)
    checks.check_no_grad(op, named)


@torch.library.register_fake("tide::reduce_scatter_params_")
def reduce_scatter_params_fake(grads, shard_grads, scale, accumulate, world_size, group_name):
    op = "reduce_scatter_params_"
    named = (("grads", grads), ("shard_grads", shard_grads))
    _checked(op, lambda: checks.check_reduce_scatter_params(op, grads, shard_grads, world_size), group_name,
             world_size, named)
    checks.check_no_grad(op, named)


@torch.library.register_fake("tide::all_gather")
def all_gather_fake(shards, world_size, group_name):
    _checked("all_gather", lambda: checks.check_all_gather("all_gather", shards, world_size), group_name, world_size,
             (("shards", shards),))
    return [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards]


@torch.library.register_fake("tide::reduce_scatter")
def reduce_scatter_fake(inputs, scale, out_dtype, world_size, group_name):
    _checked("reduce_scatter", lambda: checks.check_reduce_scatter("reduce_scatter", inputs, out_dtype, world_size),
             group_name, world_size, (("inputs", inputs),))
    return [
        x.new_empty((x.shape[0] // world_size, *x.shape[1:]), dtype=out_dtype or x.dtype) for x in inputs
    ]


@torch.library.register_fake("tide::all_gather_start")
def all_gather_start_fake(shards, world_size, group_name):
    op = "all_gather_start"
    _checked(op, lambda: checks.check_all_gather(op, shards, world_size, checks.GATHER_DTYPES), group_name, world_size,
             (("shards", shards),))
    return [s.new_empty((world_size * s.shape[0], *s.shape[1:])) for s in shards]


@torch.library.register_fake("tide::reduce_scatter_start")
def reduce_scatter_start_fake(grads, scale, out_dtype, world_size, group_name):
    op = "reduce_scatter_start"
    _checked(op, lambda: checks.check_reduce_scatter_start(op, grads, out_dtype, world_size), group_name,
             world_size, (("grads", grads),))
    return [g.new_empty(checks.padded_shard_shape(g.shape, world_size), dtype=out_dtype or torch.float32)
            for g in grads]
