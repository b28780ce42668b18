"""Where TIDE's reduce writes and how its output becomes FSDP2's sharded gradients: straight into the existing
fp32 gradients (accumulating), or stock's flat layout of padded shards and stock's epilogue (casts per run of
neighbouring dtypes, unpadded views, the post-accumulate-grad hooks).
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed

from tide.fsdp import shard_dims


def accumulates_in_place(fsdp_params, grads, grad_dtypes, world_size: int) -> list[torch.Tensor] | None:
    """The existing sharded grads' local tensors when the op can add straight into them, else None.

    Decided identically on every rank (all ranks must issue the same collectives): every param already
    has an fp32 DTensor grad, is reduced into fp32 and shards evenly, so no rank's local grad is shorter
    than its padded shard.
    """
    if any(d not in (None, torch.float32) for d in grad_dtypes):
        return None
    locals_ = []
    for p, g in zip(fsdp_params, grads):
        existing = p.sharded_param.grad
        if existing is None or not shard_dims.evenly_sharded(p, g, world_size):
            return None
        local = existing._local_tensor
        if local.dtype != torch.float32 or not local.is_contiguous():
            return None
        locals_.append(local)
    return locals_


def cast_runs(flat: torch.Tensor, fsdp_params, offsets, grad_dtypes) -> list[torch.Tensor]:
    """Each param's unpadded reduced shard in its gradient dtype: one cast per run of neighbouring
    params with the same dtype (as stock casts its reduce output), views of ``flat`` where no cast is
    needed."""
    out, i, n = [], 0, len(fsdp_params)
    while i < n:
        dtype, j = grad_dtypes[i], i
        while j < n and grad_dtypes[j] == dtype:
            j += 1
        end = offsets[j] if j < n else flat.numel()
        run = flat.narrow(0, offsets[i], end - offsets[i])
        cast = _to_dtype_if_needed(run, dtype)
        for p, o in zip(fsdp_params[i:j], offsets[i:j]):
            out.append(torch.as_strided(cast, size=p.sharded_size, stride=p.contiguous_sharded_stride,
                                        storage_offset=cast.storage_offset() + o - offsets[i]))
        i = j
    return out


def post_accumulate_hooks(fsdp_params) -> None:
    """The params' post-accumulate-grad hooks, once their sharded gradients are in place (as stock runs them)."""
    for p in fsdp_params:
        for hook in (getattr(p.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
            hook(p.sharded_param)
