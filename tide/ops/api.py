"""Typed, documented Python entry points of the ``tide`` ops: the same kernels as ``torch.ops.tide.*``,
called with a process group instead of its name and size. ``group=None`` means the default process
group, as in ``torch.distributed``'s own collectives.

Shapes (W = the group's size, c_i = ceil(d0_i / W)): a padded shard is ``(c_i, *rest)``, its gathered
output ``(W*c_i, *rest)`` or that flattened; an unsharded gradient ``(d0_i, *rest)``, its reduced shard
the fp32 ``(c_i, *rest)``. Schemas: :mod:`tide.ops.schemas`.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def _group(op: str, group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """``group``, or the default process group for None."""
    if group is not None:
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"tide.{op}: group must be a torch.distributed.ProcessGroup or None, got "
                            f"{type(group).__name__}")
        return group
    try:
        return dist.distributed_c10d._get_default_group()
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"tide.{op}: group=None means the default process group, but torch.distributed has none "
                         f"(call torch.distributed.init_process_group first)") from e


def _tensor_list(op: str, arg: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as a list; a single Tensor is refused (``list()`` of it would make each row a tensor)."""
    if isinstance(tensors, torch.Tensor):
        raise TypeError(f"tide.{op}: {arg} must be a list of tensors, got one Tensor of shape "
                        f"{tuple(tensors.shape)} (pass [{arg}] for a single tensor)")
    return list(tensors)


def all_gather_into_params(shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                           group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``shards[i]`` into its rows of ``outs[i]``, cast to ``outs[i]``'s dtype on the way.
    On CUDA with outputs bound in an arena slot this is TIDE-AG (copy engines); else the reference."""
    op = "all_gather_into_params"
    shards, outs = _tensor_list(op, "shards", shards), _tensor_list(op, "outs", outs)
    group = _group(op, group)
    torch.ops.tide.all_gather_into_params_(shards, outs, group.size(), group.group_name)


def reduce_scatter_params(grads: Sequence[torch.Tensor], shard_grads: Sequence[torch.Tensor],
                          group: dist.ProcessGroup | None = None, *, scale: float = 1.0,
                          accumulate: bool = False) -> None:
    """This rank's rows of ``scale * sum over ranks of grads[i]``, summed in fp32 in rank order (across
    nodes: node partials first, see the schemas), written (or added, ``accumulate``) into the fp32
    ``shard_grads[i]``; padding rows are zero."""
    op = "reduce_scatter_params"
    grads, shard_grads = _tensor_list(op, "grads", grads), _tensor_list(op, "shard_grads", shard_grads)
    group = _group(op, group)
    torch.ops.tide.reduce_scatter_params_(grads, shard_grads, float(scale), bool(accumulate), group.size(),
                                          group.group_name)


def all_gather(shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """The gathered tensors ``(W*c_i, *rest)`` of ``shards``; differentiable (its backward reduce-scatters)."""
    shards = _tensor_list("all_gather", "shards", shards)
    group = _group("all_gather", group)
    return torch.ops.tide.all_gather(shards, group.size(), group.group_name)


def reduce_scatter(inputs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, *, scale: float = 1.0,
                   out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """This rank's shards ``(c_i, *rest)`` of ``scale * sum over ranks of inputs[i]`` (fp32 sum), in
    ``out_dtype`` (default: each input's); differentiable (its backward all-gathers)."""
    inputs = _tensor_list("reduce_scatter", "inputs", inputs)
    group = _group("reduce_scatter", group)
    return torch.ops.tide.reduce_scatter(inputs, float(scale), out_dtype, group.size(), group.group_name)
