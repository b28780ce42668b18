"""``Shard(i)`` parameters (``shard_placement_fn``, i > 0) as the ops' dim-0 layout, with no copy.

A contiguous tensor of shape (a_0, ..., a_n) sharded on dim i is ``outer = a_0 * ... * a_{i-1}`` blocks of
shape (a_i, inner), ``inner = a_{i+1} * ... * a_n``, back to back, and each block is sharded on its dim 0:

    unsharded element (o, r * c + k, j)  =  block o, row r * c + k, column j     (c = a_i / W)
    rank r's shard: its blocks' rows [r * c, (r + 1) * c), o-major = FSDP2's padded sharded param

So a ``Shard(i)`` param enters the ops as ``outer`` block params: for the all-gather, views of its 1-D
sharded data and of its output, which FSDP2 reads as the unsharded param (stock writes it there with a
chunk-cat from a dim-0 copy); for the reduce-scatter, views of the unsharded gradient and of the shard
gradient. TIDE-AG writes every rank's dim-i shard straight into its strided place, and TIDE-RS reads each
destination's dim-i slice where autograd left it. FSDP2 shards dim i > 0 evenly only, so there is no
padding. A dim-0 param is one block; a group mixing both is one call.
"""
from __future__ import annotations

import math

import torch


def _blocks(fsdp_param) -> tuple[int, int, int]:
    """(outer, rows, inner) of the param's blocks: rows = a_i of the unsharded param."""
    dim = fsdp_param.fsdp_placement.dim
    size = fsdp_param._orig_size
    return math.prod(size[:dim]), size[dim], math.prod(size[dim + 1:])


def sharded(fsdp_params) -> bool:
    """Whether any param is sharded on a dim other than 0."""
    return any(p.fsdp_placement.dim != 0 for p in fsdp_params)


def _as_blocks(fsdp_params, firsts, seconds, world_size: int, shapes) -> tuple[list, list]:
    """Each dim-i param's pair of tensors as its blocks' views; ``shapes(outer, rows, rows / W, inner)`` gives
    the two views' shapes, block first. Dim-0 params pass as they are."""
    if not sharded(fsdp_params):
        return firsts, seconds
    out_firsts, out_seconds = [], []
    for p, first, second in zip(fsdp_params, firsts, seconds):
        if p.fsdp_placement.dim == 0:
            out_firsts.append(first)
            out_seconds.append(second)
            continue
        outer, rows, inner = _blocks(p)
        first_shape, second_shape = shapes(outer, rows, rows // world_size, inner)
        out_firsts += list(first.view(first_shape).unbind(0))
        out_seconds += list(second.view(second_shape).unbind(0))
    return out_firsts, out_seconds


def all_gather_args(fsdp_params, shards, outs, world_size: int) -> tuple[list, list]:
    """The ops' (shards, outs) for the params' 1-D sharded data and 1-D outputs: block views."""
    return _as_blocks(fsdp_params, shards, outs, world_size,
                      lambda outer, rows, c, inner: ((outer, c * inner), (outer, rows * inner)))


def reduce_scatter_args(fsdp_params, grads, shard_grads, world_size: int) -> tuple[list, list]:
    """The ops' (grads, shard_grads) for the params' unsharded gradients and padded shard gradients."""
    return _as_blocks(fsdp_params, grads, shard_grads, world_size,
                      lambda outer, rows, c, inner: ((outer, rows, inner), (outer, c, inner)))


def evenly_sharded(fsdp_param, grad: torch.Tensor, world_size: int) -> bool:
    """Whether ``grad`` splits evenly on the param's shard dim (a 0-d gradient never does)."""
    dim = fsdp_param.fsdp_placement.dim
    return grad.dim() > dim and grad.shape[dim] % world_size == 0
