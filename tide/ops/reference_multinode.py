"""The reference backend's multi-node schedule: TIDE-AG and TIDE-RS step by step as
:class:`tide.meta.multinode.MultiNodePlan` lays them out, with point-to-point sends over the group
(gloo on CPU). It defines the multi-node semantics, the fp32 order included, that a multi-node transport
must match bit for bit.

All-gather: every received piece goes straight to its final address in ``outs``; the rail rounds run
step by step (each at most ``pace_bytes`` per rank), then the intra-node pushes. Every round is one batch
of point-to-point operations (``tide/transport/rails.py``: NCCL for CUDA tensors, gloo for CPU tensors,
host-staged for CUDA tensors on a gloo group). Reduce-scatter: node-local contributions into
per-destination staging on the rank that sums the node's partial, the fp32 partials (local order), the
rail rounds, the hand-off on the destination node and the sum in node order, in the plan's steps
(``MultiNodePlan.rs_steps``: ``pace_bytes`` of chunks of every destination per step), so the staging is
bounded whatever the model's size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tide.meta.layout import DEFAULT_RS_CHUNK_BYTES, GroupLayout
from tide.meta.multinode import DEFAULT_PACE_BYTES, MultiNodePlan, Piece, Topology
from tide.transport import rails


def all_gather(shards, outs, group: dist.ProcessGroup, topology: Topology) -> None:
    W, rank = group.size(), group.rank()
    layout = GroupLayout([(W * s.shape[0], *s.shape[1:]) for s in shards],
                         [o.element_size() for o in outs], W)
    plan = MultiNodePlan(layout, topology)
    flat = [o.view(-1) for o in outs]
    for shard, out, p in zip(shards, flat, layout.params):
        out[rank * p.shard_numel:(rank + 1) * p.shard_numel].copy_(shard.reshape(-1))  # the only cast

    def at(piece: Piece) -> torch.Tensor:
        start = piece.owner * layout.params[piece.param].shard_numel + piece.first
        return flat[piece.param][start:start + piece.count]

    steps = [("rail", step) for step in plan.ag_rail_steps()] + [("intra", plan.ag_intra_transfers())]
    for leg, step in steps:
        sends = [(t.dst, at(pc)) for t in step if t.src == rank for pc in t.pieces]
        recvs = [(t.src, at(pc)) for t in step if t.dst == rank for pc in t.pieces]
        rails.exchange(group, sends, recvs, leg)


def reduce_scatter(grads, shard_grads, scale: float, accumulate: bool, group: dist.ProcessGroup,
                   topology: Topology, *, rs_chunk_bytes: int = DEFAULT_RS_CHUNK_BYTES,
                   pace_bytes: int = DEFAULT_PACE_BYTES) -> None:
    W, rank = group.size(), group.rank()
    layout = GroupLayout([tuple(g.shape) for g in grads], [g.element_size() for g in grads], W,
                         rs_chunk_bytes=rs_chunk_bytes)
    plan = MultiNodePlan(layout, topology, pace_bytes=pace_bytes)
    flat = [g.reshape(-1) for g in grads]
    out = [s.view(-1) for s in shard_grads]
    for step in plan.rs_steps():
        _reduce_scatter_step(step, flat, out, scale, accumulate, group, plan)
    if not accumulate:
        for pad in layout.pad_ranges(rank):
            out[pad.param][pad.shard_offset:pad.shard_offset + pad.numel].zero_()


def _reduce_scatter_step(step, flat, out, scale: float, accumulate: bool, group: dist.ProcessGroup,
                         plan: MultiNodePlan) -> None:
    """One step of :meth:`MultiNodePlan.rs_steps`: ``step[d]`` are destination d's chunks in it. A
    destination's fp32 partials of the step are one buffer (one send per rail and hand-off peer)."""
    topology, rank = plan.topology, group.rank()
    N, L, W = topology.num_nodes, topology.local_size, topology.world_size
    me_node, me_local = topology.node(rank), topology.local(rank)
    mine = [d for d in range(W) if plan.partial_rank(me_node, d) == rank]  # the partials this rank sums
    device = flat[0].device

    def src(c):
        return flat[c.param][c.grad_offset:c.grad_offset + c.numel]

    def partials(d):
        """An fp32 buffer for destination d's chunks of the step, and its view of each chunk."""
        buf = torch.empty(sum(c.numel for c in step[d]), dtype=torch.float32, device=device)
        return buf, list(buf.split([c.numel for c in step[d]]))

    # 1. node-local contributions to the rank that sums the node's partial for each destination
    staged = {(d, l): [flat[c.param].new_empty(c.numel) for c in step[d]] for d in mine for l in range(L) if l != me_local}
    sends = [(plan.partial_rank(me_node, d), src(c)) for d in range(W) if plan.partial_rank(me_node, d) != rank
             for c in step[d]]
    recvs = [(topology.rank(me_node, l), x) for d in mine for l in range(L) if l != me_local for x in staged[d, l]]
    rails.exchange(group, sends, recvs, "intra")
    # 2. fp32 node partials, local order (this rank's own contribution read in place)
    partial = {}
    for d in mine:
        partial[d] = partials(d)
        for i, c in enumerate(step[d]):
            acc = partial[d][1][i]
            acc.copy_(src(c) if me_local == 0 else staged[d, 0][i])  # the exact conversion to fp32
            for l in range(1, L):
                acc.add_(src(c) if l == me_local else staged[d, l][i])
    # 3. rail rounds: one destination's fp32 partials out and one's in per round
    landed, sends, recvs = {}, [], []
    for t in range(1, N):
        send_to, dest_sent, recv_from, dest_received = plan.rs_rail_round(t, rank)
        landed[topology.node(recv_from), dest_received] = partials(dest_received)
        if step[dest_sent]:
            sends.append((send_to, partial[dest_sent][0]))
        if step[dest_received]:
            recvs.append((recv_from, landed[topology.node(recv_from), dest_received][0]))
    rails.exchange(group, sends, recvs, "rail")
    # 4. hand-off on the destination's node: the landing rank passes each partial to its destination
    parts = {me_node: partial[rank]}
    sends = [(dest, buf) for (n, dest), (buf, _) in sorted(landed.items(), key=lambda kv: kv[0])
             if dest != rank and buf.numel()]
    recvs = []
    for n in range(N):
        if n == me_node:
            continue
        if plan.landing_rank(n, rank) == rank:
            parts[n] = landed[n, rank]
        else:
            parts[n] = partials(rank)
            if step[rank]:
                recvs.append((plan.landing_rank(n, rank), parts[n][0]))
    rails.exchange(group, sends, recvs, "handoff")
    # 5. the destination sums the N partials in node order
    for i, c in enumerate(step[rank]):
        acc = parts[0][1][i].clone()
        for n in range(1, N):
            acc.add_(parts[n][1][i])
        acc.mul_(scale)
        dst = out[c.param][c.shard_offset:c.shard_offset + c.numel]
        if accumulate:
            dst.add_(acc)
        else:
            dst.copy_(acc)
