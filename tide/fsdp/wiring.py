"""FSDP2 on the CUDA transport: which arena serves a group, which groups are bound into its slots, and
how their all-gather outputs are pointed there (docs/fsdp.md, "CUDA transport wiring").

Per set of ranks: the FSDP param groups enabled on it and the one transport arena they share. Keyed by
ranks, not by process-group name: FSDP2 may give every fully_shard call its own process group over the
same ranks (torch 2.11 does when the default group is gloo on a CUDA machine), and FSDP issues all their
collectives in one program order on every rank, so one arena serves them all. The arena leases its slots
(tide.transport.slots): every choice depends only on host-side FSDP state that evolves identically on
every rank, so all ranks pick the same slot.
"""
from __future__ import annotations

import logging
import weakref

import torch
import torch.distributed as dist

from tide import counters, registry, routes, transport
from tide.fsdp import extensions, shard_dims
from tide.fsdp.fallbacks import group_dtype, static_all_gather_reason
from tide.meta import plans
from tide.transport import node_leg

log = logging.getLogger("tide.fsdp")



def group_key(group: dist.ProcessGroup) -> tuple:
    """The global ranks of ``group``, in group-rank order: the key of its arena."""
    return routes.of(group).ranks


def register_group(all_gather) -> None:
    """Remember (weakly) that the param group of ``all_gather`` (its ``TideAllGather`` state, which lives as long
    as the group) is enabled on its shard process group (arena sizing)."""
    key = group_key(all_gather.param_group._all_gather_process_group)
    states = registry.enabled_groups.setdefault(key, [])
    if not any(r() is all_gather for r in states):
        states.append(weakref.ref(all_gather))


def enabled_groups(key: tuple) -> list:
    """The ``TideAllGather`` states of the param groups enabled on the ranks ``key``."""
    refs = registry.enabled_groups.get(key, [])
    refs[:] = [r for r in refs if r() is not None]
    return [r() for r in refs]


def unregister_group(param_group) -> tuple | None:
    """Forget ``param_group``; returns its ranks' key when no enabled group is left on them."""
    key = group_key(param_group._all_gather_process_group)
    refs = registry.enabled_groups.get(key, [])
    refs[:] = [r for r in refs if r() is not None and r().param_group is not param_group]
    if refs:
        return None
    registry.enabled_groups.pop(key, None)
    return key


def slot_layout(fsdp_params, world_size: int, inputs: list | None = None):
    """The group's all-gather layout as the transport binds it (1-D padded shards, param-major; a tensor
    extension's inputs where ``inputs`` has them, else an estimate: ``extensions.output_specs``)."""
    numels, dtypes = [], []
    for n, d in output_specs(fsdp_params, inputs):
        numels += n
        dtypes += d
    return plans.all_gather_layout([(n,) for n in numels], dtypes, world_size)


def rs_piece_bytes(fsdp_params) -> int:
    """One destination's bytes of the group's reduce-scatter in a staging entry (its padded shards, in
    the dtype its gradients have: the gathered one)."""
    return plans.rs_piece_bytes([p._sharded_param_data.numel() for p in fsdp_params],
                                [group_dtype(p).itemsize for p in fsdp_params])


def bindable(comm, sharded: bool) -> bool:
    """Whether the group of ``comm`` (its ``TideAllGather``; ``sharded``: whether a param of it is sharded on a
    dim other than 0, ``shard_dims.sharded``) is bound into slots: groups whose unsharded
    params live only while their own module runs: FSDP modules with no FSDP module below them (blocks)
    that reshard after forward (``reshard_after_forward=True``/int). A parent
    (the root: embedding, final norm, head) holds its params across all its children's forward and
    backward, and a ``reshard_after_forward=False`` group from forward to the end of backward: those keep
    their outputs the way stock does (allocator memory, gathered in place), so slots are sized for the
    blocks alone and stay free for the current and the prefetched block."""
    param_group = comm.param_group
    # A Shard(i > 0) param's blocks (tide.fsdp.shard_dims) are params of the op's plan, each padded to its own
    # place in a slot: its output would not be one tensor there, so such groups keep stock's outputs.
    return comm.leaf and param_group.post_forward_mesh_info is not None and not sharded


