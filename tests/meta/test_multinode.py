"""The multi-node schedule (tide/meta/multinode.py), executed symbolically at many (N, L), non-powers of
two included: every all-gather output element written exactly once and only from data its sender
already holds, every gradient contribution summed exactly once in the documented order, rail traffic
balanced, the Latin square valid, staging bounded independently of the model's size."""
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tide.meta.layout import GroupLayout
from tide.meta.multinode import MultiNodePlan, Topology, latin_square_placement

GRID = [(n, l) for n in (1, 2, 3, 4, 5, 8) for l in (1, 2, 3, 4, 8)] + [(7, 6), (9, 2), (2, 7)]


def _layout(W, seed, scale=1, itemsize=2, rs_chunk_bytes=1 << 20):
    rng = random.Random(seed)
    shapes = [(rng.randint(1, 3 * W + 5) * scale, rng.randint(1, 9)) for _ in range(rng.randint(1, 5))]
    shapes.append((rng.randint(0, W),))  # ranks holding only padding, or nothing at all
    return GroupLayout(shapes, [itemsize] * len(shapes), W, rs_chunk_bytes=rs_chunk_bytes)


@pytest.mark.parametrize("num_nodes,local_size", GRID)
@pytest.mark.parametrize("pace_bytes", [7, 64, 1 << 20])
def test_all_gather_writes_every_element_once_from_data_already_there(num_nodes, local_size, pace_bytes):
    topo = Topology(num_nodes, local_size)
    W = topo.world_size
    layout = _layout(W, seed=num_nodes * 100 + local_size)
    plan = MultiNodePlan(layout, topo, pace_bytes=pace_bytes)
    written = {r: [np.zeros(p.out_numel, dtype=np.int64) for p in layout.params] for r in range(W)}
    for r in range(W):  # the own shard is cast into place first
        for p in layout.params:
            written[r][p.index][r * p.shard_numel:(r + 1) * p.shard_numel] += 1
    rail_bytes = np.zeros(W, dtype=np.int64)
    steps = plan.ag_rail_steps()
    for step in steps + [plan.ag_intra_transfers()]:
        for t in step:
            same_rail = topo.local(t.src) == topo.local(t.dst)
            same_node = topo.node(t.src) == topo.node(t.dst)
            assert t.src != t.dst and same_rail != same_node, t  # along a rail, or inside a node
            for pc in t.pieces:
                p = layout.params[pc.param]
                lo = pc.owner * p.shard_numel + pc.first
                hi = lo + pc.count
                assert 0 <= pc.first and pc.first + pc.count <= p.shard_numel
                assert (written[t.src][pc.param][lo:hi] == 1).all(), "a rank sends data it does not hold yet"
            if same_rail and not same_node:
                rail_bytes[t.src] += sum(pc.count * layout.params[pc.param].itemsize for pc in t.pieces)
        for t in step:  # receives land after the step's sends read their sources
            for pc in t.pieces:
                p = layout.params[pc.param]
                lo = pc.owner * p.shard_numel + pc.first
                written[t.dst][pc.param][lo:lo + pc.count] += 1
    for r in range(W):
        for p in layout.params:
            assert (written[r][p.index] == 1).all(), f"rank {r} param {p.index}: not written exactly once"
    # Rails: every rank sends the same rail bytes (shards are equally sized); the paced steps stay within their bound.
    assert len(set(rail_bytes.tolist())) == 1
    for step in steps:
        per_src = {}
        for t in step:
            assert topo.local(t.src) == topo.local(t.dst)
            per_src[t.src] = per_src.get(t.src, 0) + sum(pc.count * layout.params[pc.param].itemsize for pc in t.pieces)
        itemsize = max(p.itemsize for p in layout.params)
        assert all(b <= max(pace_bytes, itemsize) for b in per_src.values()), per_src
        assert len(per_src) == len([t for t in step]), "a rank sends more than one transfer per step"


