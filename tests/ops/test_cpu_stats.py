"""``tide.stats()["ops"]`` counts CPU calls as it counts CUDA ones: every mutating op call, the functional
pair's included (they call the mutating ops), as ``<op>:reference`` (``tide_multinode`` for a group
spanning nodes); a call refused by its checks counts nothing."""
import torch

from tide.launch import run_ranks


def _calls(rank, world_size):
    import torch.distributed as dist

    import tide

    tide.reset_stats()
    shard = torch.full((3, 2), float(rank))
    out = torch.empty(3 * world_size, 2)
    tide.ops.all_gather_into_params([shard], [out])
    tide.ops.reduce_scatter_params([out], [torch.empty(3, 2)])
    gathered = tide.ops.all_gather([shard, shard])
    tide.ops.reduce_scatter(gathered)
    counted = dict(tide.stats()["ops"])
    try:  # refused on every rank: outs has the wrong shape
        tide.ops.all_gather_into_params([shard], [torch.empty(5, 2)], dist.group.WORLD)
    except ValueError:
        pass
    return counted, tide.stats()["ops"]


def _multinode_call(rank, world_size):
    import tide

    tide.reset_stats()
    out = torch.empty(world_size, 2)
    tide.ops.all_gather_into_params([torch.ones(1, 2)], [out])
    return tide.stats()["ops"]


def test_cpu_calls_are_counted():
    expected = {"all_gather_into_params_:reference": 2, "reduce_scatter_params_:reference": 2}
    for counted, after_refusal in run_ranks(_calls, 2, timeout=120):
        assert counted == expected and after_refusal == expected, (counted, after_refusal)


def test_cpu_calls_of_a_group_spanning_nodes_count_the_multinode_schedule():
    results = run_ranks(_multinode_call, 2, env={"LOCAL_WORLD_SIZE": "1"}, timeout=120)
    assert results == [{"all_gather_into_params_:tide_multinode": 1}] * 2, results
