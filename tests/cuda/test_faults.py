"""The fault scenarios of bench/fault_scenarios.py on the CUDA transport (skipped without CUDA): ranks
share one GPU, or take one each when there are enough. The process group's timeout is 5 s, and TIDE's is the
group's (as in a real job); every rank but the faulty one ends within 5 + 15 s of the fault (the
watchdog's report and exit, its error raised at the next op, or the group's own timeout), and none
hangs. The stalled-peer test sets ``TIDE_TIMEOUT_S=5`` under a 120 s group timeout instead: only TIDE's
watchdog can end that survivor in time."""
import re
import sys
from pathlib import Path

import pytest

from tests.cuda import ranks
from tide.launch import run_ranks_outcomes
from tide.transport.watchdog import EXIT_CODE

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_scenarios  # noqa: E402

pytestmark = pytest.mark.cuda

TIMEOUT_S = 5
BOUND = TIMEOUT_S + 15


def _run(fn, *args, tmp_path, tide_timeout: bool = False):
    fault_file = str(tmp_path / "fault")
    env, pg_timeout = ({**ranks.ENV, "TIDE_TIMEOUT_S": str(TIMEOUT_S)}, 120) if tide_timeout else (ranks.ENV, TIMEOUT_S)
    outcomes = run_ranks_outcomes(fn, 2, *args, fault_file, device_type="cuda", env=env, timeout=BOUND + 60,
                                  pg_timeout=pg_timeout)
    return outcomes, fault_scenarios.judge(outcomes, fault_file)


def _assert_ends_in_errors(verdict):
    assert verdict["hung"] == [], verdict
    assert verdict["errors"], verdict
    assert verdict["s_to_error"] is not None and verdict["s_to_error"] < BOUND, verdict


def _assert_error_or_report(outcomes, err: str, *, peer_died: bool) -> None:
    """Rank 0 raised (the watchdog's error at its next op, a plan agreement's, or its process group's), or
    the watchdog ended it after writing its report to stderr: what rank 0 issued, and peer 1 named by its
    flag words or, where a launch holds the driver and keeps them unreadable (FSDP2 keeps launching behind
    a stalled all-gather), by the issued board with its process's state."""
    rank0 = outcomes[0]
    if rank0.status != "exited":
        assert rank0.status == "error", rank0
        return
    assert rank0.detail == EXIT_CODE, rank0
    assert "did not complete" in err and "this rank issued" in err, err[-3000:]
    board_line = re.search(r"peer 1 \(global rank 1\), process \d+ \(([^)]*)", err)
    assert board_line, err[-3000:]
    state = board_line.group(1)
    if peer_died:  # gone, a zombie, dead, or still tearing down in the driver (uninterruptible)
        assert state == "gone" or state.startswith(("Z", "X", "D")), err[-3000:]
    else:
        assert state.startswith(("R", "S")), err[-3000:]
    if "is behind" not in err:
        assert "flag words unreadable" in err, err[-3000:]


@pytest.mark.parametrize("scenario", ["dies_in_all_gather", "dies_in_reduce_scatter", "stalls"])
def test_a_peer_killed_or_stalled_during_a_collective(ext, scenario, tmp_path, capfd):
    outcomes, verdict = _run(fault_scenarios.op_sequence, "cuda", scenario, 7, 2, tmp_path=tmp_path)
    _assert_ends_in_errors(verdict)
    _assert_error_or_report(outcomes, capfd.readouterr().err, peer_died=scenario != "stalls")


@pytest.mark.parametrize("scenario", fault_scenarios.STEP_SCENARIOS)
@pytest.mark.parametrize("rs_mode", ["in_place", "slot_reuse"])
def test_a_peer_killed_in_fsdp_training(ext, scenario, rs_mode, tmp_path, capfd):
    outcomes, verdict = _run(fault_scenarios.fsdp_steps, "cuda", scenario, rs_mode, 2, 3, tmp_path=tmp_path)
    _assert_ends_in_errors(verdict)
    _assert_error_or_report(outcomes, capfd.readouterr().err, peer_died=True)


@pytest.mark.parametrize("scenario", ["skips_a_collective", "other_plan"])
def test_a_peer_that_diverges_ends_in_an_error(ext, scenario, tmp_path):
    outcomes, verdict = _run(fault_scenarios.op_sequence, "cuda", scenario, 11, 2, tmp_path=tmp_path)
    _assert_ends_in_errors(verdict)


def test_a_different_first_plan_is_named_and_the_arena_recovers(ext):
    # A deadline below the fault stage's pytest timeout (100 s), so a hang prints the ranks' stacks.
    for o in run_ranks_outcomes(ranks.recover_after_error, 2, device_type="cuda", env=ranks.ENV, timeout=90,
                                pg_timeout=TIMEOUT_S):
        assert o.status == "ok", o
        r = o.detail
        assert "ranks issued different calls" in r["error"] and "(4, 3) float32" in r["error"], r["error"]
        assert "(5, 3) float32" in r["error"], r["error"]
        assert r["after_ok"], r
        sharers = 2 if r["gpus"] < 2 else 1  # ranks whose arenas live on this GPU
        assert r["freed"] >= sharers * r["arena_bytes"] - (16 << 20), r  # the failed arena's memory came back


def test_a_stalled_peer_is_reported_by_the_watchdog(ext, tmp_path, capfd):
    """Rank 1 stops issuing after a plan both ranks know: rank 0's next all-gather waits on flags that never
    come, and only the watchdog can end it. Its report names the op, the group and the lagging flags."""
    outcomes, verdict = _run(ranks.stalled_peer, tmp_path=tmp_path, tide_timeout=True)
    _assert_ends_in_errors(verdict)
    rank0 = outcomes[0]
    assert rank0.status == "exited" and rank0.detail == EXIT_CODE, rank0
    err = capfd.readouterr().err
    assert "tide: all_gather_into_params_ on group" in err and "did not complete" in err, err[-3000:]
    assert "(ranks [0, 1], this rank 0)" in err, err[-3000:]
    assert "peer 1 (global rank 1) is behind: all-gather slot" in err and "(1 behind)" in err, err[-3000:]
    assert f"exits with code {EXIT_CODE}" in err
