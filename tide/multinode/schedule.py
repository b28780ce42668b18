"""The multi-node schedule: TIDE-AG and TIDE-RS of a group that spans nodes, step by step as
:class:`tide.meta.multinode.MultiNodePlan` lays them out, with point-to-point sends over the group
(gloo on CPU, NCCL or TIDE's direct rails on GPUs). The ops run it on every backend (the reference
backend's kernels hand such groups here), and it defines the multi-node semantics, the fp32 order included, that a
multi-node transport must match bit for bit.

All-gather: every received piece goes straight to its final address in ``outs``; the rail rounds run
step by step (each at most ``pace_bytes`` per rank), then the intra-node pushes; on GPUs the own shards'
copy runs beside the rails when no cast needs it first. Every round is one batch
of point-to-point operations (``tide/multinode/rails.py``: NCCL for CUDA tensors, gloo for CPU tensors,
host-staged for CUDA tensors on a gloo group). Reduce-scatter: node-local contributions into
per-destination staging on the rank that sums the node's partial, the fp32 partials (local order; with one
rank per node the partial is its own contribution, sent in its dtype), the rail rounds, the hand-off on
the destination node and the sum in node order (every sum on TIDE-RS's summing kernel on GPUs:
``tide/sums.py``), in the plan's steps (``MultiNodePlan.rs_steps``:
``pace_bytes`` of chunks of every destination per step), so the staging is bounded whatever the model's
size.

With a node arena (CUDA, L > 1: ``tide/transport/node_leg.py``, which FSDP creates) the intra-node legs run on
the copy engines instead: an all-gather whose outputs lie in its slots pushes its own rows and then each
rail step's pieces, as the step lands, to the node's peers (``node_leg.push_spans``); a reduce-scatter step's
node partials are a TIDE-RS over the node (``node_leg.reduce_partials``: contributions pushed into the
summing rank's staging ring, summed in local order, so the answers stay bit-exact). Both count
``intra:copy_engine`` in ``tide.stats()["multinode"]``.

The pacing knob and the rails' implementation are agreed per group: :mod:`tide.multinode.settings`.
"""
from __future__ import annotations

import functools
from functools import reduce

import torch
import torch.distributed as dist

from tide import counters, sums
from tide.meta.layout import DEFAULT_RS_CHUNK_BYTES
from tide.meta.multinode import MultiNodePlan, Piece
from tide.multinode import plans, rails, settings
from tide.routes import Route

@functools.cache
def _own_copy_stream(device: int) -> torch.cuda.Stream:
    """The stream an all-gather copies its own shards on, beside the rails (one per device)."""
    return torch.cuda.Stream(device)


def _node_arena(route: Route, tensor: torch.Tensor):
    """The route's node arena (:mod:`tide.transport.node_leg`) for an op on ``tensor``'s device, or None: no
    node arena, a CPU tensor, or CUDA-graph capture (its flags would be captured, not written)."""
    if route.node_arena is None or not tensor.is_cuda or torch.cuda.is_current_stream_capturing():
        return None
    return route.node_arena


def _node_slot(outs, group: dist.ProcessGroup, route: Route):
    """(the node arena, the slot) when ``outs`` are bound in a slot of the route's node arena, else None."""
    node = _node_arena(route, outs[0]) if outs else None
    slot = node.bound_slot(outs, group.size()) if node is not None else None
    return None if slot is None else (node, slot)


def _node_partials(node, rs_key: tuple, k: int, rank: int, flat: list) -> dict:
    """Step ``k``'s node partials of this rank, summed on the node arena ``node`` from its node peers'
    contributions, pushed by copy engine into its staging ring: {dest: fp32 partial}."""
    from tide.transport import node_leg

    rounds, mine, total = plans.partials_plan(rs_key, k, rank, node.entry_bytes)
    out = torch.empty(total, dtype=torch.float32, device=flat[0].device)
    node_leg.reduce_partials(node, (rs_key, k, tuple(g.dtype for g in flat)), flat, out, rounds)
    counters.count_multinode("intra:copy_engine")
    return {d: out[off:off + n] for d, (off, n) in mine.items()}


