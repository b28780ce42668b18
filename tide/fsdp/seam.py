"""The FSDP2 seam: dispatching replacements of FSDP2's three ``foreach_*`` collectives.

``install()`` rebinds ``foreach_all_gather``, ``foreach_all_gather_copy_out`` and ``foreach_reduce`` in
``torch.distributed.fsdp._fully_shard._fsdp_param_group``'s namespace, where ``FSDPParamGroup`` looks them
up at call time (whatever was bound there before is kept and called for the stock path, so other
patchers chain). A param group is opted in by carrying TIDE's marker comm objects; every call decides
on its own: the TIDE path when the group is opted in and the case is supported, else the original
function, counted in :func:`stats` under ``"stock:<reason>"`` and logged once per reason.

Everything else FSDP2 owns (streams, events, prefetch, reshard, keep-alives, state) stays stock.

Three functions here are the transport's hooks (module globals looked up at call time, so a transport
may rebind them): :func:`bind_all_gather_outputs` (where each param's all-gather output lives),
:func:`all_gather_into_outputs` and :func:`reduce_scatter_into_shards` (the collective calls; the
latter gets the group's ``rs_mode``).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult
from torch.distributed.fsdp._fully_shard._fsdp_common import _to_dtype_if_needed
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from tide.fsdp import compat
from tide.meta.checks import FLOAT_DTYPES

log = logging.getLogger("tide.fsdp")

RS_MODES = ("in_place", "slot_reuse")
TIDE = "tide"

# Every reason a call takes the stock path; docs/fsdp.md has the table.
REASONS = (
    "not_enabled", "unknown_args", "cuda_graph_capture", "compiling", "functorch", "async_op",
    "world_size_1", "post_forward_mesh", "shard_dim", "cpu_offload", "all_gather_extension",
    "dtensor_param", "mixed_param_dtypes", "mixed_grad_dtypes", "unsupported_dtype", "reduce_dtype",
    "hsdp", "all_reduce_hook", "noncontiguous_grad",
)


# ---------------------------------------------------------------------------------------------- markers
class TideAllGather(AllGather):
    """Opt-in marker for a param group's all-gather; the stock path still uses ``fallback``."""

    def __init__(self, fallback: AllGather) -> None:
        self.fallback = fallback
        # (the group's fsdp_params list, its static fallback reason): FSDP passes the same list object on
        # every unshard, and the checked properties are fixed once FSDP's lazy init has set the dtypes.
        self.static_reason: tuple[list, str | None] | None = None

    def allocate(self, size, *, dtype, device):
        return self.fallback.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return self.fallback(output_tensor=output_tensor, input_tensor=input_tensor, group=group, async_op=async_op)


class TideReduceScatter(ReduceScatter):
    """Opt-in marker for a param group's reduce-scatter; carries the group's ``rs_mode``."""

    def __init__(self, fallback: ReduceScatter, rs_mode: str) -> None:
        self.fallback = fallback
        self.rs_mode = rs_mode
        # FSDPParams whose fixed properties (placement, offload, DTensor) passed: each reduce passes a
        # fresh list (the params that have grads), so the check is remembered per param.
        self.checked_params: set[int] = set()

    def allocate(self, size, *, dtype, device):
        return self.fallback.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return self.fallback(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                             async_op=async_op)


class TideAllGatherResult(AllGatherResult):
    """An all-gather whose data TIDE already placed in the params: copy-out only waits its event."""

    __slots__ = ()


# ---------------------------------------------------------------------------------------------- stats
_counts: dict[str, Counter] = {"all_gather": Counter(), "reduce_scatter": Counter()}
_logged: set[tuple[str, str]] = set()


def _count(kind: str, reason: str | None) -> None:
    path = TIDE if reason is None else f"stock:{reason}"
    _counts[kind][path] += 1
    if reason is None or (kind, reason) in _logged:
        return
    _logged.add((kind, reason))
    # A group that never opted in is not a fallback worth a warning.
    level = logging.DEBUG if reason == "not_enabled" else logging.WARNING
    log.log(level, "tide.fsdp: %s takes the stock FSDP2 path (reason: %s); logged once", kind, reason)


