"""Every fallback case takes the stock FSDP2 path per call, is counted with its reason and still trains
exactly like stock. CUDA-graph capture is covered by the CUDA tests; compiling cannot reach the seam on
torch >= 2.13 (FSDP2's hooks are dynamo-disabled)."""
import pytest

from tests.fsdp import workers
from tests.fsdp.test_parity import assert_parity
from tide.launch import run_ranks


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(workers.fallbacks_2, 2, timeout=300)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(workers.fallbacks_4, 4, timeout=300)


@pytest.mark.parametrize("case, all_gather, reduce_scatter", [
    ("cpu_offload", {"stock:cpu_offload"}, {"stock:cpu_offload"}),
    # Every unshard async; reduces are unaffected.
    ("async_op", {"stock:async_op"}, {"tide"}),
    # Only block 0's group mixes dtypes.
    ("mixed_param_dtypes", {"stock:mixed_param_dtypes", "tide"}, {"tide"}),
])
def test_fallback_two_ranks(two_ranks, case, all_gather, reduce_scatter):
    for rank_result in two_ranks:
        r = rank_result[case]
        stats = r["tide"]["stats"]
        assert set(stats["all_gather"]) == all_gather, stats
        assert set(stats["reduce_scatter"]) == reduce_scatter, stats
        assert_parity(r, workers.LOSS_ATOL_FP32)


@pytest.mark.parametrize("case, all_gather, reduce_scatter", [
    # reshard_after_forward=2: forward gathers on the full group (TIDE), backward from the post-forward mesh.
    ("reshard_int", {"tide", "stock:post_forward_mesh"}, {"tide"}),
])
def test_fallback_four_ranks(four_ranks, case, all_gather, reduce_scatter):
    for rank_result in four_ranks:
        r = rank_result[case]
        stats = r["tide"]["stats"]
        assert set(stats["all_gather"]) == all_gather, stats
        assert set(stats["reduce_scatter"]) == reduce_scatter, stats
        assert_parity(r, workers.LOSS_ATOL_BF16)


def test_world_size_1():
    (r,) = run_ranks(workers.world_size_1, 1, timeout=120)
    stats = r["ws1"]["tide"]["stats"]
    # FSDP2 never calls foreach_all_gather on one rank; the reduce reaches the seam and falls back.
    assert stats["all_gather"] == {}
    assert set(stats["reduce_scatter"]) == {"stock:world_size_1"}
    assert_parity(r["ws1"], 0.0)
