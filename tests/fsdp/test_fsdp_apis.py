"""FSDP2's public APIs that set a param group's comms work with TIDE in either order (CPU, gloo, 2 ranks):
``enable`` leaves FSDP2's comms in place (tide/fsdp/decide.py). FSDP2's own comm classes keep the group on
TIDE, bit for bit like stock; a user's own comm is used, with the collective on stock FSDP2
(``stock:custom_comm``) and a warning once per group."""
import pytest

from tests.fsdp import workers
from tide.launch import run_ranks

STEPS = 2
GROUPS = 3  # the tiny model: 2 blocks and the root
# Per step: each group gathers in forward, the 2 resharded blocks again in backward; each group reduces.
# tide.stats() covers the trained steps; the user comms count the extra backward too.
ALL_GATHERS, REDUCES = (GROUPS + 2) * STEPS, GROUPS * STEPS
USER_CALLS = {"all_gather": ALL_GATHERS // STEPS * (STEPS + 1), "reduce_scatter": REDUCES // STEPS * (STEPS + 1)}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(workers.fsdp_apis, 2, STEPS, timeout=300)


@pytest.mark.parametrize("case, comms", [
    ("allocate_from_pg", ["ProcessGroupAllocAllGather/ProcessGroupAllocReduceScatter"]),
    ("allocate_from_pg_off", ["DefaultAllGather/DefaultReduceScatter"]),
    ("separate_reduce_scatter_group", ["DefaultAllGather/DefaultReduceScatter"]),
    ("reduce_scatter_max_input_buffers", ["DefaultAllGather/DefaultReduceScatter"]),
])
def test_fsdp2_comm_settings_stay_on_tide(runs, case, comms):
    if case not in runs[0]:
        pytest.skip(f"this torch's FSDPModule has no API for {case}")
    for rank, r in enumerate(runs):
        for order in ("tide_after", "tide_before"):
            run = r[case][order]
            workers.assert_like_stock(rank, run, r[case]["stock"], exact=True)
            assert run["stats"] == {"all_gather": {"tide": ALL_GATHERS}, "reduce_scatter": {"tide": REDUCES}}, order
            assert run["comms"] == r[case]["stock"]["comms"] == comms
            assert run["warnings"] == []


@pytest.mark.parametrize("case, collective, index, setter", [
    ("custom_all_gather", "all-gather", 0, "set_custom_all_gather"),
    ("custom_reduce_scatter", "reduce-scatter", 1, "set_custom_reduce_scatter"),
])
def test_a_user_comm_is_used_on_stock_with_a_warning_per_group(runs, case, collective, index, setter):
    kind, other = ("all_gather", "reduce_scatter") if index == 0 else ("reduce_scatter", "all_gather")
    calls = {"all_gather": ALL_GATHERS, "reduce_scatter": REDUCES}
    for rank, r in enumerate(runs):
        stock = r[case]["stock"]
        assert stock["user_comm_calls"][index] == USER_CALLS[kind]
        for order in ("tide_after", "tide_before"):
            run = r[case][order]
            workers.assert_like_stock(rank, run, stock, exact=True)
            assert run["user_comm_calls"] == stock["user_comm_calls"], order
            assert run["stats"] == {kind: {"stock:custom_comm": calls[kind]}, other: {"tide": calls[other]}}, run
            warned = [w for w in run["warnings"] if "custom comm" in w]
            assert len(warned) == GROUPS and all(f"the {collective} of FSDP module" in w and setter in w
                                                 for w in warned), run["warnings"]


def test_symmetric_memory_after_enable_gets_as_far_as_on_stock(runs):
    """Its comms need NCCL: on gloo FSDP2 raises creating them, enabled or not (not, as before, "cannot call
    set_symm_mem() when all gather comm is custom")."""
    if not runs[0]["symm_mem_errors"]:
        pytest.skip("this torch's FSDPModule has no set_symm_mem_for_comm")
    for r in runs:
        errors = r["symm_mem_errors"]
        assert errors[True] == errors[False] and "NCCL" in errors[False], errors


def test_a_comm_set_between_steps_moves_the_group_off_tide_and_back():
    """A group's all-gather and reduce are decided once and kept (tide/fsdp/decide.py); the kept decision
    rests on the group's comms, so a user comm set between steps takes effect at the next call, and FSDP2's
    own comm set back brings the group back to TIDE."""
    tide_step = {"all_gather": {"tide": ALL_GATHERS // STEPS}, "reduce_scatter": {"tide": REDUCES // STEPS}}
    user_step = {"all_gather": {"stock:custom_comm": ALL_GATHERS // STEPS},
                 "reduce_scatter": {"stock:custom_comm": REDUCES // STEPS}}
    for steps in run_ranks(workers.comms_set_between_steps, 2, timeout=300):
        assert steps == [tide_step, user_step, tide_step], steps


def test_a_group_is_decided_at_its_first_call_and_later_calls_ask_only_their_own_reasons():
    """tide/fsdp/decide.py: a group's first all-gather and reduce ask every reason (joined, the contract, the
    route, the arena); later calls of the same settings ask only the reasons that can change per call."""
    # (The op's reference backend resolves its group's route per call on CPU: not the seam's decision.)
    decided_once = {("tide/fsdp/fallbacks.py", "all_gather_reason"), ("tide/fsdp/fallbacks.py", "reduce_reason"),
                    ("tide/fsdp/joined.py", "reason"), ("tide/fsdp/wiring.py", "arena_for"),
                    ("tide/fsdp/decide.py", "_decide_all_gather"), ("tide/fsdp/fallbacks.py", "_device_reason")}
    per_call = {"all_gather": ("tide/fsdp/fallbacks.py", "all_gather_call_reason"),
                "reduce": ("tide/fsdp/fallbacks.py", "reduce_call_reason")}
    for steps in run_ranks(workers.steady_calls, 2, timeout=300):
        for kind in ("all_gather", "reduce"):
            first = steps[0][kind][0]
            assert decided_once & set(first), first  # the group's first call decides
            for step in (1, 2):
                for entered in steps[step][kind]:
                    assert not decided_once & set(entered), (step, kind, sorted(decided_once & set(entered)))
                    assert per_call[kind] in entered, (step, kind, entered)
