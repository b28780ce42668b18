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

from tide.ops import calls


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
    if not isinstance(tensors, list):
        raise TypeError(f"tide.{op}: {arg} must be a list of tensors, got {type(tensors).__name__}")
    return tensors


def _as_list(tensors):
    """A sequence of tensors as a list (read once: it may be a generator); anything else as it is."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    try:
        return list(tensors)
    except TypeError:
        return tensors


def _arguments(op: str, group, **named) -> tuple[dist.ProcessGroup, list[list[torch.Tensor]]]:
    """The group and the tensor lists of a typed call. A bad argument is refused on every rank, as the op's own
    checks are (:mod:`tide.ops.calls`): through the group's call exchange, or, with no group to agree
    through, a notice in the default group's store."""
    named = {arg: _as_list(ts) for arg, ts in named.items()}
    tensors = [t for ts in named.values() for t in (ts if isinstance(ts, list) else [ts])
               if isinstance(t, torch.Tensor)]
    try:
        group = _group(op, group)
    except (TypeError, ValueError) as e:
        calls.refuse_without_group(op, f"with group={group!r}, which is no process group", tensors, e)
    try:
        return group, [_tensor_list(op, arg, ts) for arg, ts in named.items()]
    except TypeError as e:
        calls.refuse(op, group.group_name, group.size(), [tensors], e)


def all_gather_into_params(shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                           group: dist.ProcessGroup | None = None) -> None:
    """Every rank's ``shards[i]`` into its rows of ``outs[i]``, cast to ``outs[i]``'s dtype on the way.
    On CUDA with outputs bound in an arena slot this is TIDE-AG (copy engines); else the reference."""
    group, (shards, outs) = _arguments("all_gather_into_params", group, shards=shards, outs=outs)
    torch.ops.tide.all_gather_into_params_(shards, outs, group.size(), group.group_name)


def reduce_scatter_params(grads: Sequence[torch.Tensor], shard_grads: Sequence[torch.Tensor],
                          group: dist.ProcessGroup | None = None, *, scale: float = 1.0,
                          accumulate: bool = False) -> None:
    """This rank's rows of ``scale * sum over ranks of grads[i]``, summed in fp32 in rank order (across
    nodes: node partials first, see the schemas), written (or added, ``accumulate``) into the fp32
    ``shard_grads[i]``; padding rows are zero."""
    group, (grads, shard_grads) = _arguments("reduce_scatter_params", group, grads=grads, shard_grads=shard_grads)
    torch.ops.tide.reduce_scatter_params_(grads, shard_grads, float(scale), bool(accumulate), group.size(),
                                          group.group_name)


def all_gather(shards: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """The gathered tensors ``(W*c_i, *rest)`` of ``shards``; differentiable (its backward reduce-scatters)."""
    group, (shards,) = _arguments("all_gather", group, shards=shards)
    return torch.ops.tide.all_gather(shards, group.size(), group.group_name)


def reduce_scatter(inputs: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None, *, scale: float = 1.0,
                   out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """This rank's shards ``(c_i, *rest)`` of ``scale * sum over ranks of inputs[i]`` (fp32 sum), in
    ``out_dtype`` (default: each input's); differentiable (its backward all-gathers)."""
    group, (inputs,) = _arguments("reduce_scatter", group, inputs=inputs)
    return torch.ops.tide.reduce_scatter(inputs, float(scale), out_dtype, group.size(), group.group_name)
