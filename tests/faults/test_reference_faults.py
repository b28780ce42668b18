"""A dead or diverged peer ends in an error within the timeout, never a hang: the reference backend on CPU
(gloo, a 10 s process-group timeout), through the ops and through FSDP2 (scenarios: bench/fault_scenarios.py;
the same ones run on the CUDA transport in tests/cuda/test_faults.py)."""
import sys
from pathlib import Path

import pytest

from tide.launch import run_ranks_outcomes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_scenarios  # noqa: E402

PG_TIMEOUT = 10.0
BOUND = PG_TIMEOUT + 15.0  # every other rank ends within the timeout + 15 s of the fault
DEADLINE = BOUND + 60  # spawning and importing take the rest


def _run(fn, *args, tmp_path):
    fault_file = str(tmp_path / "fault")
    outcomes = run_ranks_outcomes(fn, 2, *args, fault_file, timeout=DEADLINE, pg_timeout=PG_TIMEOUT)
    return outcomes, fault_scenarios.judge(outcomes, fault_file)


def _assert_ends_in_errors(verdict, message=None):
    assert verdict["hung"] == [], verdict
    assert verdict["errors"], verdict
    assert verdict["s_to_error"] is not None and verdict["s_to_error"] < BOUND, verdict


@pytest.mark.parametrize("scenario", ["dies_in_all_gather", "dies_in_reduce_scatter", "stalls"])
def test_a_peer_killed_or_stalled_during_a_collective(scenario, tmp_path):
    outcomes, verdict = _run(fault_scenarios.op_sequence, "cpu", scenario, 7, 2, tmp_path=tmp_path)
    _assert_ends_in_errors(verdict)
    assert verdict["faulty"].status == "exited" and verdict["faulty"].detail == fault_scenarios.DIED


@pytest.mark.parametrize("scenario", fault_scenarios.STEP_SCENARIOS)
@pytest.mark.parametrize("rs_mode", ["in_place", "slot_reuse"])
def test_a_peer_killed_in_fsdp_training(scenario, rs_mode, tmp_path):
    outcomes, verdict = _run(fault_scenarios.fsdp_steps, "cpu", scenario, rs_mode, 2, 3, tmp_path=tmp_path)
    _assert_ends_in_errors(verdict)
    assert verdict["faulty"].status == "exited" and verdict["faulty"].detail == fault_scenarios.DIED


@pytest.mark.parametrize("scenario", ["skips_a_collective", "other_plan"])
def test_a_peer_that_diverges_gets_an_error_naming_the_calls(scenario, tmp_path):
    outcomes, verdict = _run(fault_scenarios.op_sequence, "cpu", scenario, 11, 2, tmp_path=tmp_path)
    _assert_ends_in_errors(verdict)
    for o in outcomes:  # the check catches it on every rank, the diverging one too
        assert o.status == "error" and "issued different calls" in o.detail, o


def _recover(rank, world_size):
    import torch
    import torch.distributed as dist

    import tide  # noqa: F401

    first = dist.new_group(backend="gloo")
    rows = 5 if rank == 1 else 4
    try:
        torch.ops.tide.all_gather_into_params_([torch.randn(rows, 3)], [torch.empty(2 * rows, 3)], 2, first.group_name)
        error = "no error"
    except RuntimeError as e:
        error = str(e)
    dist.destroy_process_group(first)
    second = dist.new_group(backend="gloo")
    shard = torch.full((4, 3), float(rank))
    out = torch.empty(8, 3)
    torch.ops.tide.all_gather_into_params_([shard], [out], 2, second.group_name)
    return {"error": error, "after_ok": bool((out[:4] == 0).all() and (out[4:] == 1).all())}


def test_after_a_desync_error_the_group_is_destroyed_and_a_fresh_one_works():
    for o in run_ranks_outcomes(_recover, 2, timeout=DEADLINE, pg_timeout=PG_TIMEOUT):
        assert o.status == "ok", o
        assert "issued different calls" in o.detail["error"] and o.detail["after_ok"], o.detail