@pytest.mark.parametrize("num_nodes,local_size", GRID)
def test_reduce_scatter_sums_every_contribution_once_in_node_then_local_order(num_nodes, local_size):
    topo = Topology(num_nodes, local_size)
    W, N, L = topo.world_size, num_nodes, local_size
    plan = MultiNodePlan(_layout(W, seed=N + 31 * L), topo)
    # Node partials: which contributors each (node, dest) partial holds, and where it is summed.
    for d in range(W):
        for n in range(N):
            p = plan.partial_rank(n, d)
            assert topo.node(p) == n, "a partial is summed off its node"
            if n == topo.node(d):
                assert p == d, "the destination's own node sums at the destination"
    flows = list(plan.iter_rs_flows())
    assert len(flows) == W * W
    for src, partial, landing, dest in flows:
        assert topo.node(partial) == topo.node(src)
        assert topo.node(landing) == topo.node(dest)
        assert topo.local(landing) == topo.local(partial), "a partial crosses nodes off its rail"
    # Rail rounds: each round, every rank sends one partial and receives one; the pairs form a permutation
    # of every rail; over the N-1 rounds every (node, dest) partial of another node travels exactly once.
    delivered = {}
    for t in range(1, N):
        targets = []
        for r in range(W):
            send_to, dest_sent, recv_from, dest_received = plan.rs_rail_round(t, r)
            assert topo.local(send_to) == topo.local(r) == topo.local(recv_from)
            assert plan.partial_rank(topo.node(r), dest_sent) == r, "a rank sends a partial it does not hold"
            assert plan.landing_rank(topo.node(r), dest_sent) == send_to
            assert plan.rs_rail_round(t, send_to)[2:] == (r, dest_sent), "send and receive disagree"
            key = (topo.node(r), dest_sent)
            assert key not in delivered
            delivered[key] = send_to
            targets.append(send_to)
        assert sorted(targets) == list(range(W))
    assert set(delivered) == {(n, d) for d in range(W) for n in range(N) if n != topo.node(d)}
    # The fp32 order, rebuilt from the plan: node partials in local order, then nodes in order, equals
    # the documented one, and every contribution appears exactly once.
    for d in range(W):
        order = [[topo.rank(n, l) for l in range(L)] for n in range(N)]
        assert sorted(r for part in order for r in part) == list(range(W))
        assert all(plan.partial_rank(n, d) in part for n, part in enumerate(order))


@pytest.mark.parametrize("num_nodes,local_size", [(2, 2), (3, 4), (5, 3), (8, 8)])
def test_reduce_scatter_staging_does_not_grow_with_the_model(num_nodes, local_size):
    topo = Topology(num_nodes, local_size)
    chunk_bytes = 4096
    W = topo.world_size

    def plan(rows_per_rank):  # a group whose every destination has more than one chunk of rows
        shapes = [(W * rows_per_rank, 64), (W * rows_per_rank // 2 + 3, 128), (7,)]
        return MultiNodePlan(GroupLayout(shapes, [2] * 3, W, rs_chunk_bytes=chunk_bytes), topo)

    small, large = plan(64), plan(64 * 1000)
    for depth in (1, 4):
        s, big = small.rs_staging_elements(depth), large.rs_staging_elements(depth)
        assert s == big, (s, big)
        bound = depth * (local_size + num_nodes) * chunk_bytes // 2
        assert sum(s.values()) <= bound


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8))
def test_latin_square_placement(num_nodes, local_size):
    P = latin_square_placement(num_nodes, local_size)
    L = local_size
    assert len(P) == num_nodes
    for row in P:
        assert sorted(row) == list(range(L))
    for g in range(L):
        column = [P[n][g] for n in range(num_nodes)]
        for n in range(num_nodes):  # any L consecutive nodes enter destination g on distinct GPUs
            window = column[n:n + L]
            assert len(set(window)) == len(window)
        counts = [column.count(x) for x in range(L)]
        assert max(counts) - min(counts) <= 1


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="Topology: num_nodes and local_size must be >= 1"):
        Topology(0, 2)
    with pytest.raises(ValueError, match="the layout has 4 ranks, the topology 3 x 2"):
        MultiNodePlan(GroupLayout([(8,)], [2], 4), Topology(3, 2))
    with pytest.raises(ValueError, match="pace_bytes must be >= 1"):
        MultiNodePlan(GroupLayout([(8,)], [2], 4), Topology(2, 2), pace_bytes=0)
