"""The multi-node schedule of TIDE-AG and TIDE-RS: who sends what to whom, in which round, on which rail,
into which address, and in which fp32 order (pure Python, device-free; docs/design.md "Across nodes").

A group of W = N*L ranks forms N nodes of L ranks: rank r is local rank ``r % L`` of node ``r // L``,
and rail l is the N ranks of local rank l. Rails connect nodes (one NIC per GPU); inside a node every
GPU reaches every other (NVLink).

All-gather (rank (n, l), shards of c_i rows; every piece lands at its final address
``out_i + owner * c_i * row_i`` on every rank and is written there exactly once):

1. its own shard is cast into its final rows;
2. rail rounds k = 0 .. ceil(log2 N) - 1 (recursive doubling in Bruck's form, so any N works): with
   d = 2^k, send to node (n - d) mod N the shards of rail l's ranks on nodes n, n+1, ..., n+m-1 (mod N),
   m = min(d, N - d), and receive those of nodes n+d, ..., n+d+m-1 from node (n + d) mod N. After the
   rounds rank (n, l) holds the shards of all N ranks of its rail. Pacing: a round is split into steps
   of at most ``pace_bytes`` per rank;
3. intra-node: every piece of rail l that rank (n, l) holds (its own and each one received) is pushed to
   the node's other L - 1 ranks, at the same final address.

Reduce-scatter (destination d = (m, l_d); its rows of every gradient, in chunks of ``rs_chunk_bytes``):

1. intra-node: on node n, the contributions of (n, 0), ..., (n, L-1) to d go to the rank that holds
   node n's partial for d, (n, j) with j = ``partial_local(n, d)``: l_d on d's own node, else the
   Latin-square placement ``(l_d + n) mod L``;
2. node partial: (n, j) sums them in fp32 in local order: P_n[d] = ((g_(n,0) + g_(n,1)) + ...) + g_(n,L-1);
3. rail rounds t = 1 .. N - 1: (n, j) sends the fp32 partial for destination ((n + t) mod N, (j - n) mod L)
   to ((n + t) mod N, j), and receives one from ((n - t) mod N, j): every round is a permutation of every
   rail, and every rank sends one partial per round;
4. the partial lands on d's node on rank (m, (l_d + n) mod L), which hands it to d (intra-node);
5. d sums in node order: out_d = scale * (((P_0[d] + P_1[d]) + ...) + P_(N-1)[d]).

With N = 1 or L = 1 this order is the single-node one (all W contributions in rank order). With L = 1 a
node partial is one rank's contribution: it crosses the rail in the gradients' own dtype and becomes fp32
where d sums (exact), half the rail bytes of fp32 for bf16 gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from tide.meta.layout import GroupLayout

# 128 MiB: every step costs the host a fixed share (measured on 2 x H200 as 2 x 1 emulated: a 256 MiB all-gather in 1.45
# ms against 3.4 at 8 MiB, a reduce-scatter in 3.6 against 9.8; the 8B FSDP2 step at 1K tokens/GPU +5 % over
# stock against +38 % at 32 MiB). The staging per step grows with it (docs/design.md, "Across nodes").
DEFAULT_PACE_BYTES = 128 << 20


def latin_square_placement(num_nodes: int, local_size: int) -> tuple[tuple[int, ...], ...]:
    """``P[n][l_d]``: the local rank of node n that computes node n's partial for a destination of local
    rank l_d on another node, and whose rail carries it: ``(l_d + n) mod L``. Each row is a permutation
    (a node spreads its partials over all L rails), and in every column the L values of any L
    consecutive nodes are distinct (the partials of up to L nodes for one destination arrive on L
    different ranks of its node). With N == L it is a Latin square."""
    if num_nodes < 1 or local_size < 1:
        raise ValueError(f"latin_square_placement: num_nodes and local_size must be >= 1, got {num_nodes}, "
                         f"{local_size}")
    return tuple(tuple((g + n) % local_size for g in range(local_size)) for n in range(num_nodes))


@dataclass(frozen=True)
class Topology:
    """N nodes of L ranks; rank ``r`` is local rank ``r % L`` of node ``r // L``."""

    num_nodes: int
    local_size: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.local_size < 1:
            raise ValueError(f"Topology: num_nodes and local_size must be >= 1, got {self.num_nodes}, "
                             f"{self.local_size}")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_size

    def node(self, rank: int) -> int:
        return rank // self.local_size

    def local(self, rank: int) -> int:
        return rank % self.local_size

    def rank(self, node: int, local: int) -> int:
        return (node % self.num_nodes) * self.local_size + local % self.local_size


