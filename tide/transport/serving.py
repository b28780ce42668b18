"""Which arena serves a process group: made, found and dropped here for every asker (the ops, ``tide.fsdp``,
the multi-node schedule); the arenas themselves sit in :mod:`tide.registry`, one per set of ranks.

- :func:`enable` / :func:`disable` / :func:`get`: the arena of the group's own ranks (every group over the same
  ranks, in the same order, finds the same one);
- :func:`node_arena`: the node arena of a group spanning nodes, which carries its intra-node legs
  (:mod:`tide.transport.node_leg` makes it);
- :func:`of`: the group's own arena, else its node arena: the one that holds its bound all-gather outputs.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from tide import registry, topology
from tide.meta.layout import GroupLayout
from tide.transport.arena import Arena


def group_ranks(group_name: str) -> tuple:
    """The global ranks of the process group ``group_name``, in group-rank order (resolved once)."""
    ranks = registry.group_ranks.get(group_name)
    if ranks is None:
        group = dist.distributed_c10d._resolve_process_group(group_name)
        ranks = registry.group_ranks[group_name] = tuple(dist.get_process_group_ranks(group))
    return ranks


def enable(group: dist.ProcessGroup, *, slot_bytes: int | None = None, layouts: Sequence[GroupLayout] = (),
           **kwargs) -> Arena:
    """Create (collectively) the arena of ``group``'s ranks; its slots fit ``slot_bytes`` or the largest of
    ``layouts`` (neither: an arena without slots). Every process group over the same ranks then uses it.
    Must be called by every rank of ``group``, outside CUDA-graph capture; ranks that already have an
    arena are refused (``disable`` it first), on every rank alike."""
    need = max([slot_bytes or 0] + [l.slot_bytes for l in layouts])
    ranks = group_ranks(group.group_name)
    topo = topology.of_group(group)
    if topology.is_multinode(topo):
        raise ValueError(f"tide.transport.enable: ranks {list(ranks)} span {topo.num_nodes} nodes of {topo.local_size} "
                         "(tide.topology); the CUDA transport serves one node, and multi-node groups run the "
                         "reference backend's multi-node schedule")
    if ranks in registry.arenas:
        raise ValueError(f"tide.transport.enable: ranks {list(ranks)} already have an arena; "
                         "tide.transport.disable it first")
    arena = Arena(group, need, **kwargs)
    registry.arenas[ranks] = arena
    return arena


def disable(group_name: str) -> None:
    """Release the arena of ``group_name``'s ranks (for every group over them); their ops take the stock
    path afterwards."""
    arena = registry.arenas.pop(group_ranks(group_name), None)
    if arena is not None:
        arena.close()


def get(group_name: str) -> Arena | None:
    """The arena of ``group_name``'s ranks, or None (also for a name that is no process group: the
    reference backend then raises the op's error)."""
    return _by_ranks(registry.arenas, group_name)


def node_arena(group_name: str) -> Arena | None:
    """The node arena of the multi-node group ``group_name`` on this rank, or None."""
    return _by_ranks(registry.node_arenas, group_name)


def _by_ranks(table: dict, group_name: str) -> Arena | None:
    if not table:  # no lookup of the group's ranks while TIDE has no arena
        return None
    try:
        return table.get(group_ranks(group_name))
    except (RuntimeError, ValueError, KeyError):
        return None


def arenas() -> list[Arena]:
    """Every arena of this process, one per set of ranks (node arenas included)."""
    return list(registry.arenas.values())


def of(group_name: str) -> Arena | None:
    """The arena that holds ``group_name``'s bound all-gather outputs: the group's own (one node), else its
    node arena (several nodes), else None."""
    return get(group_name) or node_arena(group_name)
