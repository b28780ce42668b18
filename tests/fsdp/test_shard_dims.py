"""``Shard(1)`` parameters on TIDE (CPU, gloo; tide/fsdp/shard_dims.py): the 2-D weights of the Llama blocks and
the 3-D expert weights of the MoE blocks sharded on dim 1 through ``shard_placement_fn``, beside dim-0 params in
the same groups (one call each), against stock FSDP2 from the same seed and data. Every collective takes the
TIDE path. At W = 2 the runs are stock's bit for bit over 3 AdamW steps (a sum of two is the same in any
order, and the divide by 2 is exact); at W = 3 the reduced gradients of one backward agree with stock's to
the reduce's tolerances (gloo sums in another order)."""
import pytest

from tests.fsdp import workers
from tide.launch import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_shard_dim1_runs_on_tide_like_stock(preset, world_size):
    exact = world_size == 2
    for rank, r in enumerate(run_ranks(workers.shard_dims, world_size, preset, 3 if exact else 0, timeout=300)):
        stats = r["tide"]["stats"]
        assert set(stats["all_gather"]) == {"tide"} and set(stats["reduce_scatter"]) == {"tide"}, (rank, stats)
        workers.assert_like_stock(rank, r["tide"], r["stock"], exact)
