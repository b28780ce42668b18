"""One issue order on every rank, by construction: Inductor's scheduler reorders TIDE's calls that nothing orders
(here by peak memory), and TIDE's ordering dependencies (tide/compile/schedule.py) keep the order the graph
planned; a rank whose graph runs without TIDE's pass, or that recompiles alone, is named by its peers' plan
agreement within its bound instead of leaving them waiting."""
import pytest

from tests.compile import workers
from tide.launch import run_ranks, run_ranks_outcomes


def test_inductor_reorders_unordered_calls_and_the_dependencies_keep_the_graphs_order():
    unpinned, pinned = (run_ranks(workers.independent_calls, 2, pin, timeout=300)[0] for pin in (False, True))
    assert pinned == ["arg0_1", "arg1_1", "arg2_1"], pinned
    assert unpinned != pinned, unpinned  # without them Inductor issues another order: the test can fail


@pytest.mark.parametrize("fault, named", [
    ("no_pass", "rank 1 never ran TIDE's pass on this group (tide.compile.enable() was not called there"),
    ("recompile", "rank 1 agreed 2 plan(s) and is not compiling this graph: a recompile on rank(s) [0] only"),
])
def test_a_rank_out_of_step_at_compile_time_is_named(fault, named):
    outcomes = run_ranks_outcomes(workers.out_of_step_compile, 2, fault, timeout=120, pg_timeout=30,
                                  env={"TIDE_TIMEOUT_S": "5"})
    rank0 = outcomes[0]
    assert rank0.status == "ok" and "did not reach plan #" in rank0.detail and named in rank0.detail, rank0
    assert rank0.seconds < 60, rank0  # within the agreement's bound, not the process group's
    assert outcomes[1].status != "hung", outcomes[1]