def all_gather(shards, outs, group: dist.ProcessGroup, route: Route, *, pace: int | None = None) -> None:
    rank, topology = group.rank(), route.topology
    key = (tuple(tuple(s.shape) for s in shards), tuple(o.element_size() for o in outs), topology, rank,
           pace or settings.pace(group, shards[0].device))
    numels, steps = plans.ag_schedule(*key)
    node_slot = _node_slot(outs, group, route)
    if node_slot is not None:  # the node's ranks push each other's pieces by copy engine (node_leg.push_spans)
        current = torch.cuda.current_stream(outs[0].device)
        start, landed = current.record_event(), []
        steps = [step for step in steps if step[0] == "rail"]
    flat = [o.view(-1) for o in outs]
    own = [out[rank * n:(rank + 1) * n] for out, n in zip(flat, numels)]
    sources = [s.reshape(-1) for s in shards]
    # This rank's pieces go out from its shard itself when the shard has the output's dtype, so no send waits
    # for the own copy; on GPUs that copy (SM work) then runs on a stream of its own, beside the rails'
    # transfers (in line it added 100 us to a 256 MiB all-gather of 990). A shard that is cast
    # is sent from its output rows, after the copy.
    as_is = [s.dtype == o.dtype for s, o in zip(shards, outs)]
    beside = flat[0].is_cuda and all(as_is) and not torch.cuda.is_current_stream_capturing()
    if beside:
        # No record_stream for the shards: the caller's stream waits for this copy before the op returns, as
        # if it had run there (a recorded block waits for the allocator to see the side stream pass it).
        current, side = torch.cuda.current_stream(flat[0].device), _own_copy_stream(flat[0].device.index)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            torch._foreach_copy_(own, sources)
    else:
        torch._foreach_copy_(own, sources)  # the only cast; one launch when the dtypes match
    if node_slot is not None:  # the own rows are pushed once written
        landed.append((side if beside else current).record_event())

    def at(piece: Piece, send: bool = False) -> tuple:  # the piece's span (rails.exchange)
        if send and piece.owner == rank and as_is[piece.param]:
            return sources[piece.param], piece.first, piece.count
        return flat[piece.param], piece.owner * numels[piece.param] + piece.first, piece.count

    try:
        for leg, sends, recvs in steps:
            rails.exchange(group, [(dst, at(pc, send=True)) for dst, pc in sends],
                           [(src, at(pc)) for src, pc in recvs], leg)
            if node_slot is not None:
                landed.append(current.record_event())
        if node_slot is not None:
            node, slot = node_slot
            from tide.transport import node_leg

            node_leg.push_spans(node, slot, start, list(zip(landed, plans.node_spans(*key))))
            counters.count_multinode("intra:copy_engine")
    finally:  # also when a step raises: the caller may free the outputs the copy still writes
        if beside:
            current.wait_stream(side)


def reduce_scatter(grads, shard_grads, scale: float, accumulate: bool, group: dist.ProcessGroup,
                   route: Route, *, rs_chunk_bytes: int = DEFAULT_RS_CHUNK_BYTES,
                   pace: int | None = None) -> None:
    rank, topology = group.rank(), route.topology
    key = (tuple(tuple(g.shape) for g in grads), tuple(g.element_size() for g in grads), topology, rs_chunk_bytes,
           pace or settings.pace(group, grads[0].device))
    layout, plan, steps = plans.rs_schedule(*key)
    flat = [g.reshape(-1) for g in grads]
    out = [s.view(-1) for s in shard_grads]
    node = _node_arena(route, flat[0]) if topology.local_size > 1 else None
    for k, step in enumerate(steps):
        partials = _node_partials(node, key, k, rank, flat) if node is not None else None
        _reduce_scatter_step(step, flat, out, scale, accumulate, group, plan, partials)
    if node is not None:  # gradients that Slot-Reuse put in its slots: read once the stream passes here
        node.read_from_slots(grads)
    if not accumulate:
        for pad in layout.pad_ranges(rank):
            out[pad.param][pad.shard_offset:pad.shard_offset + pad.numel].zero_()


