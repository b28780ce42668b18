"""A dead or diverged peer ends in an error within the timeout, never a hang: the reference backend on CPU
(gloo, a 10 s process-group timeout), through the ops and through FSDP2. The CUDA transport's scenarios
are issue 11's tests/cuda/test_faults.py (not written yet)."""
import os

import pytest
import torch
import torch.distributed as dist

from tide.launch import run_ranks_outcomes

PG_TIMEOUT = 10.0
BOUND = PG_TIMEOUT + 15.0  # the survivor's process ends within the timeout + 15 s (plus its start-up)


def _ops(rank, world_size, scenario):
    import tide  # noqa: F401

    name = dist.group.WORLD.group_name
    rows = 5 if (scenario == "other_plan" and rank == 1) else 4
    shards, outs = [torch.randn(rows, 3)], [torch.empty(rows * world_size, 3)]
    grads, shard_grads = [torch.randn(4 * world_size, 3)], [torch.empty(4, 3)]
    torch.ops.tide.all_gather_into_params_([torch.randn(4, 3)], [torch.empty(4 * world_size, 3)], world_size, name)
    if scenario in ("dies_in_all_gather", "dies_in_reduce_scatter") and rank == 1:
        os._exit(3)
    if scenario != "dies_in_reduce_scatter" and not (scenario == "skips_a_collective" and rank == 1):
        torch.ops.tide.all_gather_into_params_(shards, outs, world_size, name)
    torch.ops.tide.reduce_scatter_params_(grads, shard_grads, 1.0, False, world_size, name)
    return "finished"


def _steps(rank, world_size, rs_mode):
    from tide.models import PRESETS
    from tide.train import fsdp_model, train_step

    cfg = PRESETS["tiny"]
    model = fsdp_model(cfg, device="cpu", use_tide=True, rs_mode=rs_mode)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, optim, cfg, 0, rank)
    if rank == 1:
        os._exit(3)  # dies between steps
    train_step(model, optim, cfg, 1, rank)
    return "finished"


def _ends_in_errors(outcomes, dead=None, message=None):
    for o in outcomes:
        if o.rank == dead:
            assert o.status == "exited" and o.detail == 3, o
            continue
        assert o.status == "error", o  # never "hung", never "finished" with mismatched data
        assert o.seconds < BOUND + 30, o  # spawning and importing take the rest
        if message is not None:
            assert message in o.detail, o.detail


@pytest.mark.parametrize("scenario", ["dies_in_all_gather", "dies_in_reduce_scatter"])
def test_a_peer_killed_during_a_collective(scenario):
    _ends_in_errors(run_ranks_outcomes(_ops, 2, scenario, timeout=BOUND + 60, pg_timeout=PG_TIMEOUT), dead=1)


@pytest.mark.parametrize("rs_mode", ["in_place", "slot_reuse"])
def test_a_peer_killed_between_steps(rs_mode):
    _ends_in_errors(run_ranks_outcomes(_steps, 2, rs_mode, timeout=BOUND + 60, pg_timeout=PG_TIMEOUT), dead=1)


def test_a_peer_that_skips_a_collective():
    outcomes = run_ranks_outcomes(_ops, 2, "skips_a_collective", timeout=BOUND + 60, pg_timeout=PG_TIMEOUT)
    _ends_in_errors(outcomes, message="issued different calls")


def test_a_peer_that_issues_another_plan():
    outcomes = run_ranks_outcomes(_ops, 2, "other_plan", timeout=BOUND + 60, pg_timeout=PG_TIMEOUT)
    _ends_in_errors(outcomes, message="issued different calls")
