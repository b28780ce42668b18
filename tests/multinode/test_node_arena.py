"""Node arenas without a device: the batches of the copy-engine intra-node all-gather leg
(``tide.multinode.plans.node_spans``, pushed by ``node_leg.push_spans``) checked against the schedule at many
(N, L), paces and layouts; the node-partials plan of the reduce-scatter (``partials_plan``) covering every
contribution once; and the groups a node arena refuses. The pushes and sums themselves need GPUs
(tests/cuda/test_multinode_cuda.py)."""
import random

import pytest

from tide.launch import run_ranks
from tide.meta.layout import GroupLayout
from tide.meta.multinode import Topology
from tide.multinode.plans import ag_schedule, node_spans, partials_plan, rs_schedule


def _bytes(spans):
    return [b for off, n in zip(spans[::2], spans[1::2]) for b in range(off, off + n)]


@pytest.mark.parametrize("nodes,local", [(2, 2), (3, 2), (2, 3), (5, 2), (4, 4), (3, 1)])
def test_each_node_pushes_every_output_byte_once_as_it_lands(nodes, local):
    rng = random.Random(100 * nodes + local)
    topo, W = Topology(nodes, local), nodes * local
    for _ in range(6):
        shapes = tuple((rng.randint(1, 5), rng.randint(1, 9)) for _ in range(rng.randint(1, 4)))
        sizes = tuple(rng.choice((2, 4)) for _ in shapes)
        pace = rng.choice((8, 64, 1 << 20))
        layout = GroupLayout([(W * s[0], *s[1:]) for s in shapes], list(sizes), W)
        owner_of = {}  # every output byte -> the rank whose shard it holds
        for p in layout.params:
            for owner in range(W):
                first = p.slot_offset + owner * p.shard_numel * p.itemsize
                owner_of.update(dict.fromkeys(range(first, first + p.shard_numel * p.itemsize), owner))
        for n in range(nodes):
            pushed = []
            for l in range(local):
                rank = topo.rank(n, l)
                batches = node_spans(shapes, sizes, topo, rank, pace)
                _, steps = ag_schedule(shapes, sizes, topo, rank, pace)
                assert len(batches) == 1 + sum(leg == "rail" for leg, _, _ in steps)
                mine = [b for spans in batches for b in _bytes(spans)]
                # A rank pushes its rail's rows only: the shards of the ranks with its local index.
                assert {topo.local(owner_of[b]) for b in mine} <= {l}, (rank, batches)
                assert {owner_of[b] for b in _bytes(batches[0])} == {rank}
                for spans, (leg, _, recvs) in zip(batches[1:], [s for s in steps if s[0] == "rail"]):
                    landed = []  # the bytes that step received, at their places in the slot
                    for _, pc in recvs:
                        p = layout.params[pc.param]
                        first = p.slot_offset + (pc.owner * p.shard_numel + pc.first) * p.itemsize
                        landed += range(first, first + pc.count * p.itemsize)
                    assert sorted(_bytes(spans)) == sorted(landed), (rank, spans, recvs)  # exactly those
                    assert all(a + m != b for a, m, b in zip(spans[::2], spans[1::2], spans[2::2])), spans  # merged
                pushed += mine
            assert sorted(pushed) == sorted(owner_of), f"node {n}: bytes pushed more than once or never"


@pytest.mark.parametrize("nodes,local", [(2, 2), (3, 2), (2, 3), (4, 4)])
def test_node_partials_plan_sums_every_contribution_once(nodes, local):
    """Per step and node: every contributor packs each local destination's chunks alike (the rounds do not
    depend on the contributor), every chunk of every dest goes to the rank the Latin square names, once,
    and each rank's partials tile its fp32 buffer."""
    rng = random.Random(7 * nodes + local)
    topo, W = Topology(nodes, local), nodes * local
    for _ in range(4):
        shapes = tuple((rng.randint(0, 3 * W + 2), rng.randint(1, 40)) for _ in range(rng.randint(1, 4)))
        sizes = tuple(rng.choice((2, 4)) for _ in shapes)
        key = (shapes, sizes, topo, rng.choice((64, 1 << 20)), rng.choice((256, 1 << 20)))
        layout, plan, steps = rs_schedule(*key)
        entry = rng.choice((256, 4096))
        for k, step in enumerate(steps):
            for n in range(nodes):
                by_rank = [partials_plan(key, k, topo.rank(n, l), entry) for l in range(local)]
                assert all(b[0] == by_rank[0][0] for b in by_rank), "contributors pack differently"
                rounds = by_rank[0][0]
                for j in range(local):
                    _, mine, total = by_rank[j]
                    assert set(mine) == {d for d in range(W) if plan.partial_rank(n, d) == topo.rank(n, j) and step[d]}
                    tiles = sorted(mine.values())
                    assert [off for off, _ in tiles] == [sum(m for _, m in tiles[:i]) for i in range(len(tiles))]
                    assert sum(m for _, m in tiles) == total
                    pieces = sorted((c[0], c[1], c[3]) for rnd in rounds[j] for c in rnd)  # (param, grad elt, n)
                    want = sorted((c.param, c.grad_offset, c.numel) for d in mine for c in step[d])
                    covered = [(p, g + i) for p, g, m in pieces for i in range(m)]
                    assert sorted(covered) == sorted((p, g + i) for p, g, m in want for i in range(m))
                    assert all(c[4] + c[3] * sizes[c[0]] <= entry for rnd in rounds[j] for c in rnd)


def _refused(rank, world_size, local):
    import torch.distributed as dist

    from tide import topology
    from tide.transport import node_leg as nodes

    topology.set_local_world_size(local)
    try:
        nodes.enable(dist.group.WORLD, slot_bytes=1 << 20)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("local", [None, 1])
def test_a_node_arena_needs_several_nodes_of_several_ranks(local):
    # One node (no local world size), or nodes of one rank: refused before anything is created.
    for msg in run_ranks(_refused, 2, local, timeout=120):
        assert msg.startswith("tide.transport.node_leg.enable: ranks [0, 1] are not several nodes of 2 or more"), msg