def _reduce_scatter_step(step, flat, out, scale: float, accumulate: bool, group: dist.ProcessGroup,
                         plan: MultiNodePlan, partials: dict | None = None) -> None:
    """One step of :meth:`MultiNodePlan.rs_steps`: ``step[d]`` are destination d's chunks in it. Each stage
    moves and sums a destination's chunks of the step as one buffer (one send per peer and destination,
    one sum per destination: ``tide/sums.py``), in the same element order as chunk by chunk.
    ``partials``: this rank's node partials of the step, already summed on its node arena (stages 1 and
    2 by copy engine and TIDE-RS's summing kernel: :func:`_node_partials`)."""
    topology, rank = plan.topology, group.rank()
    L, W = topology.local_size, topology.world_size
    me_node, me_local = topology.node(rank), topology.local(rank)
    mine = [d for d in range(W) if plan.partial_rank(me_node, d) == rank]  # the partials this rank sums
    device = flat[0].device
    sizes = {d: [c.numel for c in step[d]] for d in range(W)}
    numel = {d: sum(sizes[d]) for d in range(W)}
    # What this rank's contribution to d is staged in (any dtype when d has no chunks in this step), and
    # what carries node partials for d: fp32, or with one rank per node (the partial is that rank's own
    # contribution) the gradients' dtype, converted to fp32 where the destination sums (exact): half the
    # rail bytes for bf16.
    grad_dtype = {d: reduce(torch.promote_types, [flat[c.param].dtype for c in step[d]] or [flat[0].dtype])
                  for d in range(W)}
    partial_dtype = grad_dtype if L == 1 else dict.fromkeys(range(W), torch.float32)

    def ranges(d):  # this rank's gradient chunks for destination d, where they lie
        return [flat[c.param][c.grad_offset:c.grad_offset + c.numel] for c in step[d]]

    def contribution(d):
        """Those chunks as one span to send (``rails.exchange``): the gradient's own elements when they are
        one range, else gathered (mixed dtypes promote, which is exact: every sum runs in fp32)."""
        if len(step[d]) == 1:
            c = step[d][0]
            return flat[c.param], c.grad_offset, c.numel
        return rails.whole(torch.cat(ranges(d)))

    def own_terms(d):
        """Those chunks as a sum's own terms, one per chunk: read where they lie when they share d's
        staging dtype, else the gathered contribution's pieces."""
        r = ranges(d)
        return r if all(x.dtype == grad_dtype[d] for x in r) else list(torch.cat(r).split(sizes[d]))

    def empty(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)

    # 1. node-local contributions to the rank that sums the node's partial for each destination, staged as
    # the rows of that sum (local order, this rank's own row left out)
    if partials is None:
        sends = [(plan.partial_rank(me_node, d), contribution(d)) for d in range(W)
                 if plan.partial_rank(me_node, d) != rank and numel[d]]
        staged = {d: empty((L - 1, numel[d]), grad_dtype[d]) for d in mine if numel[d] and L > 1}
        recvs = [(topology.rank(me_node, l), rails.whole(_row(staged[d], l, me_local))) for d in staged
                 for l in range(L) if l != me_local]
        rails.exchange(group, sends, recvs, "intra")
    # 2. node partials in local order (fp32); with L = 1 the partial is this rank's contribution itself,
    # never written to: the gradients stay as autograd left them
    to_send, own_partial = {}, []  # the partials for other ranks, one span each; this rank's, per chunk
    for d in mine:
        if not numel[d]:
            continue
        if L == 1:
            if d == rank:
                own_partial = own_terms(d)
            else:
                to_send[d] = contribution(d)
            continue
        partial = empty(numel[d], torch.float32) if partials is None else partials[d]
        pieces = list(partial.split(sizes[d]))
        if partials is None:
            sums.sum_rows(pieces, staged[d], own_terms(d), me_local)
        if d == rank:
            own_partial = pieces
        else:
            to_send[d] = rails.whole(partial)
    _partials_to_sums(step, out, scale, accumulate, group, plan, to_send, own_partial, numel, partial_dtype)


def _row(rows, index: int, own: int):
    """The row of ``rows`` that stands for term ``index`` of a sum (``own``'s term has no row)."""
    return rows[index - 1 if index > own else index]


def _partials_to_sums(step, out, scale: float, accumulate: bool, group: dist.ProcessGroup, plan: MultiNodePlan,
                      to_send: dict, own_partial: list, numel: dict, partial_dtype: dict) -> None:
    """Stages 3 to 5 of :func:`_reduce_scatter_step`: the node partials over the rails, handed to their
    destinations, and summed there in node order."""
    topology, rank = plan.topology, group.rank()
    N, me_node, device = topology.num_nodes, topology.node(rank), out[0].device

    def empty(shape, dtype):
        return torch.empty(shape, dtype=dtype, device=device)

    # 3. rail rounds: one destination's node partials out and one's in per round; those for this rank land
    # in the rows of its final sum (node order, its own node's row left out)
    parts = empty((N - 1, numel[rank]), partial_dtype[rank])
    landed, sends, recvs = {}, [], []
    for t in range(1, N):
        send_to, dest_sent, recv_from, dest_received = plan.rs_rail_round(t, rank)
        n = topology.node(recv_from)
        landed[n, dest_received] = (_row(parts, n, me_node) if dest_received == rank
                                    else empty(numel[dest_received], partial_dtype[dest_received]))
        if numel[dest_sent]:
            sends.append((send_to, to_send[dest_sent]))
        if numel[dest_received]:
            recvs.append((recv_from, rails.whole(landed[n, dest_received])))
    rails.exchange(group, sends, recvs, "rail")
    # 4. hand-off on the destination's node: the landing rank passes each partial to its destination
    sends = [(dest, rails.whole(buf)) for (n, dest), buf in sorted(landed.items(), key=lambda kv: kv[0])
             if dest != rank and buf.numel()]
    recvs = [(plan.landing_rank(n, rank), rails.whole(_row(parts, n, me_node))) for n in range(N)
             if n != me_node and plan.landing_rank(n, rank) != rank and numel[rank]]
    rails.exchange(group, sends, recvs, "handoff")
    # 5. the destination sums the N partials in node order, scales, and writes (or adds) each chunk
    if numel[rank]:
        dsts = [out[c.param][c.shard_offset:c.shard_offset + c.numel] for c in step[rank]]
        sums.sum_rows(dsts, parts, own_partial, me_node, scale, accumulate)
