"""The FSDP2 seam: dispatching replacements of FSDP2's three ``foreach_*`` collectives.

``install()`` rebinds ``foreach_all_gather``, ``foreach_all_gather_copy_out`` and ``foreach_reduce`` in
``torch.distributed.fsdp._fully_shard._fsdp_param_group``'s namespace, where ``FSDPParamGroup`` looks them
up at call time (whatever was bound there before is kept and called for the stock path, so other
patchers chain). A param group is opted in by ``enable`` giving it TIDE's per-group state
(``tide.fsdp.decide``, found from the params FSDP2 passes; FSDP2's own comms stay in place). Every call is
first decided in one place, ``tide.fsdp.decide`` (the stock reason, or all the TIDE call needs: arena, slot
plan, tensor-extension inputs, identity); this module then only issues: the TIDE path, or the original
function, counted in ``tide.stats()["fsdp"]`` under ``"stock:<reason>"``. Once a TIDE op has timed out
(``tide.transport.watchdog``), a stock call raises the watchdog's error here, and a TIDE call in the op (its C++
kernel then hands every call to the op's Python kernel, whose first step raises it) or where the call would
wait for peers before it (a group's first call, a new lease).

Everything else FSDP2 owns (streams, events, prefetch, reshard, keep-alives, state) stays stock. Both
collectives go through the ``torch.ops.tide`` ops on every backend; on CUDA the op finds the arena of the
group's ranks (``tide.fsdp.wiring`` creates it at the first TIDE collective) and the seam binds the
all-gather outputs of blocks into its slots first.

Three functions here are the transport's hooks (module globals looked up at call time, so a transport
may rebind them, as ``bench/fsdp_host_overhead.py`` does to time them): :func:`bind_all_gather_outputs`
(where each param's all-gather output lives), :func:`all_gather_into_outputs` and
:func:`reduce_scatter_into_shards` (the collective calls).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard import _fsdp_collectives
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as _pg
from torch.distributed.fsdp._fully_shard._fsdp_collectives import AllGatherResult

from tide import counters, registry
from tide.fsdp import compat, decide, extensions, hooks, reduce_output, replicate, shard_dims, wiring
from tide.transport.watchdog import WATCHDOG


# ---------------------------------------------------------------------------------------------- transport hooks
def bind_all_gather_outputs(fsdp_params, specs, world_size: int, device: torch.device,
                            compute_stream: torch.Stream, slot: int | None = None, arena=None) -> list[torch.Tensor]:
    """Each param's 1-D all-gather outputs, param-major (one per param, or one per input of a tensor
    extension's; ``specs``: their sizes and dtypes, :func:`tide.fsdp.wiring.output_specs`).

    With an arena slot: FSDP's own output tensors, their storages pointed into the slot of the arena's held
    data region (leased on the current stream if none is held) at their param-major addresses
    (:func:`tide.fsdp.wiring.bind_into_slot`; host work only: the all-gather op waits for the slot's previous
    users before it writes). Otherwise allocated exactly
    as FSDP's copy-out would (its own ``init_all_gather_outputs`` / ``alloc_all_gather_outputs``) on the
    current stream, and on CUDA ``record_stream``-ed on the compute stream: a block allocated on another
    stream is then not reused before the compute stream is done with it (on the compute stream itself the
    record is a no-op).
    """
    if arena is not None and slot is not None:
        return wiring.bind_into_slot(arena, fsdp_params, world_size, device, slot, specs)
    outs = wiring.init_outputs(fsdp_params, specs, world_size, device)
    for p in fsdp_params:
        p.alloc_all_gather_outputs()
    if device.type == "cuda":
        for out in outs:
            out.record_stream(compute_stream)
    return outs


def all_gather_into_outputs(shards, outs, world_size: int, group: dist.ProcessGroup) -> None:
    """Gather every rank's padded shard into each param's output (called on the all-gather stream)."""
    torch.ops.tide.all_gather_into_params_(shards, outs, world_size, group.group_name)


def reduce_scatter_into_shards(grads, shard_grads, scale: float, accumulate: bool, world_size: int,
                               group: dist.ProcessGroup) -> None:
    """Reduce the unsharded ``grads`` into this rank's padded fp32 ``shard_grads`` (on the reduce-scatter
    stream, which has waited for the compute stream). The op reads every gradient where it lies: where
    autograd left it (In-Place), or at its parameter's place in the group's slot, where the Slot-Reuse
    hooks moved it."""
    torch.ops.tide.reduce_scatter_params_(grads, shard_grads, scale, accumulate, world_size, group.group_name)


# ---------------------------------------------------------------------------------------------- TIDE paths
class TideAllGatherResult(AllGatherResult):
    """An all-gather whose data TIDE already placed in the params: copy-out only waits its event."""

    __slots__ = ()


def _tide_all_gather(fsdp_params, group, copy_in_stream, all_gather_stream, device,
                     call: decide.AllGatherCall) -> TideAllGatherResult:
    handle = _get_device_handle(device.type)
    world_size = group.size()
    compute_stream = handle.current_stream()
    mode, slot, arena, specs, inputs = call.mode, call.slot, call.arena, call.specs, call.inputs
    if mode == "bound":
        # Bound on the compute stream: the phase's first call leases the region there, so a released region
        # serves its activations.
        outs = bind_all_gather_outputs(fsdp_params, specs, world_size, device, compute_stream, slot, arena)
        # The slot's previous occupant was read on the compute stream (FSDP has resharded it on the host, its
        # kernels may still run); the op itself waits for the slot's last use on other streams.
        copy_in_stream.wait_stream(compute_stream)
    elif mode == "none":
        # No arena (multi-node groups of one rank per node; the reference transport): from the compute
        # stream's pool, as stock's copy-out allocates them. On the copy-in stream the outputs of an
        # 8B-shaped multi-node step took 3.9-5.7 GiB of segments of that stream's own.
        # A block freed on the compute stream may still be read by work queued there, so the all-gather
        # writes after that work: without FSDP's explicit forward prefetch it cannot overlap the layer
        # before (an 8B-shaped step on 2 x 1 was still 5-18 % faster than stock's).
        outs = bind_all_gather_outputs(fsdp_params, specs, world_size, device, compute_stream)
        copy_in_stream.wait_stream(compute_stream)
    else:
        # Groups outside a slot keep stock's overlap: allocated on the copy-in stream.
        with handle.stream(copy_in_stream):
            outs = bind_all_gather_outputs(fsdp_params, specs, world_size, device, compute_stream)
    all_gather_stream.wait_stream(copy_in_stream)
    if inputs is not None:
        shards, out_blocks = extensions.op_pairs(fsdp_params, inputs, outs, world_size)
        extensions.keep_inputs_for(inputs, all_gather_stream, device)
    else:
        shards, out_blocks = [p._sharded_param_data for p in fsdp_params], outs
        if call.blocks:  # a Shard(i > 0) param's blocks, decided per group
            shards, out_blocks = shard_dims.all_gather_args(fsdp_params, shards, outs, world_size)
    # The unsharded params alias these outputs and autograd may have saved them (re-gather in
    # backward): keep their version counters as stock copy-out does. Inference tensors have none.
    preserved = tuple(o for o in outs if not o.is_inference())
    with handle.stream(all_gather_stream):
        if preserved:
            with torch.autograd._unsafe_preserve_version_counter(preserved):
                all_gather_into_outputs(shards, out_blocks, world_size, group)
        else:
            all_gather_into_outputs(shards, out_blocks, world_size, group)
        event = all_gather_stream.record_event()
    if mode != "none":
        counters.count_wiring(f"ag:{mode}")
    return TideAllGatherResult(outs[0].new_empty(0), event, None, [], [], [])


def _tide_reduce(fsdp_params, unsharded_grads, rs_group, rs_stream, grad_dtypes, device, divide_factor,
                 across: replicate.Across, call: decide.ReduceCall):
    handle = _get_device_handle(device.type)
    world_size = rs_group.size()
    # Stock's divide factors for an fp32 reduce; TIDE-RS applies the reduce-scatter's as one fp32 scale.
    f = replicate.factors(rs_group, across, divide_factor, device.type)
    # The grads are the reduce input and the keep-alive FSDP holds until the compute stream has waited
    # the reduce-scatter event (as stock does with its packed buffer).
    grads = list(unsharded_grads)
    unsharded_grads.clear()
    if call.arena is not None:  # leased (if it is not) on the compute stream, as for the all-gather
        call.arena.region()
        # Where the op reads the gradients: the Slot-Reuse hooks moved them into the slot, or autograd's own.
        counters.count_wiring("rs:slot_reuse" if call.from_slot else "rs:in_place")
    rs_stream.wait_stream(handle.current_stream())
    in_place = (None if across.needs_buffer or f.divides_after
                else reduce_output.accumulates_in_place(fsdp_params, grads, grad_dtypes, world_size))
    with handle.stream(rs_stream):
        if in_place is not None:
            reduce_scatter_into_shards(*_reduce_args(call, fsdp_params, grads, in_place, world_size), f.scale, True,
                                       world_size, rs_group)
            rs_event = rs_stream.record_event()
            reduce_output.post_accumulate_hooks(fsdp_params)
            return compat.reduce_result(grads, rs_event, rs_stream, rs_stream.record_event())
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
        reduce_scatter_into_shards(*_reduce_args(call, fsdp_params, grads, shards, world_size), f.scale, False,
                                   world_size, rs_group)
        rs_event = rs_stream.record_event()
    after = replicate.finish(flat, across, f, rs_stream, handle)
    if after.partial is not None:  # no all-reduce this step: stock assigns nothing either
        return compat.reduce_result(grads, rs_event, rs_stream, rs_stream.record_event(), partial=after.partial)
    with handle.stream(after.stream):
        # Stock epilogue: cast to each gradient dtype, view each unpadded shard, accumulate or assign.
        if all(d in (None, torch.float32) for d in grad_dtypes) and all(
                p.sharded_size == p.padded_sharded_param_size for p in fsdp_params):
            new_grads = shards  # already the unpadded shards' views: saves a view op per param
        else:
            new_grads = reduce_output.cast_runs(flat, fsdp_params, offsets, grad_dtypes)
        for p, new_grad in zip(fsdp_params, new_grads):
            if p.sharded_param.grad is not None:
                p.sharded_param.grad._local_tensor += new_grad
            else:
                p.sharded_param.grad = p.to_sharded_dtensor(new_grad)
        reduce_output.post_accumulate_hooks(fsdp_params)
        post_event = after.stream.record_event()
    return compat.reduce_result(grads, rs_event, after.stream, post_event, all_reduce_input=after.all_reduce_input,
                                all_reduce_event=after.all_reduce_event)


def _reduce_args(call: decide.ReduceCall, fsdp_params, grads, shard_grads, world_size: int) -> tuple[list, list]:
    """The op's (grads, shard grads): as they are, or a ``Shard(i > 0)`` group's as dim-0 blocks."""
    if call.blocks:
        return shard_dims.reduce_scatter_args(fsdp_params, grads, shard_grads, world_size)
    return grads, shard_grads


# ---------------------------------------------------------------------------------------------- wrappers
# FSDP2 calls the three functions by position; each has one wrapper per signature it has had
# (tide.fsdp.compat.choose_wrappers picks the one that is exactly the stock function's).
_DEFAULT_OUTPUT_FN = getattr(_fsdp_collectives, "_default_all_gather_output_fn", None)
_DEFAULT_RS_INPUT_FN = getattr(_fsdp_collectives, "_default_reduce_scatter_input_fn", None)

@torch.no_grad()
def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device,
                       all_gather_comm):
    call = decide.all_gather(fsdp_params, group, async_op, device, all_gather_copy_in_stream)
    if call.reason is not None:
        WATCHDOG.check()  # after a TIDE op timed out, stock's collective would wait for peers that never come
        return registry.stock_functions["foreach_all_gather"](fsdp_params, group, async_op, all_gather_copy_in_stream,
                                                              all_gather_stream, device, all_gather_comm)
    with call.identity:
        result = _tide_all_gather(fsdp_params, group, all_gather_copy_in_stream, all_gather_stream, device, call)
    if call.install_hooks:
        hooks.install(call.param_group)
    return result


def _wait_tide_all_gather(all_gather_result) -> None:
    device = all_gather_result.all_gather_output.device
    _get_device_handle(device.type).current_stream().wait_event(all_gather_result.all_gather_event)


@torch.no_grad()
def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    """torch 2.11-2.14. Dispatches on the result type, so a stock all-gather always meets the stock
    copy-out."""
    if isinstance(all_gather_result, TideAllGatherResult):
        return _wait_tide_all_gather(all_gather_result)
    return registry.stock_functions["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)


@torch.no_grad()
def foreach_all_gather_copy_out_with_output_fn(all_gather_result, fsdp_params, group, *,
                                               all_gather_output_fn=_DEFAULT_OUTPUT_FN):
    """torch 2.15+: the copy-out is handed the group's output function (a group with a custom one never
    took TIDE's all-gather: ``fallbacks.all_gather_reason``)."""
    if isinstance(all_gather_result, TideAllGatherResult):
        return _wait_tide_all_gather(all_gather_result)
    return registry.stock_functions["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group,
                                                all_gather_output_fn=all_gather_output_fn)