def _create_arena(group: dist.ProcessGroup, multinode: bool):
    """Rendezvous the arena of ``group``'s ranks, or for a group spanning nodes the node arena of this
    rank's node (:mod:`tide.transport.node_leg`); collective: every rank reaches its group's first TIDE
    collective at the same point of the step; never under graph capture: that call took the stock path
    before. Slots fit the largest :func:`bindable` group enabled on those ranks (all of ``group``'s ranks'
    outputs); with none, the arena has no slots (reduce-scatters only). The staging ring's entries fit
    one round of the largest bindable group's reduce-scatter (with none, of the largest group's)."""
    W = group.size()
    key = group_key(group)
    states = [s for s in enabled_groups(key) if s.param_group.fsdp_params]
    groups = [s.param_group for s in states]
    bound = [g for s, g in zip(states, groups) if bindable(s, shard_dims.sharded(g.fsdp_params))
             and static_all_gather_reason(g.fsdp_params) is None]
    layouts = [slot_layout(g.fsdp_params, W) for g in bound]
    if multinode:
        arena = node_leg.enable(group, slot_bytes=max([0] + [layout.slot_bytes for layout in layouts]))
    else:
        # The staging ring fits one round of the blocks' reduce-scatters; the root's may take several.
        pieces = [rs_piece_bytes(g.fsdp_params) for g in bound or groups]
        arena = transport.enable(group, layouts=layouts, rs_piece_bytes=max(pieces, default=None))
    registry.created_arenas[key] = group.group_name
    counters.count_wiring("arena:created")
    log.info("tide.fsdp: created %r for %d enabled param groups", arena, len(enabled_groups(key)))
    return arena


def arena_for(group: dist.ProcessGroup, route: routes.Route, device: torch.device, comm_transport: str):
    """The arena serving ``group`` (its ``route``; created on first use, unless an op-level user made one):
    its ranks' own, or for a group spanning nodes of 2 or more ranks its node arena, which carries the
    multi-node ops' intra-node legs. None: not CUDA, the reference transport, or one rank per node (the
    ops run the multi-node schedule alone)."""
    if device.type != "cuda" or comm_transport != "auto":
        return None
    if route.multinode and route.topology.local_size < 2:
        return None
    return route.holder if route.holder is not None else _create_arena(group, route.multinode)


def check_arenas_idle(param_groups) -> None:
    """Raise (changing nothing) if an arena serving ``param_groups`` still holds unsharded params."""
    for g in param_groups:
        arena = routes.of(g._all_gather_process_group).holder
        if arena is not None and arena.slots.held():
            raise RuntimeError("tide.fsdp.disable: unsharded parameters still live in the transport arena of "
                               f"ranks {list(arena.ranks)}; call disable between steps (after backward / reshard)")


def drop_arena(key: tuple) -> None:
    """Release the arena of the ranks ``key`` if the seam created it (after :func:`check_arenas_idle`)."""
    name = registry.created_arenas.pop(key, None)
    if name is not None:
        transport.disable(name)
        node_leg.disable(name)


def release_leases() -> None:
    """Give the data regions of the arenas the seam created back to the caching allocator (the phase
    ended: nothing TIDE leases sits beside the activations at the loss or beside the optimizer step;
    tide/transport/lease.py). Every rank reaches the same points."""
    for name in registry.created_arenas.values():
        route = routes.of_name(name)
        if route is not None and route.holder is not None:
            route.holder.release()


def _release_after_root_forward(module, args, output) -> None:
    if getattr(module._get_fsdp_state(), "_is_root", False):
        release_leases()


def watch_forward(module) -> None:
    """Release the leases when ``module``'s forward ends if it is FSDP's root (a forward hook, registered
    after FSDP's own, so its post-forward reshards have run). Once per module."""
    if module not in registry.forward_hooks:
        registry.forward_hooks[module] = module.register_forward_hook(_release_after_root_forward)


def unwatch_forward(module) -> None:
    handle = registry.forward_hooks.pop(module, None)
    if handle is not None:
        handle.remove()


