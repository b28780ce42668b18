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


def _blocks(fsdp_param, world_size: int) -> tuple[int, int, int]:
    """(outer, rows, inner) of the param's blocks: rows = a_i of the unsharded param."""
    dim = fsdp_param.fsdp_placement.dim
    size = fsdp_param._orig_size
    return math.prod(size[:dim]), size[dim], math.prod(size[dim + 1:])


def sharded(fsdp_params) -> bool:
    """Whether any param is sharded on a dim other than 0."""
    return any(p.fsdp_placement.dim != 0 for p in fsdp_params)


def all_gather_args(fsdp_params, shards, outs, world_size: int) -> tuple[list, list]:
    """The ops' (shards, outs) for the params' 1-D sharded data and 1-D outputs: block views."""
    if not sharded(fsdp_params):
        return shards, outs
    block_shards, block_outs = [], []
    for p, shard, out in zip(fsdp_params, shards, outs):
        if p.fsdp_placement.dim == 0:
            block_shards.append(shard)
            block_outs.append(out)
            continue
        outer, rows, inner = _blocks(p, world_size)
        block_shards += list(shard.view(outer, rows // world_size * inner).unbind(0))
        block_outs += list(out.view(outer, rows * inner).unbind(0))
    return block_shards, block_outs


def reduce_scatter_args(fsdp_params, grads, shard_grads, world_size: int) -> tuple[list, list]:
    """The ops' (grads, shard_grads) for the params' unsharded gradients and padded shard gradients."""
    if not sharded(fsdp_params):
        return grads, shard_grads
    block_grads, block_shards = [], []
    for p, grad, shard in zip(fsdp_params, grads, shard_grads):
        if p.fsdp_placement.dim == 0:
            block_grads.append(grad)
            block_shards.append(shard)
            continue
        outer, rows, inner = _blocks(p, world_size)
        block_grads += list(grad.view(outer, rows, inner).unbind(0))
        block_shards += list(shard.view(outer, rows // world_size, inner).unbind(0))
    return block_grads, block_shards


def evenly_sharded(fsdp_param, grad: torch.Tensor, world_size: int) -> bool:
    """Whether ``grad`` splits evenly on the param's shard dim (a 0-d gradient never does)."""
    dim = fsdp_param.fsdp_placement.dim
    return grad.dim() > dim and grad.shape[dim] % world_size == 0
