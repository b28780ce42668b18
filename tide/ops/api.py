"""Typed, documented Python entry points of the ``tide`` ops: the same kernels as ``torch.ops.tide.*``,
called with a process group instead of its name and size.

Shapes (W = the group's size, c_i = ceil(d0_i / W)): a padded shard is ``(c_i, *rest)``, its gathered
output ``(W*c_i, *rest)`` or that flattened; an unsharded gradient ``(d0_i, *rest)``, its reduced shard
the fp32 ``(c_i, *rest)``. Schemas: :mod:`tide.ops.schemas`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def all_gather_into_params(shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                           group: dist.ProcessGroup) -> None:
    """Every rank's ``shards[i]`` into its rows of ``outs[i]``, cast to ``outs[i]``'s dtype on the way.
    On CUDA with outputs bound in an arena slot this is TIDE-AG (copy engines); else the reference."""
    torch.ops.tide.all_gather_into_params_(list(shards), list(outs), group.size(), group.group_name)


def reduce_scatter_params(grads: Sequence[torch.Tensor], shard_grads: Sequence[torch.Tensor], group: dist.ProcessGroup,
                          *, scale: float = 1.0, accumulate: bool = False) -> None:
    """This rank's rows of ``scale * sum over ranks of grads[i]``, summed in fp32 in rank order (across
    nodes: node partials first, see the schemas), written (or added, ``accumulate``) into the fp32
    ``shard_grads[i]``; padding rows are zero."""
    torch.ops.tide.reduce_scatter_params_(list(grads), list(shard_grads), float(scale), bool(accumulate),
                                          group.size(), group.group_name)


def all_gather(shards: Sequence[torch.Tensor], group: dist.ProcessGroup) -> list[torch.Tensor]:
    """The gathered tensors ``(W*c_i, *rest)`` of ``shards``; differentiable (its backward reduce-scatters)."""
    return torch.ops.tide.all_gather(list(shards), group.size(), group.group_name)


def reduce_scatter(inputs: Sequence[torch.Tensor], group: dist.ProcessGroup, *, scale: float = 1.0,
                   out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """This rank's shards ``(c_i, *rest)`` of ``scale * sum over ranks of inputs[i]`` (fp32 sum), in
    ``out_dtype`` (default: each input's); differentiable (its backward all-gathers)."""
    return torch.ops.tide.reduce_scatter(list(inputs), float(scale), out_dtype, group.size(), group.group_name)