def release_at_backward_end() -> None:
    """Release the leases when the running backward ends (an autograd final callback, queued after FSDP's
    own, so its last reduce-scatters have been issued); outside backward nothing is queued and the lease
    lasts until the root's next forward ends."""
    task = torch._C._current_graph_task_id()
    if task == -1 or registry.released_in_backward[0] == task:
        return
    registry.released_in_backward[0] = task
    torch.autograd.Variable._execution_engine.queue_callback(release_leases)


def plan_all_gather(arena, comm, facts, world_size: int, inputs: list | None = None) -> tuple[str, int | None]:
    """(how this all-gather uses the arena, its slot): ``bound`` (slot; outputs bound there, zero-copy),
    ``direct`` (outputs allocated as stock does, gathered in place by the op's reference backend: groups
    that are not :func:`bindable` or larger than a slot), ``busy`` (outputs hold every slot: stock),
    ``none`` (no arena). ``comm``, ``facts``: the group's ``TideAllGather`` and ``AllGatherFacts``
    (tide.fsdp.decide; whether it is bindable rests on ``set_reshard_after_forward``, one of the group's
    settings ``tide.fsdp.decide`` keeps its decision for); ``inputs``: its tensor-extension inputs
    (``extensions.pre_all_gather``)."""
    if arena is None:
        return "none", None
    if not bindable(comm, facts.sharded):
        return "direct", None
    sizes = None if inputs is None else tuple((t.numel(), t.dtype) for ins in inputs for t in ins or ())
    key = (sizes, arena.slot_bytes)
    fits = facts.slot_fits.get(key)
    if fits is None:
        fits = facts.slot_fits[key] = slot_layout(facts.fsdp_params, world_size, inputs).slot_bytes <= arena.slot_bytes
    return take_slot(arena) if fits else ("direct", None)


def take_slot(arena) -> tuple[str, int | None]:
    """``("bound", slot)``: a free slot of ``arena`` for a group bound into slots, or ``("busy", None)``."""
    slot = arena.slots.acquire()
    return ("busy", None) if slot is None else ("bound", slot)


def output_specs(fsdp_params, inputs: list | None) -> list[tuple[list[int], list]]:
    """Per param, the (numels, dtypes) of its all-gather outputs (``extensions.output_specs``); fixed for a
    group without tensor extensions (``inputs`` None), so ``tide.fsdp.decide`` keeps them per group."""
    return [extensions.output_specs(p, None if inputs is None else inputs[i]) for i, p in enumerate(fsdp_params)]


def init_outputs(fsdp_params, specs, world_size: int, device: torch.device) -> list[torch.Tensor]:
    """FSDP's all-gather output tensors of every param (created once by its ``init_all_gather_outputs``),
    param-major: one per param, or one per input of an extension's (``specs``: :func:`output_specs`)."""
    outs = []
    for p, (numels, dtypes) in zip(fsdp_params, specs):
        p.init_all_gather_outputs(numels, dtypes, world_size, device)
        outs += p.all_gather_outputs
    return outs


def bind_into_slot(arena, fsdp_params, world_size: int, device: torch.device, slot: int, specs) -> list:
    """FSDP's all-gather output tensors (:func:`init_outputs`), their storages pointed into ``slot`` of the
    arena's held data region (leased on the current stream if none is held), at param-major addresses.

    ``init_all_gather_outputs`` creates the tensors once (the first call allocates them, and binding frees
    that memory); later unshards find them resharded (storage ``resize_(0)``: the slot pointer is dropped,
    nothing freed) and re-bind them instead of ``alloc_all_gather_outputs`` (which would allocate)."""
    outs = init_outputs(fsdp_params, specs, world_size, device)
    arena.bind_outputs(outs, slot, owners=fsdp_params, world_size=world_size)
    return outs


def order_slot_after_stock_reduce(fsdp_params, comm, group, stream) -> None:
    """A stock reduce may read gradients that the Slot-Reuse hooks put in the group's slot: the next
    all-gather into that slot waits for what stock issued on the reduce-scatter stream (it reads the
    gradients there, within the call)."""
    if not (comm is not None and comm.grad_hooks and fsdp_params and group is not None):
        return
    arena = routes.of(group).holder
    own = arena.slots.last_slot(fsdp_params[0]) if arena is not None else None
    if own is not None:
        arena.slots.used(own, stream)
