"""The multi-node schedule's per-rank plans, pure and cached (no device, no process group): what
:mod:`tide.multinode.schedule` runs each step, and the node arena's share of it
(:mod:`tide.transport.node_leg`).

- :func:`ag_schedule`: this rank's sends and receives per all-gather step;
- :func:`node_spans`: the byte ranges of a node arena's slot that each all-gather step lets this rank push
  to its node's peers (``node_leg.push_spans``);
- :func:`rs_schedule`: the reduce-scatter's steps, each destination's chunks merged where adjacent;
- :func:`partials_plan`: one reduce-scatter step's node-local stage as a TIDE-RS over the node's ranks
  (``node_leg.reduce_partials``).

Plans are pure functions of the shapes, element sizes and topology, and a training step repeats the same
groups: each is built once (about 75 us for an 8-parameter all-gather on the CPU CI machine, 40 for a
reduce-scatter). The cached lists are never mutated.
"""
from __future__ import annotations

import dataclasses
import functools

from tide.meta.layout import GroupLayout, RsChunk
from tide.meta.multinode import MultiNodePlan, Piece, Topology
from tide.meta import plans as layout_plans


@functools.lru_cache(maxsize=256)
def ag_schedule(shard_shapes: tuple, item_sizes: tuple, topology: Topology, rank: int, pace_bytes: int):
    """(shard numels, [(leg, [(dst, piece)], [(src, piece)])]): this rank's sends and receives per step."""
    W = topology.world_size
    layout = GroupLayout([(W * s[0], *s[1:]) for s in shard_shapes], list(item_sizes), W)
    plan = MultiNodePlan(layout, topology, pace_bytes=pace_bytes)
    steps = [("rail", step) for step in plan.ag_rail_steps()] + [("intra", plan.ag_intra_transfers())]
    mine = [(leg, [(t.dst, pc) for t in step if t.src == rank for pc in t.pieces],
             [(t.src, pc) for t in step if t.dst == rank for pc in t.pieces]) for leg, step in steps]
    return [p.shard_numel for p in layout.params], mine


@functools.lru_cache(maxsize=256)
def node_spans(shard_shapes: tuple, item_sizes: tuple, topology: Topology, rank: int, pace_bytes: int) -> list:
    """The batches of the copy-engine intra-node leg (``node_leg.push_spans``): this rank's own shards, then
    the pieces each rail step lands, as flat (byte offset in the slot, bytes) pairs, adjacent ones merged.
    The slot is laid out as ``Arena.bind_outputs`` binds the group's W outputs."""
    W = topology.world_size
    layout = GroupLayout([(W * s[0], *s[1:]) for s in shard_shapes], list(item_sizes), W)

    def spans(pieces) -> list[int]:
        out: list[int] = []
        for pc in pieces:
            p = layout.params[pc.param]
            off, n = p.slot_offset + (pc.owner * p.shard_numel + pc.first) * p.itemsize, pc.count * p.itemsize
            if out and out[-2] + out[-1] == off:
                out[-1] += n
            else:
                out += [off, n]
        return out

    own = [Piece(p.index, rank, 0, p.shard_numel) for p in layout.params if p.shard_numel]
    _, steps = ag_schedule(shard_shapes, item_sizes, topology, rank, pace_bytes)
    return [spans(own)] + [spans([pc for _, pc in recvs]) for leg, _, recvs in steps if leg == "rail"]


@functools.lru_cache(maxsize=256)
def rs_schedule(grad_shapes: tuple, item_sizes: tuple, topology: Topology, rs_chunk_bytes: int, pace_bytes: int):
    """(the group's layout, its plan, the plan's steps with each destination's consecutive chunks of one
    parameter merged into one range: the same elements in the same order, one slice each instead of one
    per chunk, whose host cost set the time of a large reduce-scatter on GPUs)."""
    layout = GroupLayout(list(grad_shapes), list(item_sizes), topology.world_size, rs_chunk_bytes=rs_chunk_bytes)
    plan = MultiNodePlan(layout, topology, pace_bytes=pace_bytes)
    return layout, plan, [{d: _merged(chunks) for d, chunks in step.items()} for step in plan.rs_steps()]


def _merged(chunks: list[RsChunk]) -> list[RsChunk]:
    """``chunks`` with each run of adjacent ones (same parameter, each starting where the last ended) as one."""
    out: list[RsChunk] = []
    for c in chunks:
        last = out[-1] if out else None
        if last is not None and last.param == c.param and last.grad_offset + last.numel == c.grad_offset:
            out[-1] = dataclasses.replace(last, numel=last.numel + c.numel)
        else:
            out.append(c)
    return out


@functools.lru_cache(maxsize=256)
def partials_plan(rs_key: tuple, k: int, rank: int, entry_bytes: int) -> tuple:
    """Step ``k``'s node-local stage as a TIDE-RS over this rank's node (``node_leg.reduce_partials``):
    (rounds per local destination j, this rank's node partials as {dest: (offset, elements)} in one fp32
    buffer, that buffer's elements). Destination j's chunks are those of every dest whose partial j sums
    (the Latin square), in dest order, each at its place in j's buffer; every contributor packs them alike."""
    layout, plan, steps = rs_schedule(*rs_key)
    topo, step = plan.topology, steps[k]
    node, itemsizes = topo.node(rank), [p.itemsize for p in layout.params]
    layout_plans.check_entry_bytes(itemsizes, entry_bytes)
    rounds, mine, total = [], {}, 0
    for j in range(topo.local_size):
        chunks, off = [], 0
        for d in range(topo.world_size):
            if plan.partial_local(node, d) != j or not step[d]:
                continue
            start = off
            for c in step[d]:
                chunks.append(dataclasses.replace(c, shard_offset=off))
                off += c.numel
            if j == topo.local(rank):
                mine[d] = (start, off - start)
        rounds.append(layout_plans.pack_rounds(chunks, itemsizes, entry_bytes))
        if j == topo.local(rank):
            total = off
    return rounds, mine, total