def _stock_with(name: str, arguments: dict, keyword_only: tuple[str, ...] = ()):
    """The stock ``name`` bound to a wrapper's own ``arguments`` (its ``locals()`` at entry: the parameters,
    in order), positionally as FSDP2 calls it, but for the ``keyword_only`` ones."""
    positional = [value for key, value in arguments.items() if key not in keyword_only]
    return functools.partial(registry.stock_functions[name], *positional,
                             **{key: arguments[key] for key in keyword_only})


def _reduce(stock, fsdp_params, unsharded_grads, group, stream, reduce_dtype, device, divide_factor,
            across: replicate.Across, grad_dtypes, custom_input_fn: bool):
    """Both ``foreach_reduce`` shapes: TIDE's reduce, or ``stock()`` for the reason it records."""
    call = decide.reduce(fsdp_params, unsharded_grads, group, reduce_dtype, device, custom_input_fn)
    if call.reason is not None:
        WATCHDOG.check()
        out = stock()
        wiring.order_slot_after_stock_reduce(fsdp_params, call.comm, group, stream)
        return out
    with call.identity:
        return _tide_reduce(fsdp_params, unsharded_grads, group, stream, grad_dtypes, device, divide_factor, across,
                            call)


@torch.no_grad()
def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_scatter_comm, orig_dtype, reduce_dtype, device, gradient_divide_factor,
                   all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output, all_reduce_hook,
                   force_sum_reduction_for_comms=False):
    """torch 2.11-2.14: the group's reduced gradients are cast to one ``orig_dtype``."""
    stock = _stock_with("foreach_reduce", locals())
    across = replicate.Across(all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
                              all_reduce_hook, force_sum_reduction_for_comms)
    return _reduce(stock, fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_dtype, device, gradient_divide_factor, across,
                   [orig_dtype] * len(fsdp_params), False)


