"""A process group's route: everything TIDE decides about a group once, kept until what it rests on
changes, and carried with every call on the group instead of being asked again.

A route says, for one process group:

- ``ranks``: its global ranks, in group-rank order;
- ``topology``: the nodes they sit on (:mod:`tide.topology`), and so ``multinode``;
- ``arena``: the CUDA transport's arena of its own ranks (one node: ``tide.transport.enable``), or None;
- ``node_arena``: for a group spanning nodes, this rank's node arena (``tide.transport.node_leg``), which
  carries its intra-node legs; ``holder`` is whichever of the two holds its bound all-gather outputs.

Resolving a route only reads: the extension's table of the arena serving each group name, where the ops'
C++ kernels look (csrc/transport/gate.h), is :mod:`tide.transport.serving`'s to write. Routes are kept per
group name, with a
weak reference to the group (a group re-created under the same name gets its own), and are resolved
again after :func:`changed` (an arena enabled or dropped) or when the ranks per node change. The arenas
themselves sit in :mod:`tide.registry`, keyed by ranks (``tide.transport.serving`` makes them); this
module imports nothing of the transport.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch.distributed as dist

from tide import registry, topology
from tide.meta.multinode import Topology


@dataclasses.dataclass(frozen=True)
class Route:
    group_name: str
    ranks: tuple[int, ...]
    topology: Topology | None
    arena: object | None
    node_arena: object | None

    @property
    def multinode(self) -> bool:
        return topology.is_multinode(self.topology)

    @property
    def holder(self):
        """The arena that holds the group's bound all-gather outputs: its own, else its node arena."""
        return self.arena if self.arena is not None else self.node_arena


def changed() -> None:
    """What routes rest on changed (an arena was enabled or dropped): every route is resolved again."""
    registry.route_generation[0] += 1


def of(group: dist.ProcessGroup) -> Route:
    """The route of ``group``."""
    local_size = topology.local_world_size()
    return _kept(group.group_name, local_size, group) or _resolve(group, local_size)


def of_name(group_name: str) -> Route | None:
    """The route of the process group named ``group_name``; None when no group has that name (the op's
    reference backend then raises its error)."""
    kept = _kept(group_name, topology.local_world_size())
    if kept is not None:
        return kept
    try:
        group = dist.distributed_c10d._resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError):
        return None
    return of(group)


def _kept(group_name: str, local_size: int | None, group: dist.ProcessGroup | None = None) -> Route | None:
    """The route kept for ``group_name`` if nothing it rests on changed and its group (``group``, if given)
    is alive."""
    entry = registry.routes.get(group_name)
    if entry is None or entry[1] != (registry.route_generation[0], local_size):
        return None
    held = entry[0]()
    return entry[2] if held is not None and (group is None or held is group) else None


def _resolve(group: dist.ProcessGroup, local_size: int | None) -> Route:
    ranks = tuple(dist.get_process_group_ranks(group))
    route = Route(group.group_name, ranks, topology.of_group(group), registry.arenas.get(ranks),
                  registry.node_arenas.get(ranks))
    registry.routes[group.group_name] = (weakref.ref(group), (registry.route_generation[0], local_size), route)
    return route
