"""Which nodes a group's ranks form (tide/topology.py): pure cases, the override and the environment."""
import pytest

from tide import topology
from tide.meta.multinode import Topology


@pytest.mark.parametrize("ranks,local_size,want", [
    ([0, 1, 2, 3], 2, Topology(2, 2)),
    ([0, 1, 2, 3, 4, 5], 2, Topology(3, 2)),
    ([0, 1, 2, 3, 4, 5], 3, Topology(2, 3)),
    ([0, 1], 1, Topology(2, 1)),            # 2 GPUs as 2 nodes x 1
    ([0, 2], 2, Topology(2, 1)),            # one rank of each node
    ([2, 3, 0, 1], 2, Topology(2, 2)),      # nodes in any order, each node's ranks together
    ([0, 1, 2, 3], 4, Topology(1, 4)),
    ([0, 1, 2, 3], None, Topology(1, 4)),   # no LOCAL_WORLD_SIZE: one node
    ([0, 1, 2], 2, None),                   # 2 + 1: irregular
    ([0, 2, 1, 3], 2, None),                # a node's ranks apart in group order
])
def test_of_ranks(ranks, local_size, want):
    assert topology.of_ranks(ranks, local_size) == want


def test_local_world_size_from_override_then_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert topology.local_world_size() == 4
    topology.set_local_world_size(2)
    try:
        assert topology.local_world_size() == 2
    finally:
        topology.set_local_world_size(None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert topology.local_world_size() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE must be an integer >= 1, got 'two'"):
        topology.local_world_size()


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_set_local_world_size_names_the_argument(bad):
    with pytest.raises(ValueError, match="set_local_world_size: local_world_size must be an int >= 1 or None"):
        topology.set_local_world_size(bad)


def _enable_multinode_arena(rank, world_size):
    import torch.distributed as dist

    from tide import transport

    try:
        transport.enable(dist.group.WORLD, slot_bytes=1 << 20)
    except ValueError as e:
        return str(e)
    return "enabled"


def test_the_cuda_transport_refuses_a_group_spanning_nodes():
    from tide.launch import run_ranks

    for msg in run_ranks(_enable_multinode_arena, 2, env={"LOCAL_WORLD_SIZE": "1"}, timeout=120):
        assert msg.startswith("tide.transport.enable: ranks [0, 1] span 2 nodes of 1"), msg


def _enable_with(rank, world_size, value):
    import tide.fsdp
    from tide.models import PRESETS
    from tide.train import fsdp_model

    model = fsdp_model(PRESETS["tiny"], device="cpu")
    try:
        tide.fsdp.enable(model, local_world_size=value)
    except ValueError as e:
        return str(e)
    return f"accepted; local_world_size() == {topology.local_world_size()}"


@pytest.mark.parametrize("value,want", [
    (0, "tide.fsdp.enable: local_world_size must be an int >= 1 or None, got 0"),
    ("2", "tide.fsdp.enable: local_world_size must be an int >= 1 or None, got '2'"),
    (2, "accepted; local_world_size() == 2"),
])
def test_enable_takes_or_refuses_local_world_size(value, want):
    from tide.launch import run_ranks

    assert run_ranks(_enable_with, 1, value, timeout=120) == [want]


def test_a_group_recreated_under_the_same_name_with_other_ranks_gets_its_own_topology(monkeypatch):
    class Group:  # what of_group reads of a process group: its name, its ranks (looked up below)
        group_name = "7"

        def __init__(self, ranks):
            self.ranks = ranks

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(topology.dist, "get_process_group_ranks", lambda group: group.ranks)
    first, second = Group([0, 1, 2, 3]), Group([0, 1])
    assert topology.of_group(first) == Topology(2, 2)
    assert topology.of_group(second) == Topology(1, 2)
    assert topology.of_group(first) == Topology(2, 2)