@torch.no_grad()
def foreach_reduce_per_param_dtype(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                                   reduce_scatter_comm, reduce_dtype, device, gradient_divide_factor,
                                   all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
                                   all_reduce_hook, force_sum_reduction_for_comms=False, *,
                                   prepare_reduce_scatter_inputs=_DEFAULT_RS_INPUT_FN):
    """torch 2.15+: each reduced gradient is cast to its param's ``sharded_grad_dtype``; a group with a
    custom ``prepare_reduce_scatter_inputs`` takes stock."""
    stock = _stock_with("foreach_reduce", locals(), keyword_only=("prepare_reduce_scatter_inputs",))
    across = replicate.Across(all_reduce_group, all_reduce_stream, all_reduce_grads, partial_reduce_output,
                              all_reduce_hook, force_sum_reduction_for_comms)
    return _reduce(stock, fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream,
                   reduce_dtype, device, gradient_divide_factor, across,
                   [p.sharded_grad_dtype for p in fsdp_params],
                   prepare_reduce_scatter_inputs is not _DEFAULT_RS_INPUT_FN)


SHAPES = {
    "foreach_all_gather": [foreach_all_gather],
    "foreach_all_gather_copy_out": [foreach_all_gather_copy_out, foreach_all_gather_copy_out_with_output_fn],
    "foreach_reduce": [foreach_reduce, foreach_reduce_per_param_dtype],
}


