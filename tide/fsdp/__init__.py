"""TIDE for FSDP2: ``enable(module)`` routes every opted-in param group's unshard and gradient
reduce through ``tide::all_gather_into_params_`` / ``tide::reduce_scatter_params_`` (no flat
rank-major buffers); unsupported cases take the original FSDP2 path per call (see docs/fsdp.md), and
``tide.stats()`` counts both. On CUDA the groups run on the CUDA transport: one arena per set of ranks,
block all-gather outputs bound in its slots, its data region leased for forward and for backward
(docs/fsdp.md, "CUDA transport wiring").

Modules: ``decide`` (which groups are TIDE's, their per-group state, and each call's decisions), ``fallbacks``
(why a call takes stock), ``seam`` (the three wrappers and their install), ``wiring`` (arena and slots), ``hooks``
(Slot-Reuse),
``compat`` (torch versions), ``comm_debug`` (``CommDebugMode`` counts TIDE's collectives as stock's).
"""
from __future__ import annotations

import warnings

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


from tide import knobs, topology
from tide.knobs import RS_MODES, TRANSPORTS
from tide.fsdp import compat, decide, hooks, seam, wiring
from tide.fsdp.decide import TideAllGather, TideReduceScatter
from tide.multinode import rails
from tide.ops import call_groups

__all__ = ["enable", "disable", "param_groups", "RS_MODES", "TRANSPORTS"]

TRANSPORT_ENV = "TIDE_FSDP_TRANSPORT"


def default_transport() -> str:
    return knobs.get(TRANSPORT_ENV)


def _check_module(fn: str, module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"{fn}: module must be a torch.nn.Module (sharded with fully_shard), "
                        f"got {type(module).__name__}")


def param_groups(module: nn.Module) -> list:
    """Every FSDP2 param group in ``module``'s tree (each ``fully_shard`` call contributes its groups)."""
    return [g for g, _ in _groups_and_leaf(module)]


def _fsdp_modules(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _groups_and_leaf(module: nn.Module) -> list:
    """(param group, whether its FSDP module has no FSDP module below it) for every group in the tree."""
    out = []
    for m in _fsdp_modules(module):
        leaf = not any(isinstance(c, FSDPModule) for c in m.modules() if c is not m)
        out.extend((g, leaf) for g in compat.param_groups(m._get_fsdp_state()))
    return out


def enable(module: nn.Module, *, rs_mode: str = "in_place", transport: str | None = None,
           local_world_size: int | None = None) -> nn.Module:
    """Opt every FSDP2 module in ``module``'s tree (all its param groups) into TIDE; returns ``module``.

    ``rs_mode``: ``"in_place"`` or ``"slot_reuse"`` (how the CUDA transport stages the reduce-scatter; the
    reference backend treats both alike). Slot-Reuse moves each gradient of a slot-bound group into the
    slot region of its own parameter as soon as autograd has finished it (a post-accumulate-grad hook),
    so the group's gradients need no allocator memory; it assumes backward reads no parameter after its
    gradient is complete (autograd's in-place check raises if one does).
    ``transport``: ``"auto"`` (default, or ``TIDE_FSDP_TRANSPORT``): on CUDA the CUDA transport's arena of
    each set of ranks is created (collectively) at their first TIDE collective, after FSDP's
    lazy init, and all-gather outputs are bound in its slots; ``"reference"``: no arena, the ops' reference
    backend (stock collectives, still layout-aware). On CPU both are the reference backend.
    ``local_world_size``: ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``), for every group of
    the process (``tide.topology``): groups whose ranks span several nodes run the multi-node schedule,
    counted as ``"tide_multinode"`` (on CUDA only with ``TIDE_CUDA_MULTINODE=1``: opt-in until it is
    measured with several GPUs per node, docs/performance.md; else they take stock,
    ``stock:nvlink_domain``). With several ranks per node, each node's ranks share a node arena
    (``tide.transport.node_leg``) whose slots hold the blocks' outputs and whose copy engines carry the
    intra-node legs. Every rank must pass the same value.
    Torch releases: the seam picks its wrappers by the signatures of the FSDP2 functions it replaces
    (``tide.fsdp.compat``). Outside the tested releases it warns once and runs where they match; where
    they do not, every call takes stock FSDP2 as ``stock:untested_torch:<what differed>``.
    Calling it again updates ``rs_mode`` and ``transport``. The groups' FSDP2 comms stay FSDP2's: every
    FSDP2 API works before or after ``enable`` as on stock. A collective whose comm is the user's own
    (``set_custom_all_gather`` / ``set_custom_reduce_scatter``, before or after) keeps it: stock FSDP2,
    ``stock:custom_comm``, with a warning once per group.
    """
    knobs.validate_once()  # TIDE's first use: every knob is checked here, whatever the device
    _check_module("tide.fsdp.enable", module)
    if rs_mode not in RS_MODES:
        raise ValueError(f"tide.fsdp.enable: rs_mode must be one of {RS_MODES}, got {rs_mode!r}")
    transport = transport or default_transport()
    if transport not in TRANSPORTS:
        raise ValueError(f"tide.fsdp.enable: transport must be one of {TRANSPORTS}, got {transport!r}")
    if local_world_size is not None:
        topology.set_local_world_size(local_world_size, "tide.fsdp.enable")
    groups = _groups_and_leaf(module)
    if not groups:
        raise ValueError(
            f"tide.fsdp.enable: module ({type(module).__name__}) contains no FSDP2 module with parameters; "
            "call torch.distributed.fsdp.fully_shard on it (or its submodules) first"
        )
    call_groups.publish_process()  # a peer that waits for this rank from now on can tell whether it ended
    if seam.install() is None:
        compat.warn_untested_once("tide.fsdp.enable")
    threaded = sum(call_groups.threaded_ranks(g._all_gather_process_group) for g, _ in groups)
    if threaded:
        warnings.warn(f"tide.fsdp.enable: {threaded} of {len(groups)} param groups shard over ranks that are "
                      "threads of one process (torch's threaded test backend); TIDE needs a process per rank, so their "
                      "collectives take stock FSDP2 (tide.stats(): stock:threaded_ranks)", RuntimeWarning, stacklevel=2)
    for g, leaf in groups:
        enabled = decide.of_group(g)
        if enabled is not None:
            all_gather, reduce_scatter = enabled
            reduce_scatter.rs_mode = rs_mode
            reduce_scatter.transport = all_gather.transport = transport
            continue
        all_gather = TideAllGather(g, transport, leaf)
        decide.attach(g, all_gather, TideReduceScatter(g, rs_mode, transport))
        wiring.register_group(all_gather)
    for m in _fsdp_modules(module):
        wiring.watch_forward(m)
    return module


def disable(module: nn.Module) -> nn.Module:
    """Return every param group in ``module``'s tree to stock FSDP2, and drop the transport arenas
    :func:`enable` created, and the direct NCCL rails of multi-node groups, once no enabled group uses them
    (call it between steps: it refuses while unsharded parameters still live in an arena slot)."""
    _check_module("tide.fsdp.disable", module)
    groups = [g for g in param_groups(module) if decide.of_group(g) is not None]
    wiring.check_arenas_idle(groups)  # refuse before changing anything
    process_groups = {wiring.group_key(g._all_gather_process_group): g._all_gather_process_group for g in groups}
    emptied = [key for key in map(wiring.unregister_group, groups) if key is not None]
    for key in emptied:
        wiring.drop_arena(key)
        rails.close_direct(process_groups[key])
    for m in _fsdp_modules(module):
        wiring.unwatch_forward(m)
    for g in groups:
        hooks.remove(g)
        decide.detach(g)
    return module