def stats() -> dict[str, dict[str, int]]:
    """Calls per path since the last :func:`reset_stats`: ``{"all_gather": {...}, "reduce_scatter": {...}}``
    mapping ``"tide"`` or ``"stock:<reason>"`` to a count."""
    return {kind: dict(c) for kind, c in _counts.items()}


def reset_stats() -> None:
    for c in _counts.values():
        c.clear()


# ---------------------------------------------------------------------------------------------- predicates
def _common_reason(device: torch.device) -> str | None:
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "cuda_graph_capture"
    if compat.is_tracing():
        return "compiling"
    if compat.functorch_active():
        return "functorch"
    return None


def _param_reason(p) -> str | None:
    if p.fsdp_placement.dim != 0:
        return "shard_dim"
    if p.offload_to_cpu:
        return "cpu_offload"
    if p.is_dtensor:
        return "dtensor_param"
    return None


def all_gather_fallback_reason(fsdp_params, group, async_op, device, comm, extra: bool) -> str | None:
    """Why this ``foreach_all_gather`` call must take the stock path, or None for TIDE."""
    if extra:
        return "unknown_args"
    if not isinstance(comm, TideAllGather):
        return "not_enabled"
    if (reason := _common_reason(device)) is not None:
        return reason
    if async_op:
        return "async_op"
    if group.size() == 1:
        return "world_size_1"
    for p in fsdp_params:
        if p.sharded_state != ShardedState.SHARDED:
            return "post_forward_mesh"
    if comm.static_reason is None or comm.static_reason[0] is not fsdp_params:
        comm.static_reason = (fsdp_params, _static_all_gather_reason(fsdp_params))
    return comm.static_reason[1]


def _static_all_gather_reason(fsdp_params) -> str | None:
    dtype = None
    for p in fsdp_params:
        if (reason := _param_reason(p)) is not None:
            return reason
        if hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather"):
            return "all_gather_extension"
        d = p.param_dtype or p.orig_dtype
        if dtype is not None and d != dtype:
            return "mixed_param_dtypes"
        if d not in FLOAT_DTYPES:
            return "unsupported_dtype"
        dtype = d
    return None


def reduce_fallback_reason(fsdp_params, grads, rs_group, comm, reduce_dtype, device, all_reduce_group,
                           all_reduce_hook, extra: bool) -> str | None:
    """Why this ``foreach_reduce`` call must take the stock path, or None for TIDE."""
    if extra:
        return "unknown_args"
    if not isinstance(comm, TideReduceScatter):
        return "not_enabled"
    if (reason := _common_reason(device)) is not None:
        return reason
    if rs_group is None or rs_group.size() == 1:
        return "world_size_1"
    if all_reduce_group is not None:
        return "hsdp"
    if all_reduce_hook is not None:
        return "all_reduce_hook"
    grad_dtype = grads[0].dtype
    for g in grads:
        if g.dtype != grad_dtype:
            return "mixed_grad_dtypes"  # stock raises its own uniform-dtype error
        if not g.is_contiguous():
            return "noncontiguous_grad"
    if grad_dtype not in FLOAT_DTYPES:
        return "unsupported_dtype"
    # TIDE sums in fp32 into fp32 shards; a bf16/fp16 reduce (and fp16's pre/post-divide) stays stock.
    if (reduce_dtype or grad_dtype) != torch.float32:
        return "reduce_dtype"
    checked = comm.checked_params
    for p in fsdp_params:
        if id(p) not in checked:
            if (reason := _param_reason(p)) is not None:
                return reason
            checked.add(id(p))
    return None


# ---------------------------------------------------------------------------------------------- transport hooks
def bind_all_gather_outputs(fsdp_params, world_size: int, device: torch.device,
                            compute_stream: torch.Stream) -> list[torch.Tensor]:
    """Each param's 1-D all-gather output, allocated exactly as FSDP's copy-out would (its own
    ``init_all_gather_outputs`` / ``alloc_all_gather_outputs``), on the caller's current stream (the
    all-gather copy-in stream).

    Stream ownership: stock allocates these on the compute stream after the all-gather; TIDE writes
    them from the all-gather stream first, so on CUDA each is ``record_stream``-ed on the compute stream:
    its block is not reused before the compute stream's work on it (after reshard) has finished.
    The CUDA transport replaces this function to bind the outputs into its symmetric arena slot.
    """
    outs = []
    for p in fsdp_params:
        p.init_all_gather_outputs([p._sharded_param_data.numel()], [p.param_dtype or p.orig_dtype], world_size,
                                  device)
        p.alloc_all_gather_outputs()
        out = p.all_gather_outputs[0]
        if device.type == "cuda":
            out.record_stream(compute_stream)
        outs.append(out)
    return outs


