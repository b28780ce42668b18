"""Argument checks shared by the fake and the real kernels of every ``tide`` op.

Every message starts with ``tide.<op>:`` and names the offending argument. A bad call fails before
any collective is issued, and on every rank alike even when only one rank's input is bad: the reference
backend runs these checks first, carries each rank's outcome in the call's fingerprint and raises on
every rank when any rank failed (``tide/ops/calls.py``), so no rank is left waiting for a call its peer
refused. (The CUDA transport has no per-call exchange: there a rank's bad input raises on that rank.)
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tide.meta.layout import rows_and_row_numel, shard_rows

# bf16/fp16 are the wire dtypes FSDP2 mixed precision produces; fp32 is the reduce and master dtype.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The all-gather also moves bytes: a uint8 shard into a uint8 output, copied. Any other payload (float8,
# integers, FSDP2 tensor extensions' all-gather inputs) travels as a uint8 view of itself.
GATHER_DTYPES = (*FLOAT_DTYPES, torch.uint8)


def _fail(op: str, msg: str, exc: type[Exception] = ValueError) -> None:
    raise exc(f"tide.{op}: {msg}")


def check_world_size(op: str, world_size: int) -> None:
    if world_size < 1:
        _fail(op, f"world_size must be >= 1, got {world_size}")


def check_tensor_list(op: str, name: str, tensors: Sequence[torch.Tensor], dtypes=FLOAT_DTYPES) -> None:
    for i, t in enumerate(tensors):
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            hint = "; view other payloads as uint8" if torch.uint8 in dtypes else ""
            _fail(op, f"{name}[{i}] has dtype {t.dtype}; expected one of {allowed}{hint}", TypeError)
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
    check_tensor_list(op, "shards", shards, GATHER_DTYPES)
    check_tensor_list(op, "outs", outs, GATHER_DTYPES)
    check_same_device(op, (("shards", shards), ("outs", outs)))
    for i, (s, o) in enumerate(zip(shards, outs)):
        if (s.dtype == torch.uint8) != (o.dtype == torch.uint8):
            _fail(op, f"shards[{i}] has dtype {s.dtype} and outs[{i}] has dtype {o.dtype}; bytes (uint8) are "
                      f"copied into uint8 only, and float shards cast into float outs", TypeError)
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


def check_all_gather(op, shards, world_size, dtypes=FLOAT_DTYPES) -> None:
    """The functional all-gathers' shards (``dtypes``: the graph op ``all_gather_start`` also moves bytes)."""
    check_world_size(op, world_size)
    check_nonempty(op, "shards", shards)
    check_tensor_list(op, "shards", shards, dtypes)
    check_same_device(op, (("shards", shards),))
    for i, s in enumerate(shards):
        if s.dim() == 0:
            _fail(op, f"shards[{i}] is 0-d; a padded shard has at least one dim")


def check_reduce_scatter_start(op, grads, out_dtype, world_size, name="grads") -> None:
    """Unpadded unsharded inputs of a functional reduce-scatter (``name``: the op's argument) and its out dtype."""
    check_world_size(op, world_size)
    check_nonempty(op, name, grads)
    check_tensor_list(op, name, grads)
    check_same_device(op, ((name, grads),))
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        _fail(op, f"out_dtype {out_dtype} is not a supported float dtype", TypeError)


def check_reduce_scatter(op, inputs, out_dtype, world_size) -> None:
    """``reduce_scatter``'s inputs: as ``reduce_scatter_start``'s, padded (dim 0 a multiple of W)."""
    check_reduce_scatter_start(op, inputs, out_dtype, world_size, "inputs")
    for i, x in enumerate(inputs):
        if x.dim() == 0 or x.shape[0] % world_size != 0:
            _fail(op, f"inputs[{i}] has shape {_shape(x)}; its dim 0 must be a multiple of "
                      f"world_size={world_size} (a padded unsharded tensor)")


