"""Argument checks shared by the fake and the real kernels of every ``tide`` op.

Every message starts with ``tide.<op>:`` and names the offending argument, so a bad call fails
at once, on every rank alike, before any collective is issued (a rank that raised after its peers
entered a collective would leave them hanging).
"""
from __future__ import annotations

from typing import Sequence

import torch

from tide.meta.layout import rows_and_row_numel, shard_rows

# bf16/fp16 are the wire dtypes FSDP2 mixed precision produces; fp32 is the reduce and master dtype.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(op: str, msg: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"tide.{op}: {msg}")


def check_world_size(op: str, world_size: int) -> None:
    if world_size < 1:
        _fail(op, f"world_size must be >= 1, got {world_size}")


def check_tensor_list(op: str, name: str, tensors: Sequence[torch.Tensor], dtypes=FLOAT_DTYPES) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            _fail(op, f"{name}[{i}] has dtype {t.dtype}; expected one of {allowed}", TypeError)
        if not t.is_contiguous():
            _fail(op, f"{name}[{i}] must be contiguous (shape {tuple(t.shape)}, stride {t.stride()})")


def check_nonempty(op: str, name: str, tensors: Sequence[torch.Tensor]) -> None:
    if len(tensors) == 0:
        _fail(op, f"{name} is empty; pass at least one tensor")


def check_same_length(op: str, a_name: str, a: Sequence, b_name: str, b: Sequence) -> None:
    if len(a) != len(b):
        _fail(op, f"{a_name} has {len(a)} tensors but {b_name} has {len(b)}")


def check_same_device(op: str, named_lists: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> None:
    device = None
    for name, tensors in named_lists:
        for i, t in enumerate(tensors):
            if device is None:
                device, first = t.device, f"{name}[{i}]"
            elif t.device != device:
                _fail(op, f"{name}[{i}] is on {t.device} but {first} is on {device}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def check_all_gather_into_params(op, shards, outs, world_size) -> None:
    check_world_size(op, world_size)
    check_nonempty(op, "shards", shards)
    check_same_length(op, "shards", shards, "outs", outs)
    check_tensor_list(op, "shards", shards)
    check_tensor_list(op, "outs", outs)
    check_same_device(op, (("shards", shards), ("outs", outs)))
    for i, (s, o) in enumerate(zip(shards, outs)):
        if s.dim() == 0:
            _fail(op, f"shards[{i}] is 0-d; a padded shard has at least one dim")
        full = (world_size * s.shape[0], *s.shape[1:])
        flat = (world_size * s.numel(),)
        if _shape(o) != full and _shape(o) != flat:
            _fail(op, f"outs[{i}] has shape {_shape(o)}; shards[{i}] of shape {_shape(s)} on "
                      f"world_size={world_size} needs {full} or {flat}")


def check_reduce_scatter_params(op, grads, shard_grads, world_size) -> None:
    check_world_size(op, world_size)
    check_nonempty(op, "grads", grads)
    check_same_length(op, "grads", grads, "shard_grads", shard_grads)
    check_tensor_list(op, "grads", grads)
    check_tensor_list(op, "shard_grads", shard_grads, (torch.float32,))
    check_same_device(op, (("grads", grads), ("shard_grads", shard_grads)))
    for i, (g, s) in enumerate(zip(grads, shard_grads)):
        d0, _ = rows_and_row_numel(_shape(g))
        rest = tuple(g.shape[1:])
        want = (shard_rows(d0, world_size), *rest)
        if _shape(s) != want:
            _fail(op, f"shard_grads[{i}] has shape {_shape(s)}; grads[{i}] of shape {_shape(g)} on "
                      f"world_size={world_size} needs {want}")


def check_all_gather(op, shards, world_size) -> None:
    check_world_size(op, world_size)
    check_nonempty(op, "shards", shards)
    check_tensor_list(op, "shards", shards)
    check_same_device(op, (("shards", shards),))
    for i, s in enumerate(shards):
        if s.dim() == 0:
            _fail(op, f"shards[{i}] is 0-d; a padded shard has at least one dim")


def check_reduce_scatter(op, inputs, out_dtype, world_size) -> None:
    check_world_size(op, world_size)
    check_nonempty(op, "inputs", inputs)
    check_tensor_list(op, "inputs", inputs)
    check_same_device(op, (("inputs", inputs),))
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        _fail(op, f"out_dtype {out_dtype} is not a supported float dtype", TypeError)
    for i, x in enumerate(inputs):
        if x.dim() == 0 or x.shape[0] % world_size != 0:
            _fail(op, f"inputs[{i}] has shape {_shape(x)}; its dim 0 must be a multiple of "
                      f"world_size={world_size} (a padded unsharded tensor)")