def all_gather_into_outputs(shards, outs, world_size: int, group: dist.ProcessGroup) -> None:
    """Gather every rank's padded shard into each param's output (called on the all-gather stream)."""
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group.group_name)


def reduce_scatter_into_shards(grads, shard_grads, scale: float, accumulate: bool, world_size: int,
                               group: dist.ProcessGroup, rs_mode: str) -> None:
    """Reduce the unsharded ``grads`` into this rank's padded fp32 ``shard_grads``.

    ``rs_mode`` is the group's ``tide.fsdp.enable(rs_mode=...)``; the reference backend implements both
    modes the same way (the CUDA transport rebinds this function to honour ``"slot_reuse"``).
    """
    torch.ops.tide.reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group.group_name)


# ---------------------------------------------------------------------------------------------- TIDE paths
def _tide_all_gather(fsdp_params, group, copy_in_stream, all_gather_stream, device) -> TideAllGatherResult:
    handle = _get_device_handle(device.type)
    world_size = group.size()
    compute_stream = handle.current_stream()
    with handle.stream(copy_in_stream):
        outs = bind_all_gather_outputs(fsdp_params, world_size, device, compute_stream)
    all_gather_stream.wait_stream(copy_in_stream)
    shards = [p._sharded_param_data for p in fsdp_params]
    # The unsharded params alias these outputs and autograd may have saved them (re-gather in
    # backward): keep their version counters as stock copy-out does. Inference tensors have none.
    preserved = tuple(o for o in outs if not o.is_inference())
    with handle.stream(all_gather_stream):
        if preserved:
            with torch.autograd._unsafe_preserve_version_counter(preserved):
                all_gather_into_outputs(shards, outs, world_size, group)
        else:
            all_gather_into_outputs(shards, outs, world_size, group)
        event = all_gather_stream.record_event()
    return TideAllGatherResult(outs[0].new_empty(0), event, None, [], [], [])


def _accumulates_in_place(fsdp_params, grads, orig_dtype, world_size: int) -> list[torch.Tensor] | None:
    """The existing sharded grads' local tensors when the op can add straight into them, else None.

    Decided identically on every rank (all ranks must issue the same collectives): every param already
    has an fp32 DTensor grad and shards evenly, so no rank's local grad is shorter than its padded shard.
    """
    if orig_dtype not in (None, torch.float32):
        return None
    locals_ = []
    for p, g in zip(fsdp_params, grads):
        existing = p.sharded_param.grad
        if existing is None or g.dim() == 0 or g.shape[0] % world_size:
            return None
        local = existing._local_tensor
        if local.dtype != torch.float32 or not local.is_contiguous():
            return None
        locals_.append(local)
    return locals_


