"""TIDE for FSDP2: ``enable(module)`` routes every opted-in param group's unshard and gradient
reduce through ``tide::all_gather_into_params_`` / ``tide::reduce_scatter_params_`` (no flat
rank-major buffers); unsupported cases take the original FSDP2 path per call (see docs/fsdp.md).
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from tide.fsdp import compat, seam
from tide.fsdp.seam import RS_MODES, reset_stats, stats

__all__ = ["enable", "disable", "stats", "reset_stats", "param_groups", "RS_MODES"]


def param_groups(module: nn.Module) -> list:
    """Every FSDP2 param group in ``module``'s tree (each ``fully_shard`` call contributes its groups)."""
    groups = []
    for m in module.modules():
        if isinstance(m, FSDPModule):
            groups.extend(compat.param_groups(m._get_fsdp_state()))
    return groups


def enable(module: nn.Module, *, rs_mode: str = "in_place", force: bool = False) -> nn.Module:
    """Opt every FSDP2 module in ``module``'s tree (all its param groups) into TIDE; returns ``module``.

    ``rs_mode``: ``"in_place"`` or ``"slot_reuse"`` (how the CUDA transport stages the reduce-scatter; the
    reference backend treats both alike). ``force``: allow a torch version outside the tested set.
    Calling it again updates ``rs_mode``; other custom comms set before stay the stock path's comms.
    """
    if rs_mode not in RS_MODES:
        raise ValueError(f"tide.fsdp.enable: rs_mode must be one of {RS_MODES}, got {rs_mode!r}")
    compat.check_torch_version("tide.fsdp.enable", force)
    groups = param_groups(module)
    if not groups:
        raise ValueError(
            f"tide.fsdp.enable: module ({type(module).__name__}) contains no FSDP2 module with parameters; "
            "call torch.distributed.fsdp.fully_shard on it (or its submodules) first"
        )
    seam.install()
    for g in groups:
        if isinstance(g._all_gather_comm, seam.TideAllGather):
            g._reduce_scatter_comm.rs_mode = rs_mode
            continue
        g._all_gather_comm = seam.TideAllGather(g._all_gather_comm)
        g._reduce_scatter_comm = seam.TideReduceScatter(g._reduce_scatter_comm, rs_mode)
    return module


def disable(module: nn.Module) -> nn.Module:
    """Return every param group in ``module``'s tree to the comms it had before :func:`enable`."""
    for g in param_groups(module):
        if isinstance(g._all_gather_comm, seam.TideAllGather):
            g._all_gather_comm = g._all_gather_comm.fallback
        if isinstance(g._reduce_scatter_comm, seam.TideReduceScatter):
            g._reduce_scatter_comm = g._reduce_scatter_comm.fallback
    return module
