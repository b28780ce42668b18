"""Node arenas and the intra-node legs they carry: the copy-engine legs of multi-node collectives (L > 1
ranks per node; the copies and their flags are csrc/transport/node_leg.cpp).

The L ranks of one node of a multi-node group (:mod:`tide.topology`) are one NVLink domain, so they share
an arena (:class:`tide.transport.arena.Arena`, over a gloo process group of those ranks) whose slots hold
outputs of the whole multi-node group: param-major, every one of its W ranks' rows
(``Arena.bind_outputs(..., world_size=W)``). A multi-node all-gather into outputs bound there
(:mod:`tide.multinode.schedule`) receives its rail pieces straight into the slot and pushes its own
shards, then each rail round's pieces as that round lands, to the node's peers by copy engine
(:func:`push_spans`), under TIDE-AG's free/ready flags; outputs outside a slot keep the point-to-point
leg. A multi-node reduce-scatter step sums its node partials as a TIDE-RS over the node's ranks
(:func:`reduce_partials`): each rank pushes its contributions into the summing rank's staging ring.

    enable(group, slot_bytes=...) -> Arena    (collective over ``group``'s ranks, once per set of ranks)
    disable(group_name)

Which arena serves a group (its own, else its node arena) is its route's to say (:mod:`tide.routes`).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tide import registry, routes
from tide.transport import issue, serving
from tide.transport.arena import Arena
from tide.transport.reduce_scatter import native_rounds

OP_AG, OP_RS = "all_gather_into_params_", "reduce_scatter_params_"


def enable(group: dist.ProcessGroup, *, slot_bytes: int, **kwargs) -> Arena:
    """Create the node arena of multi-node ``group`` on this rank's node, its slots ``slot_bytes`` each (the
    largest bound layout of ``group``'s W ranks). Every rank of ``group`` calls it at the same point; the
    ranks of one node rendezvous together. ``kwargs`` go to :class:`~tide.transport.arena.Arena`."""
    route = routes.of(group)
    ranks, topo = route.ranks, route.topology
    if not route.multinode or topo.local_size < 2:
        raise ValueError(f"tide.transport.node_leg.enable: ranks {list(ranks)} are not several nodes of 2 or more "
                         f"ranks (topology {topo}); a node arena serves the intra-node legs of such a group")
    if ranks in registry.node_arenas:
        raise ValueError(f"tide.transport.node_leg.enable: ranks {list(ranks)} already have a node arena; "
                         "disable it first")
    node = topo.node(group.rank())
    node_ranks = ranks[node * topo.local_size:(node + 1) * topo.local_size]
    node_group = registry.node_groups.get(node_ranks)
    if node_group is None:  # only the node's ranks take part (no other rank of the job reaches this call)
        node_group = registry.node_groups[node_ranks] = dist.new_group(list(node_ranks), backend="gloo",
                                                                       use_local_synchronization=True)
    if node_group.rank() != topo.local(group.rank()):  # the plans index the node's ranks by local rank
        raise RuntimeError(f"tide.transport.node_leg.enable: rank {node_group.rank()} of the node group is not local "
                           f"rank {topo.local(group.rank())}")
    arena = serving.enable(node_group, slot_bytes=slot_bytes, **kwargs)
    registry.node_arenas[ranks] = arena
    routes.changed()
    return arena


def disable(group_name: str) -> None:
    """Release the node arena of ``group_name`` (if any); its all-gathers take the point-to-point leg after."""
    route = routes.of_name(group_name)
    arena = registry.node_arenas.pop(route.ranks, None) if route is not None else None
    if arena is not None:
        serving.disable(arena.group_name)


def push_spans(arena, slot: int, start: torch.cuda.Event,
               batches: Sequence[tuple[torch.cuda.Event, Sequence[int]]]) -> None:
    """The copy-engine intra-node leg of a multi-node all-gather whose outputs are bound in slot ``slot``
    of the node arena: each batch's ``(byte offset in the slot, bytes)`` pairs (flat) of this rank's slot
    go to every peer's slot at the same offsets once its event has fired; ``start`` was recorded on the
    current stream as the op began. TIDE-AG's flags surround it, so the current stream then waits until
    every peer's pieces are here."""
    arena.region()
    issue.watched(arena, OP_AG, arena.native.push_spans, issue.capturing(), slot=int(slot), start=start.cuda_event,
                  landed=[event.cuda_event for event, _ in batches], spans=[list(spans) for _, spans in batches])


def reduce_partials(arena, key, grads: Sequence[torch.Tensor], out: torch.Tensor, rounds: list) -> None:
    """The node-local stage of a multi-node reduce-scatter step on the node arena: a TIDE-RS whose
    destinations are the node's ranks, each summing the node partials the Latin square gives it into
    ``out`` (fp32, unscaled, local rank order). ``key`` names the plan, given the first time as
    ``rounds`` (``rounds[d][j]``: destination d's j-th round of :class:`tide.meta.plans.RsPiece`, packed
    for ``entry_bytes``)."""
    plan = arena.plans.get(("partials", key))
    if plan is None:
        # Node peers that reach a new plan with different gradients raise here, naming the call, rather
        # than wait on each other's rounds.
        issue.agree_plan(arena, f"{OP_RS} (node partials)", (grads,))
        rs = arena.ext.RsPlan(rounds=native_rounds(arena.ext, rounds), pads=[], grad_dtype=[g.dtype for g in grads])
        plan = arena.plans["partials", key] = arena.native.partials_plan(plan=rs)
    arena.region()
    issue.watched(arena, OP_RS, arena.native.reduce_partials, issue.capturing(), plan=plan, grads=grads, out=out)