def padded_shard_shape(grad_shape: Sequence, world_size: int) -> tuple:
    """``(c, *rest)``, c = ceil(d0 / W): this rank's padded shard of an unpadded ``(d0, *rest)`` gradient (a 0-d
    one is one row: ``(1,)``). Symbolic sizes stay symbolic (the fake kernels run it under dynamic shapes)."""
    if len(grad_shape) == 0:
        return (1,)
    return (-(-grad_shape[0] // world_size), *grad_shape[1:])


def check_no_grad(op: str, named_lists: Sequence[tuple[str, Sequence[torch.Tensor]]]) -> None:
    """The mutating ops are not differentiable: under grad mode no argument may require grad (autograd
    would refuse the write into an output that does, after the collective, and silently drop an input's
    gradient). Under ``torch.no_grad()`` such tensors are fine (an in-place write into a parameter)."""
    if not torch.is_grad_enabled():
        return
    for name, tensors in named_lists:
        for i, t in enumerate(tensors):
            if t.requires_grad:
                _fail(op, f"{name}[{i}] requires grad, and the op is not differentiable: pass a tensor that does "
                          f"not (detach it), or call under torch.no_grad(); the functional tide.all_gather / "
                          f"tide.reduce_scatter are differentiable")


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` a contiguous tensor occupies, or None when it has none."""
    n = t.numel()
    if n == 0:
        return None
    start = t.data_ptr()
    return start, start + n * t.element_size()


def check_no_overlap(op: str, outputs: Sequence[tuple[str, Sequence[torch.Tensor]]],
                     inputs: Sequence[tuple[str, Sequence[torch.Tensor]]] = (),
                     may_alias: Callable[[int, int], bool] | None = None) -> None:
    """No output overlaps another output, and no input overlaps an output (``may_alias(i, j)`` true
    allows input j exactly where it lies inside output i: the in-place cases). Compared by the byte ranges
    of the tensors (contiguous, checked before), sorted: O(n log n) in the number of tensors, no data read.
    Tensors without storage (fake, meta) are not compared."""
    if any(t.device.type == "meta" or _is_fake(t) for _, ts in (*outputs, *inputs) for t in ts):
        return
    spans = []
    for name, tensors in outputs:
        for i, t in enumerate(tensors):
            s = _span(t)
            if s is not None:
                spans.append((s[0], s[1], f"{name}[{i}]", i))
    spans.sort()
    for (a0, a1, a_name, _), (b0, b1, b_name, _) in zip(spans, spans[1:]):
        if b0 < a1:
            _fail(op, f"{b_name} overlaps {a_name} (bytes [{b0:#x}, {b1:#x}) and [{a0:#x}, {a1:#x})): every "
                      f"output needs memory of its own")
    # Outputs are disjoint now: an input overlaps the one starting last before its end, or none.
    starts = [s[0] for s in spans]
    for name, tensors in inputs:
        for j, t in enumerate(tensors):
            s = _span(t)
            if s is None:
                continue
            k = bisect.bisect_left(starts, s[1]) - 1
            if k < 0 or spans[k][1] <= s[0]:
                continue
            o0, o1, o_name, i = spans[k]
            if may_alias is not None and may_alias(i, j) and o0 <= s[0] and s[1] <= o1:
                continue
            _fail(op, f"{name}[{j}] overlaps {o_name} (bytes [{s[0]:#x}, {s[1]:#x}) and [{o0:#x}, {o1:#x})): "
                      f"an input may not lie in an output it is not allowed to alias")


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def all_gather_own_rows(shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor],
                        rank: int) -> Callable[[int, int], bool]:
    """The all-gather's in-place case: ``shards[i]`` may be exactly rank ``rank``'s rows of ``outs[i]`` in
    ``outs[i]``'s dtype (NCCL's in-place all-gather; the op's copy of the own shard is then a no-op)."""
    def allowed(i: int, j: int) -> bool:
        if i != j:
            return False
        s, o = shards[j], outs[i]
        return s.dtype == o.dtype and s.data_ptr() == o.data_ptr() + rank * s.numel() * s.element_size()
    return allowed
