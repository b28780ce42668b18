"""Node arenas: the copy-engine intra-node legs of multi-node collectives (L > 1 ranks per node).

The L ranks of one node of a multi-node group (:mod:`tide.topology`) are one NVLink domain, so they share
an arena (:class:`tide.transport.arena.Arena`, over a gloo process group of those ranks) whose slots hold
outputs of the whole multi-node group: param-major, every one of its W ranks' rows
(``Arena.bind_outputs(..., world_size=W)``). A multi-node all-gather into outputs bound there
(``tide/ops/reference_multinode.py``) receives its rail pieces straight into the slot and pushes its own
shards, then each rail round's pieces as that round lands, to the node's peers by copy engine
(``Arena.push_spans``), under TIDE-AG's free/ready flags; outputs outside a slot keep the point-to-point
leg. A multi-node reduce-scatter step sums its node partials as a TIDE-RS over the node's ranks
(``Arena.reduce_partials``): each rank pushes its contributions into the summing rank's staging ring.

    enable(group, slot_bytes=...) -> Arena    (collective over ``group``'s ranks, once per set of ranks)
    get(group_name) -> Arena | None           (the node arena of a multi-node group)
    serving(group_name) -> Arena | None       (a group's own arena, else its node arena)
    disable(group_name)
"""
from __future__ import annotations

import torch.distributed as dist

from tide import topology
from tide.transport import arena as _arena

_NODE_GROUPS: dict[tuple, dist.ProcessGroup] = {}  # a node's global ranks -> their gloo group (made once)
_NODE_ARENAS: dict[tuple, _arena.Arena] = {}  # a multi-node group's global ranks -> this rank's node arena


def enable(group: dist.ProcessGroup, *, slot_bytes: int, **kwargs) -> _arena.Arena:
    """Create the node arena of multi-node ``group`` on this rank's node, its slots ``slot_bytes`` each (the
    largest bound layout of ``group``'s W ranks). Every rank of ``group`` calls it at the same point; the
    ranks of one node rendezvous together. ``kwargs`` go to :class:`~tide.transport.arena.Arena`."""
    ranks = _arena.group_ranks(group.group_name)
    topo = topology.of_group(group)
    if not topology.is_multinode(topo) or topo.local_size < 2:
        raise ValueError(f"tide.transport.nodes.enable: ranks {list(ranks)} are not several nodes of 2 or more "
                         f"ranks (topology {topo}); a node arena serves the intra-node legs of such a group")
    if ranks in _NODE_ARENAS:
        raise ValueError(f"tide.transport.nodes.enable: ranks {list(ranks)} already have a node arena; disable it first")
    node = topo.node(group.rank())
    node_ranks = ranks[node * topo.local_size:(node + 1) * topo.local_size]
    node_group = _NODE_GROUPS.get(node_ranks)
    if node_group is None:  # only the node's ranks take part (no other rank of the job reaches this call)
        node_group = _NODE_GROUPS[node_ranks] = dist.new_group(list(node_ranks), backend="gloo",
                                                               use_local_synchronization=True)
    if node_group.rank() != topo.local(group.rank()):  # the plans index the node's ranks by local rank
        raise RuntimeError(f"tide.transport.nodes.enable: rank {node_group.rank()} of the node group is not local "
                           f"rank {topo.local(group.rank())}")
    arena = _arena.enable(node_group, slot_bytes=slot_bytes, **kwargs)
    _NODE_ARENAS[ranks] = arena
    return arena


def get(group_name: str) -> _arena.Arena | None:
    """The node arena of the multi-node group ``group_name`` on this rank, or None."""
    if not _NODE_ARENAS:
        return None
    try:
        return _NODE_ARENAS.get(_arena.group_ranks(group_name))
    except (RuntimeError, ValueError, KeyError):
        return None


def serving(group_name: str) -> _arena.Arena | None:
    """The arena that holds ``group_name``'s bound all-gather outputs: the group's own (one node), else its
    node arena (several nodes), else None."""
    return _arena.get(group_name) or get(group_name)


def disable(group_name: str) -> None:
    """Release the node arena of ``group_name`` (if any); its all-gathers take the point-to-point leg after."""
    arena = _NODE_ARENAS.pop(_arena.group_ranks(group_name), None)
    if arena is not None:
        _arena.disable(arena.group_name)
