"""Which nodes a process group's ranks sit on: the topology the multi-node schedule runs on.

A node is L consecutive global ranks (torchrun's layout): global rank g is on node ``g // L``. L is
:func:`set_local_world_size`'s value if set (``tide.fsdp.enable(..., local_world_size=L)`` sets it),
else torchrun's ``LOCAL_WORLD_SIZE``, else one node holds every rank. Emulated nodes are as real as
real ones here: 4 CPU ranks with ``LOCAL_WORLD_SIZE=2`` are 2 nodes x 2.

A group's ranks (in group order) form a :class:`~tide.meta.multinode.Topology` of N nodes of L' ranks
when every node they touch holds the same number L' of them, consecutively in group order (group rank r
is then local rank r % L' of the group's node r // L'); otherwise the group is irregular (None) and runs
the single-node schedule.
"""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist

from tide import knobs, registry
from tide.meta.multinode import Topology

_local_world_size: int | None = None


def set_local_world_size(local_world_size: int | None, caller: str = "tide.topology.set_local_world_size") -> None:
    """Ranks per node for every group of this process (None: torchrun's ``LOCAL_WORLD_SIZE``). Every rank
    must set the same value (the reference backend's call check compares it). A bad value raises
    ``ValueError`` naming ``caller``."""
    global _local_world_size
    if local_world_size is not None and (isinstance(local_world_size, bool) or not isinstance(local_world_size, int)
                                         or local_world_size < 1):
        raise ValueError(f"{caller}: local_world_size must be an int >= 1 or None, got {local_world_size!r}")
    _local_world_size = local_world_size


def local_world_size() -> int | None:
    """Ranks per node: the value set, else ``LOCAL_WORLD_SIZE``, else None (one node)."""
    if _local_world_size is not None:
        return _local_world_size
    return knobs.get("LOCAL_WORLD_SIZE")


def of_ranks(ranks: Sequence[int], local_size: int | None) -> Topology | None:
    """The topology of a group of global ``ranks`` (group order) with ``local_size`` ranks per node."""
    if not local_size:
        return Topology(1, len(ranks))
    nodes: list[int] = []
    for g in ranks:
        node = g // local_size
        if not nodes or nodes[-1] != node:
            if node in nodes:
                return None  # a node's ranks are not consecutive in group order
            nodes.append(node)
    if len(ranks) % len(nodes):
        return None
    per_node = len(ranks) // len(nodes)
    if any(g // local_size != nodes[i // per_node] for i, g in enumerate(ranks)):
        return None
    return Topology(len(nodes), per_node)


def of_group(group: dist.ProcessGroup) -> Topology | None:
    """The topology of ``group`` (cached per group object, so a group re-created under the same name with
    other ranks gets its own, and per local world size)."""
    local_size = local_world_size()
    per_size = registry.topologies.setdefault(group, {})
    if local_size not in per_size:
        per_size[local_size] = of_ranks(dist.get_process_group_ranks(group), local_size)
    return per_size[local_size]


def is_multinode(topology: Topology | None) -> bool:
    return topology is not None and topology.num_nodes > 1