@dataclass(frozen=True)
class Piece:
    """``count`` elements from element ``first`` of rank ``owner``'s shard of param ``param``: it sits at
    element ``owner * shard_numel + first`` of the param's all-gather output on every rank."""

    param: int
    owner: int
    first: int
    count: int


@dataclass(frozen=True)
class Transfer:
    """``src`` sends ``pieces`` to ``dst`` (all-gather: from and into their final addresses)."""

    src: int
    dst: int
    pieces: tuple[Piece, ...]


class MultiNodePlan:
    """The multi-node schedule of one param group (``layout``) on ``topology``.

    Arguments:
        layout: the group's :class:`GroupLayout` (its ``world_size`` must be N*L; its ``rs_chunk_bytes``
            bounds every reduce-scatter chunk).
        topology: N nodes of L ranks.
        pace_bytes: the pacing knob: all-gather rail bytes a rank sends per step, and reduce-scatter
            gradient bytes of every destination per step (:meth:`rs_steps`).
    """

    def __init__(self, layout: GroupLayout, topology: Topology, *, pace_bytes: int = DEFAULT_PACE_BYTES) -> None:
        if layout.world_size != topology.world_size:
            raise ValueError(f"MultiNodePlan: the layout has {layout.world_size} ranks, the topology "
                             f"{topology.num_nodes} x {topology.local_size}")
        if pace_bytes < 1:
            raise ValueError(f"MultiNodePlan: pace_bytes must be >= 1, got {pace_bytes}")
        self.layout, self.topology, self.pace_bytes = layout, topology, pace_bytes
        self.latin = latin_square_placement(topology.num_nodes, topology.local_size)

    # -------------------------------------------------------------------------------- all-gather
    def _shard_pieces(self, owner: int) -> list[Piece]:
        return [Piece(p.index, owner, 0, p.shard_numel) for p in self.layout.params if p.shard_numel]

    def rail_round_sources(self, k: int, node: int) -> list[int]:
        """Nodes whose rail shards node ``node`` sends in round ``k`` (to node ``node - 2^k``)."""
        N, d = self.topology.num_nodes, 1 << k
        return [(node + i) % N for i in range(min(d, N - d))]

    def rail_rounds(self) -> int:
        return (self.topology.num_nodes - 1).bit_length()

    def _paced(self, pieces: list[Piece]) -> list[list[Piece]]:
        """``pieces`` cut into steps of at most ``pace_bytes`` (a piece may be split across steps)."""
        steps, step, room = [], [], self.pace_bytes
        for piece in pieces:
            size = self.layout.params[piece.param].itemsize
            first, left = piece.first, piece.count
            while left:
                n = min(left, max(1, room // size))
                step.append(Piece(piece.param, piece.owner, first, n))
                first, left, room = first + n, left - n, room - n * size
                if room < size:
                    steps.append(step)
                    step, room = [], self.pace_bytes
        if step:
            steps.append(step)
        return steps

    def ag_rail_steps(self) -> list[list[Transfer]]:
        """The rail phase, step by step: in each step every rank sends at most ``pace_bytes`` (one
        transfer) and receives one. Steps of one round follow each other; rounds in order."""
        topo = self.topology
        out = []
        for k in range(self.rail_rounds()):
            per_rank = {}
            for r in range(topo.world_size):
                n, l = topo.node(r), topo.local(r)
                owners = [topo.rank(src, l) for src in self.rail_round_sources(k, n)]
                per_rank[r] = self._paced([pc for o in owners for pc in self._shard_pieces(o)])
            for s in range(max(len(v) for v in per_rank.values())):
                out.append([Transfer(r, topo.rank(topo.node(r) - (1 << k), topo.local(r)), tuple(steps[s]))
                            for r, steps in per_rank.items() if s < len(steps)])
        return out

    def ag_intra_transfers(self) -> list[Transfer]:
        """The intra-node phase: rank (n, l) pushes its rail's N shards to each other rank of node n."""
        topo, out = self.topology, []
        for r in range(topo.world_size):
            n, l = topo.node(r), topo.local(r)
            pieces = tuple(pc for m in range(topo.num_nodes) for pc in self._shard_pieces(topo.rank(m, l)))
            out += [Transfer(r, topo.rank(n, j), pieces) for j in range(topo.local_size) if j != l and pieces]
        return out

    # -------------------------------------------------------------------------------- reduce-scatter
    def partial_local(self, node: int, dest: int) -> int:
        """The local rank of ``node`` that sums node ``node``'s contributions to ``dest``."""
        topo = self.topology
        if topo.node(dest) == node:
            return topo.local(dest)
        return self.latin[node][topo.local(dest)]

    def partial_rank(self, node: int, dest: int) -> int:
        return self.topology.rank(node, self.partial_local(node, dest))

    def landing_rank(self, node: int, dest: int) -> int:
        """The rank of ``dest``'s node where node ``node``'s partial for ``dest`` arrives (the rail end)."""
        return self.topology.rank(self.topology.node(dest), self.partial_local(node, dest))

    def rs_rail_round(self, t: int, rank: int) -> tuple[int, int, int, int]:
        """Round ``t`` (1 .. N-1) for ``rank`` = (n, j): ``(send_to, dest_sent, recv_from, dest_received)``:
        the fp32 partial for ``dest_sent`` goes to ``send_to``, the one for ``dest_received`` comes from
        ``recv_from``."""
        topo = self.topology
        n, j, L = topo.node(rank), topo.local(rank), topo.local_size
        to_node, from_node = (n + t) % topo.num_nodes, (n - t) % topo.num_nodes
        dest_sent = topo.rank(to_node, (j - n) % L)
        dest_received = topo.rank(n, (j - from_node) % L)
        return topo.rank(to_node, j), dest_sent, topo.rank(from_node, j), dest_received

    def iter_rs_flows(self) -> Iterator[tuple[int, int, int, int]]:
        """Every (contributor, partial rank, landing rank, dest): the path of one contribution to ``dest``."""
        topo = self.topology
        for dest in range(topo.world_size):
            for src in range(topo.world_size):
                n = topo.node(src)
                yield src, self.partial_rank(n, dest), self.landing_rank(n, dest), dest

    def rs_chunks_per_step(self) -> int:
        """Chunks of every destination one reduce-scatter step carries: as many as fit in ``pace_bytes``."""
        return max(1, self.pace_bytes // self.layout.rs_chunk_bytes)

    def rs_steps(self) -> list[dict[int, list]]:
        """The reduce-scatter, step by step: in step k, chunks ``k R .. (k + 1) R - 1`` of every destination
        (``GroupLayout.rs_chunks``, R = :meth:`rs_chunks_per_step`) go through the five stages. A rank's
        staging per step is then at most R (L - 1) N chunks of contributions (it sums N destinations'
        node partials), R (N - 1) partials arriving on its rail and R (N - 1) handed to it (fp32; in the
        gradients' dtype when L = 1), whatever the model's size."""
        R, W = self.rs_chunks_per_step(), self.topology.world_size
        chunks = [self.layout.rs_chunks(d) for d in range(W)]
        steps = max((len(c) + R - 1) // R for c in chunks) if chunks else 0
        return [{d: chunks[d][k * R:(k + 1) * R] for d in range(W)} for k in range(steps)]

    def rs_staging_elements(self, ring_depth: int) -> dict[str, int]:
        """Staging a rank needs with ``ring_depth`` chunks in flight per stage, in elements of the largest
        chunk: bf16 contributions of its L - 1 node peers for the partials it computes, fp32 partials
        arriving on its rail, and fp32 partials handed to it on its node (at most N - 1 per chunk)."""
        topo = self.topology
        chunk = max((c.numel for d in range(topo.world_size) for c in self.layout.rs_chunks(d)), default=0)
        return {"contributions": ring_depth * (topo.local_size - 1) * chunk,
                "rail_partials": ring_depth * chunk if topo.num_nodes > 1 else 0,
                "handed_partials": ring_depth * (topo.num_nodes - 1) * chunk}
