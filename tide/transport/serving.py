"""Which arena serves a process group, answered in one place for every asker (``tide.fsdp``, the multi-node
schedule, the tests); the arenas themselves sit in :mod:`tide.registry`.

- :func:`tide.transport.arena.get`: the arena of the group's own ranks (every group over the same ranks, in
  the same order, finds the same one);
- :func:`node_arena`: the node arena of a group spanning nodes, which carries its intra-node legs
  (:mod:`tide.transport.node_leg` makes it);
- :func:`of`: the group's own arena, else its node arena: the one that holds its bound all-gather outputs.
"""
from __future__ import annotations

from tide import registry
from tide.transport import arena as _arena


def node_arena(group_name: str) -> _arena.Arena | None:
    """The node arena of the multi-node group ``group_name`` on this rank, or None."""
    if not registry.node_arenas:
        return None
    try:
        return registry.node_arenas.get(_arena.group_ranks(group_name))
    except (RuntimeError, ValueError, KeyError):
        return None


def of(group_name: str) -> _arena.Arena | None:
    """The arena that holds ``group_name``'s bound all-gather outputs: the group's own (one node), else its
    node arena (several nodes), else None."""
    return _arena.get(group_name) or node_arena(group_name)
