"""Autograd of the functional pair: all-gather and reduce-scatter are each other's backward.

y = all_gather(x)          ->  dx = reduce_scatter(dy)            (sum over ranks, fp32, in x's dtype)
y = scale * rs_sum(x)      ->  dx = scale * all_gather(dy), in x's dtype
"""
import torch


def _setup_all_gather(ctx, inputs, output):
    shards, ctx.world_size, ctx.group_name = inputs
    ctx.dtypes = [s.dtype for s in shards]


def _all_gather_backward(ctx, grads):
    grads = [g.contiguous() for g in grads]
    outs = torch.ops.tide.reduce_scatter(grads, 1.0, None, ctx.world_size, ctx.group_name)
    return [o.to(d) for o, d in zip(outs, ctx.dtypes)], None, None


def _setup_reduce_scatter(ctx, inputs, output):
    xs, ctx.scale, _, ctx.world_size, ctx.group_name = inputs
    ctx.dtypes = [x.dtype for x in xs]


def _reduce_scatter_backward(ctx, grads):
    grads = [g.contiguous() for g in grads]
    gathered = torch.ops.tide.all_gather(grads, ctx.world_size, ctx.group_name)
    return [(g * ctx.scale).to(d) for g, d in zip(gathered, ctx.dtypes)], None, None, None, None


torch.library.register_autograd("tide::all_gather", _all_gather_backward, setup_context=_setup_all_gather)
torch.library.register_autograd("tide::reduce_scatter", _reduce_scatter_backward, setup_context=_setup_reduce_scatter)
