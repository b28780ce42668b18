"""The batches of the copy-engine intra-node leg (``reference_multinode._node_spans``, pushed by
``Arena.push_spans``): planned without a device, checked against the schedule at many (N, L), paces and
layouts. The push itself needs GPUs (tests/cuda/test_multinode_cuda.py)."""
import random

import pytest

from tide.meta.layout import GroupLayout
from tide.meta.multinode import Topology
from tide.ops.reference_multinode import _ag_schedule, _node_spans


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
                batches = _node_spans(shapes, sizes, topo, rank, pace)
                _, steps = _ag_schedule(shapes, sizes, topo, rank, pace)
                assert len(batches) == 1 + sum(leg == "rail" for leg, _, _ in steps)
                mine = [b for spans in batches for b in _bytes(spans)]
                # A rank pushes its rail's rows only: the shards of the ranks with its local index.
                assert {topo.local(owner_of[b]) for b in mine} <= {l}, (rank, batches)
                assert {owner_of[b] for b in _bytes(batches[0])} == {rank}
                for spans, (leg, _, recvs) in zip(batches[1:], [s for s in steps if s[0] == "rail"]):
                    landed = sum(pc.count * sizes[pc.param] for _, pc in recvs)
                    assert sum(spans[1::2]) == landed, (rank, spans, recvs)  # exactly what that step landed
                    assert all(a + m != b for a, m, b in zip(spans[::2], spans[1::2], spans[2::2])), spans  # merged
                pushed += mine
            assert sorted(pushed) == sorted(owner_of), f"node {n}: bytes pushed more than once or never"
