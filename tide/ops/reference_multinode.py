"""The reference backend's multi-node schedule: TIDE-AG and TIDE-RS step by step as
:class:`tide.meta.multinode.MultiNodePlan` lays them out, with point-to-point sends over the group
(gloo on CPU). It defines the multi-node semantics, the fp32 order included, that a multi-node transport
must match bit for bit.

All-gather: every received piece goes straight to its final address in ``outs``; the rail rounds run
step by step (each at most ``pace_bytes`` per rank), then the intra-node pushes. Every round is one batch
of point-to-point operations (``tide/transport/rails.py``: NCCL for CUDA tensors, gloo for CPU tensors,
host-staged for CUDA tensors on a gloo group). Reduce-scatter, one
parameter at a time: node-local contributions into per-destination staging on the rank that sums the
node's partial, the fp32 partials (local order), the rail rounds, the hand-off on the destination node
and the sum in node order. The staging is per parameter here; the plan's chunks bound it on a transport.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from tide.meta.layout import GroupLayout
from tide.meta.multinode import MultiNodePlan, Piece, Topology
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
                   topology: Topology) -> None:
    W, rank = group.size(), group.rank()
    layout = GroupLayout([tuple(g.shape) for g in grads], [g.element_size() for g in grads], W)
    plan = MultiNodePlan(layout, topology)
    N, L = topology.num_nodes, topology.local_size
    me_node, me_local = topology.node(rank), topology.local(rank)
    mine = [d for d in range(W) if plan.partial_rank(me_node, d) == rank]  # the partials this rank sums
    for grad, shard, p in zip(grads, shard_grads, layout.params):
        g = grad.reshape(-1)

        def rows(d: int) -> slice:
            start, stop = p.rows(d)
            return slice(start * p.row_numel, stop * p.row_numel)

        # 1. node-local contributions to the rank that sums the node's partial for each destination
        staged = {(d, l): g.new_empty(p.real_numel(d)) for d in mine for l in range(L) if l != me_local}
        sends = [(plan.partial_rank(me_node, d), g[rows(d)]) for d in range(W)
                 if plan.partial_rank(me_node, d) != rank and p.real_numel(d)]
        recvs = [(topology.rank(me_node, l), staged[d, l]) for d in mine for l in range(L)
                 if l != me_local and p.real_numel(d)]
        rails.exchange(group, sends, recvs, "intra")
        # 2. fp32 node partials, local order (this rank's own contribution read in place)
        partial = {}
        for d in mine:
            parts = [g[rows(d)] if l == me_local else staged[d, l] for l in range(L)]
            acc = parts[0].to(torch.float32, copy=True)
            for x in parts[1:]:
                acc.add_(x)
            partial[d] = acc
        # 3. rail rounds: one fp32 partial out and one in per round
        landed, sends, recvs = {}, [], []
        for t in range(1, N):
            send_to, dest_sent, recv_from, dest_received = plan.rs_rail_round(t, rank)
            from_node = topology.node(recv_from)
            landed[from_node, dest_received] = torch.empty(p.real_numel(dest_received), dtype=torch.float32,
                                                           device=g.device)
            if p.real_numel(dest_sent):
                sends.append((send_to, partial[dest_sent]))
            if p.real_numel(dest_received):
                recvs.append((recv_from, landed[from_node, dest_received]))
        rails.exchange(group, sends, recvs, "rail")
        # 4. hand-off on the destination's node: the landing rank passes each partial to its destination
        parts = {me_node: partial[rank]}
        sends = [(dest, x) for (n, dest), x in sorted(landed.items()) if dest != rank and x.numel()]
        recvs = []
        for n in range(N):
            if n == me_node:
                continue
            if plan.landing_rank(n, rank) == rank:
                parts[n] = landed[n, rank]
            else:
                parts[n] = torch.empty(p.real_numel(rank), dtype=torch.float32, device=g.device)
                if parts[n].numel():
                    recvs.append((plan.landing_rank(n, rank), parts[n]))
        rails.exchange(group, sends, recvs, "handoff")
        # 5. the destination sums the N partials in node order
        acc = parts[0].clone()
        for n in range(1, N):
            acc.add_(parts[n])
        acc.mul_(scale)
        out, real = shard.view(-1), acc.numel()
        if accumulate:
            out[:real].add_(acc)
        else:
            out[:real].copy_(acc)
            out[real:].zero_()