def _tide_reduce(fsdp_params, unsharded_grads, rs_group, rs_stream, comm, orig_dtype, device, divide_factor):
    handle = _get_device_handle(device.type)
    world_size = rs_group.size()
    # With an fp32 reduce and no all-reduce group, every branch of FSDP's _get_gradient_divide_factors
    # (AVG, PREMUL_SUM(1/f), force-sum with post-divide by f) amounts to sum / f with f defaulting to
    # the world size; TIDE applies it as one fp32 scale inside the reduction.
    scale = 1.0 / (divide_factor if divide_factor is not None else world_size)
    # The grads are the reduce input and the keep-alive FSDP holds until the compute stream has waited
    # the reduce-scatter event (as stock does with its packed buffer).
    grads = list(unsharded_grads)
    unsharded_grads.clear()
    rs_stream.wait_stream(handle.current_stream())
    with handle.stream(rs_stream):
        in_place = _accumulates_in_place(fsdp_params, grads, orig_dtype, world_size)
        if in_place is not None:
            reduce_scatter_into_shards(grads, in_place, scale, True, world_size, rs_group, comm.rs_mode)
            rs_event = rs_stream.record_event()
        else:
            # Stock's reduce-output layout: padded shards back to back, each (c, *rest) (dim-0 sharding,
            # so the contiguous strides of the unpadded shard are those of the padded one too).
            offsets, total = [], 0
            for p in fsdp_params:
                offsets.append(total)
                total += p.padded_sharded_param_size.numel()
            flat = torch.empty(total, dtype=torch.float32, device=device)
            as_strided = flat.as_strided
            shards = [as_strided(p.padded_sharded_param_size, p.contiguous_sharded_stride, o)
                      for p, o in zip(fsdp_params, offsets)]
            reduce_scatter_into_shards(grads, shards, scale, False, world_size, rs_group, comm.rs_mode)
            rs_event = rs_stream.record_event()
            # Stock epilogue: cast to the orig dtype, view each unpadded shard, accumulate or assign.
            output = _to_dtype_if_needed(flat, orig_dtype)
            for p, shard, o in zip(fsdp_params, shards, offsets):
                if output is flat and p.sharded_size == p.padded_sharded_param_size:
                    new_grad = shard  # already the unpadded shard's view: saves a view op per param
                else:
                    new_grad = torch.as_strided(output, size=p.sharded_size, stride=p.contiguous_sharded_stride,
                                                storage_offset=o)
                if p.sharded_param.grad is not None:
                    p.sharded_param.grad._local_tensor += new_grad
                else:
                    p.sharded_param.grad = p.to_sharded_dtensor(new_grad)
        for p in fsdp_params:
            for hook in (getattr(p.sharded_param, "_post_accumulate_grad_hooks", {}) or {}).values():
                hook(p.sharded_param)
        post_event = rs_stream.record_event()
    return compat.reduce_result(grads, rs_event, rs_stream, post_event)


# ---------------------------------------------------------------------------------------------- wrappers
_ORIG: dict[str, object] = {}


@torch.no_grad()
def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
                       all_gather_comm, *args, **kwargs):
    reason = all_gather_fallback_reason(fsdp_params, group, async_op, device, all_gather_comm,
                                        bool(args or kwargs))
    _count("all_gather", reason)
    if reason is not None:
        return _ORIG["foreach_all_gather"](fsdp_params, group, async_op, all_gather_copy_in_stream,
                                           all_gather_stream, device, all_gather_comm, *args, **kwargs)
    return _tide_all_gather(fsdp_params, group, all_gather_copy_in_stream, all_gather_stream, device)


@torch.no_grad()
def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group, *args, **kwargs):
    # Dispatch on the result type, so a stock all-gather always meets the stock copy-out.
    if isinstance(all_gather_result, TideAllGatherResult) and not args and not kwargs:
        device = all_gather_result.all_gather_output.device
        _get_device_handle(device.type).current_stream().wait_event(all_gather_result.all_gather_event)
        return None
    return _ORIG["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group, *args, **kwargs)


@torch.no_grad()
def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
                   all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output, all_reduce_hook,
                   force_sum_reduction_for_comms=False, *args, **kwargs):
    reason = reduce_fallback_reason(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_comm,
                                    reduce_dtype, device, all_reduce_group, all_reduce_hook, bool(args or kwargs))
    _count("reduce_scatter", reason)
    if reason is not None:
        return _ORIG["foreach_reduce"](
            fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream, reduce_scatter_comm,
            orig_dtype, reduce_dtype, device, gradient_divide_factor, all_reduce_group, all_reduce_stream,
            all_reduce_grads, partial_reduce_output, all_reduce_hook, force_sum_reduction_for_comms, *args, **kwargs)
    return _tide_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                        reduce_scatter_comm, orig_dtype, device, gradient_divide_factor)


_WRAPPERS = {
    "foreach_all_gather": foreach_all_gather,
    "foreach_all_gather_copy_out": foreach_all_gather_copy_out,
    "foreach_reduce": foreach_reduce,
}


def install() -> None:
    """Rebind the three functions in ``_fsdp_param_group`` once; keep whatever was bound before."""
    for name, wrapper in _WRAPPERS.items():
        current = getattr(_pg, name)
        if current is wrapper:
            continue
        _ORIG[name] = current
        setattr(_pg, name, wrapper)