def _untested(name: str, reason: str, counted: str | None):
    """A pass-through to the original ``name`` that counts each call as ``stock:<reason>``."""
    original = getattr(_pg, name)

    def passthrough(*args, **kwargs):
        if counted is not None:
            counters.count_fsdp(counted, reason)
        return original(*args, **kwargs)
    return passthrough


def install() -> str | None:
    """Rebind the three functions in ``_fsdp_param_group`` once, keeping whatever was bound before as the
    stock path; returns None, or the ``untested_torch:...`` reason every call then takes stock for.
    Later calls change nothing: a patcher installed after TIDE chains to TIDE's wrapper, and
    re-capturing it as "stock" would make the two call each other forever."""
    global untested_reason
    if registry.stock_functions:
        return untested_reason
    wrappers, differed = compat.choose_wrappers(SHAPES)
    if wrappers is None:
        untested_reason = f"untested_torch:{differed}"
        counted = {"foreach_all_gather": "all_gather", "foreach_reduce": "reduce_scatter"}
        wrappers = {name: _untested(name, untested_reason, counted.get(name)) for name in SHAPES}
    for name, wrapper in wrappers.items():
        registry.stock_functions[name] = getattr(_pg, name)
        setattr(_pg, name, wrapper)
    return untested_reason


untested_reason: str | None = None  # once installed: why every call takes stock on this torch, or None
