"""Ranks agree on each new plan through the process group's store before it is used: a different call
or a missing peer is an error naming it (2 CPU ranks, the real default store)."""
import torch

from tide.launch import run_ranks_outcomes
from tide.agreement import agree, call_desc, exchange, first_difference


def _agree(rank, world_size, scenario):
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    shapes = [(4, 3), (7,)]
    if scenario == "other_layout" and rank == 1:
        shapes = [(4, 3), (8,)]
    desc = call_desc("all_gather_into_params_", ([torch.empty(s, dtype=torch.bfloat16) for s in shapes],))
    if scenario == "missing" and rank == 1:
        return "skipped"
    agree(store, "tide/test/plan1", rank, world_size, desc, 3.0, "tide.all_gather_into_params_ (plan #1)")
    return "agreed"


def test_same_calls_agree():
    assert [o.detail for o in run_ranks_outcomes(_agree, 2, "same", timeout=120)] == ["agreed", "agreed"]


def test_a_different_layout_is_named_on_every_rank():
    for o in run_ranks_outcomes(_agree, 2, "other_layout", timeout=120):
        assert o.status == "error", o
        assert "tide.all_gather_into_params_ (plan #1): ranks issued different calls" in o.detail
        assert "(7,) bfloat16" in o.detail and "(8,) bfloat16" in o.detail


def test_a_peer_that_never_gets_there_is_named_after_the_timeout():
    rank0, rank1 = run_ranks_outcomes(_agree, 2, "missing", timeout=120)
    assert rank1.detail == "skipped"
    assert rank0.status == "error" and "rank(s) [1] did not reach this call within 3 s" in rank0.detail, rank0


def _exchange(rank, world_size):
    """Three exchanges in a row (as the leases of tide/transport/lease.py make them): every rank gets every
    rank's value of each, in rank order."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    return [exchange(store, f"tide/test/lease{n}", rank, world_size, f"r{rank}n{n}", 30.0, "lease") for n in (1, 2, 3)]


def test_exchange_returns_every_ranks_value_in_rank_order():
    for o in run_ranks_outcomes(_exchange, 3, timeout=120):
        assert o.detail == [[f"r{p}n{n}" for p in range(3)] for n in (1, 2, 3)], o


def test_call_desc_and_first_difference():
    a = call_desc("reduce_scatter_params_", ([torch.empty(2, 3)], [torch.empty(1, 3)]), (True,))
    assert a == "reduce_scatter_params_((2, 3) float32; (1, 3) float32; True)"
    b = a.replace("(1, 3)", "(1, 4)")
    assert "(1, 3) float32" in first_difference(a, b).split(" vs ")[0]
    assert "(1, 4) float32" in first_difference(a, b).split(" vs ")[1]
    long_a, long_b = "x" * 500 + "A" + "y" * 500, "x" * 500 + "B" + "y" * 500
    diff = first_difference(long_a, long_b)
    assert "A" in diff and "B" in diff and len(diff) < 200


def _new_plans(rank, world_size, other_layout: bool):
    """The transport's plan agreement (``issue.agree_plan``) on an arena stand-in with the real store: two plans
    that agree, then a third whose layout differs on rank 1."""
    import types

    import torch.distributed as dist

    from tide.transport import issue

    arena = types.SimpleNamespace(store=dist.distributed_c10d._get_default_store(), store_prefix="tide/test/arena",
                                  rank=rank, world_size=world_size, timeout_s=30.0, label="'g'", plans_agreed=0,
                                  symmetric_bytes=0, data_bytes=0)
    for rows in (4, 5):
        issue.agree_plan(arena, "all_gather_into_params_", ([torch.empty(rows, 3, dtype=torch.bfloat16)],))
    rows = 7 if other_layout and rank == 1 else 6
    issue.agree_plan(arena, "all_gather_into_params_", ([torch.empty(rows, 3, dtype=torch.bfloat16)],))
    return arena.plans_agreed


def test_new_plans_are_numbered_and_a_different_one_is_named():
    assert [o.detail for o in run_ranks_outcomes(_new_plans, 2, False, timeout=120)] == [3, 3]
    for o in run_ranks_outcomes(_new_plans, 2, True, timeout=120):
        assert o.status == "error", o
        assert "tide.all_gather_into_params_ (group 'g', new plan #3): ranks issued different calls" in o.detail
        assert "(6, 3) bfloat16" in o.detail and "(7, 3) bfloat16" in o.detail
