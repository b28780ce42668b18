"""Slot-Reuse: each gradient of a slot-bound group moves into its parameter's own slot region as soon as
autograd has finished it, and autograd's memory goes (docs/fsdp.md, "Slot-Reuse hooks")."""
from __future__ import annotations

import torch

from tide import counters
from tide.fsdp import compat, decide, extensions
from tide import routes


def install(param_group) -> None:
    """Give each unsharded param of a bound Slot-Reuse group a post-accumulate-grad hook
    (:func:`grad_into_slot`), once; the hooks stay until :func:`remove` and do nothing while the group is
    in another mode."""
    comm = decide.of_group(param_group)[1]
    for p in param_group.fsdp_params:
        if id(p) in comm.grad_hooks or not hasattr(p, "_unsharded_param") or not p._unsharded_param.requires_grad:
            continue
        comm.grad_hooks[id(p)] = p._unsharded_param.register_post_accumulate_grad_hook(
            lambda param, g=param_group, fp=p: grad_into_slot(g, fp, param))


def remove(param_group) -> None:
    comm = decide.of_group(param_group)[1]
    for handle in comm.grad_hooks.values():
        handle.remove()
    comm.grad_hooks.clear()


def grad_into_slot(param_group, fsdp_param, param) -> None:
    """Move ``param``'s finished gradient into the slot region its own values occupy, and let autograd's
    gradient storage go (the peak then holds at most one parameter's gradient outside the arena).

    A post-accumulate-grad hook: autograd has summed every contribution to this gradient, so the
    backward no longer needs the parameter's values (their last readers produced this gradient). The
    copy goes through ``param`` itself, which bumps its version counter: a backward node that still
    held the values (say a second backward with ``retain_graph=True``) fails autograd's in-place check
    instead of reading gradients. ``param.grad`` becomes a view of the arena (not of the all-gather
    output, whose storage FSDP's reshard empties before the reduce reads the gradients).
    Only when this backward reduces and reshards the group (``reduce_grads``, ``reshard_after_backward``;
    no gradient accumulated from an earlier no-sync backward), the reduce is fp32 (TIDE's), and the
    params are bound in a slot. Reentrant activation checkpointing (``use_reentrant=True``) accumulates a
    parameter once per checkpointed region: a parameter used in two regions of one FSDP module would be
    overwritten before the second region recomputes, so use non-reentrant checkpointing (torch's
    default) or In-Place with it.
    """
    if not movable(param_group, fsdp_param, param):
        return
    grad = param.grad
    arena = routes.of(param_group._all_gather_process_group).holder
    out = fsdp_param.all_gather_outputs[0] if fsdp_param.all_gather_outputs else None
    if arena is None or out is None or out.untyped_storage().nbytes() == 0 or grad.data_ptr() == out.data_ptr():
        return
    place = arena.view_at(out, param.shape, param.dtype)
    if place is None:  # not bound in a slot
        return
    with torch.no_grad():
        param.detach().copy_(grad)
    param.grad = place
    decide.of_group(param_group)[1].grads_moved_into_slot = True
    counters.count_wiring("rs:grad_into_slot")


def movable(param_group, fsdp_param, param) -> bool:
    """Whether ``param``'s finished gradient may move into a slot (if the group has one): see
    :func:`grad_into_slot`."""
    grad = param.grad
    enabled = decide.of_group(param_group)
    return not (
        grad is None or enabled is None or enabled[1].rs_mode != "slot_reuse"
        # TIDE reduces into fp32 only; others stay stock
        or (compat.reduce_dtype(fsdp_param) or grad.dtype) != torch.float32
        or not param_group.reduce_grads or not param_group.reshard_after_backward
        or compat.holds_unreduced_accumulation(fsdp_param) or grad.dtype != param.dtype
        # a tensor extension's slot place holds its all-gather inputs' bytes, not a gradient's
        or extensions.has_hooks(fsdp_param)
        or grad.shape != param.shape or not grad.is_contiguous())
