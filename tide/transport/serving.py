"""The arenas of this process: made and dropped here, one per set of ranks (:mod:`tide.registry` holds
them), for every maker (the ops' users, ``tide.fsdp``, :mod:`tide.transport.node_leg` for node arenas).
Which arena serves a process group is its route's to say (:mod:`tide.routes`: resolved once per group):
every change here starts a new generation of routes.

- :func:`enable` / :func:`disable`: the arena of a group's own ranks (every group over the same ranks, in
  the same order, uses the same one);
- :func:`bind`: a group name bound to its route's arena in the extension, where the ops' C++ kernels find
  it (csrc/transport/gate.h). Only this module writes that table: the enabling group's name at
  :func:`enable`, any other name over the same ranks at its first op call (the gate's ``no_arena``,
  tide/ops/cuda.py), every name of an arena unbound at :func:`disable`;
- :func:`get`: the arena of a group name's ranks (its route's), or None;
- :func:`arenas`: every arena of this process.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from tide import registry, routes
from tide.meta.layout import GroupLayout
from tide.transport.arena import Arena


def enable(group: dist.ProcessGroup, *, slot_bytes: int | None = None, layouts: Sequence[GroupLayout] = (),
           **kwargs) -> Arena:
    """Create (collectively) the arena of ``group``'s ranks; its slots fit ``slot_bytes`` or the largest of
    ``layouts`` (neither: an arena without slots). Every process group over the same ranks then uses it.
    Must be called by every rank of ``group``, outside CUDA-graph capture; ranks that already have an
    arena are refused (``disable`` it first), on every rank alike."""
    need = max([slot_bytes or 0] + [l.slot_bytes for l in layouts])
    route = routes.of(group)
    ranks, topo = route.ranks, route.topology
    if route.multinode:
        raise ValueError(f"tide.transport.enable: ranks {list(ranks)} span {topo.num_nodes} nodes of {topo.local_size} "
                         "(tide.topology); the CUDA transport serves one node, and multi-node groups run the "
                         "reference backend's multi-node schedule")
    if ranks in registry.arenas:
        raise ValueError(f"tide.transport.enable: ranks {list(ranks)} already have an arena; "
                         "tide.transport.disable it first")
    arena = Arena(group, need, **kwargs)
    registry.arenas[ranks] = arena
    routes.changed()
    bind(routes.of(group))
    return arena


def bind(route: routes.Route) -> bool:
    """Bind ``route``'s group name to its arena in the extension (gate.h's table); False when no arena of
    its own ranks serves it."""
    arena = route.arena
    if arena is None:
        return False
    arena.ext.bind_group(group_name=route.group_name, arena=arena.native, world_size=len(route.ranks))
    return True


def disable(group_name: str) -> None:
    """Release the arena of ``group_name``'s ranks (for every group over them); their ops take the stock
    path afterwards."""
    route = routes.of_name(group_name)
    arena = registry.arenas.pop(route.ranks, None) if route is not None else None
    if arena is not None:
        routes.changed()
        arena.ext.forget_arena(arena=arena.native)  # every group name bound to it
        arena.close()


def get(group_name: str) -> Arena | None:
    """The arena of ``group_name``'s ranks, or None (also for a name that is no process group: the
    reference backend then raises the op's error)."""
    route = routes.of_name(group_name)
    return route.arena if route is not None else None


def arenas() -> list[Arena]:
    """Every arena of this process, one per set of ranks (node arenas included)."""
    return list(registry.arenas.values())
