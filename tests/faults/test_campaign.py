"""The CPU fault campaign (reference backend, gloo) at 2, 3 and 4 ranks: one run per world size, each of
rounds of random faults on fresh groups (one rank's bad input, a stall, a skipped call, a skipped step, a
skipped last call, two threads on a group; ``campaign`` of bench/fault_rounds.py), ending in a random kill.
Every survivor ends in a TIDE error within timeout + 15 s of each fault, no result is silently wrong, no rank
hangs. The seeds are fixed, so the faults are the same every run (their timing is not)."""
import sys
from pathlib import Path

import pytest

from tide.launch import run_ranks_outcomes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_rounds  # noqa: E402

TIMEOUT_S = 2.0  # TIDE_TIMEOUT_S: the bound a stalled peer's survivors wait
BOUND_S = TIMEOUT_S + 15
ROUNDS = 8  # every soft fault once, two more at random, then the kill


@pytest.mark.parametrize("world_size, seed", [(2, 1), (3, 2), (4, 3)])
def test_every_survivor_ends_in_a_tide_error_and_no_result_is_wrong(world_size, seed, tmp_path):
    fault_file = str(tmp_path / "fault")
    outcomes = run_ranks_outcomes(fault_rounds.campaign, world_size, seed, ROUNDS, fault_file, timeout=150,
                                  pg_timeout=30, env={"TIDE_TIMEOUT_S": str(TIMEOUT_S)})
    verdict = fault_rounds.judge_campaign(outcomes, fault_file, BOUND_S)
    assert verdict["hung"] == [] and verdict["failed_ranks"] == [], verdict
    assert verdict["rounds"] == ROUNDS + 1, verdict
    assert verdict["wrong"] == [], verdict
    assert verdict["late"] == [], verdict
    assert verdict["not_tide"] == [], verdict
    print(f"campaign W={world_size} seed={seed}: {verdict['rounds']} rounds, worst {verdict['worst_s']:.2f} s "
          f"from a fault to a survivor's error")
