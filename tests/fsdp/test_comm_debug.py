"""``CommDebugMode`` counts TIDE's FSDP2 collectives as the c10d collectives they stand for, one for one
(tide/fsdp/comm_debug.py): per phase and per module, TIDE's counts equal stock's (CPU, gloo, 2 ranks)."""
from tests.fsdp import workers
from tide.launch import run_ranks

STEPS = 2


def test_comm_debug_mode_counts_tide_collectives_as_stock_ones():
    for r in run_ranks(workers.comm_debug_counts, 2, STEPS, timeout=180):
        stock, tide_ = r["stock"], r["tide"]
        assert set(tide_["stats"]["all_gather"]) == {"tide"} and set(tide_["stats"]["reduce_scatter"]) == {"tide"}
        # The tiny model: 3 groups gather in forward, the 2 resharded blocks again in backward; 3 reduce.
        expected = {"forward": {"c10d._allgather_base_": 3},
                    "backward": {"c10d._allgather_base_": 2, "c10d._reduce_scatter_base_": 3}}
        assert stock["phases"] == [expected] * STEPS, stock["phases"]
        assert tide_["phases"] == stock["phases"]
        assert tide_["modules"] == stock["modules"] and len(stock["modules"]) > 1, (tide_["modules"], stock["modules"])
