"""FSDP2 on emulated nodes (gloo, ``LOCAL_WORLD_SIZE=2``): 2 x 2 and 3 x 2 ranks run every collective
on TIDE's multi-node schedule (``"tide_multinode"``) and match stock FSDP2 within the tolerance of
tests/fsdp/workers.py (the node-then-rank fp32 order differs from gloo's by a few ulps)."""
import pytest

from tests.fsdp import workers
from tests.fsdp.test_parity import assert_parity
from tide.launch import run_ranks


@pytest.mark.parametrize("world_size", [4, 6])
def test_fsdp_parity_on_emulated_nodes(world_size):
    results = run_ranks(workers.multinode_parity, world_size, env={"LOCAL_WORLD_SIZE": "2"}, timeout=300)
    for r in results:
        for name, loss_atol in (("bf16_in_place", workers.LOSS_ATOL_BF16), ("fp32_slot_reuse", workers.LOSS_ATOL_FP32)):
            assert_parity(r[name], loss_atol)
            stats = r[name]["tide"]["stats"]
            for kind in ("all_gather", "reduce_scatter"):
                assert set(stats[kind]) == {"tide_multinode"} and stats[kind]["tide_multinode"] > 0, (name, stats)
