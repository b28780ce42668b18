"""``Shard(1)`` parameters on TIDE (CPU, gloo; tide/fsdp/shard_dims.py): the 2-D weights of the Llama blocks and
the 3-D expert weights of the MoE blocks sharded on dim 1 through ``shard_placement_fn``, beside dim-0 params in
the same groups (one call each), against stock FSDP2 from the same seed and data. Every collective takes the
TIDE path. At W = 2 the runs are stock's bit for bit over 3 AdamW steps (a sum of two is the same in any
order, and the divide by 2 is exact); at W = 3 the reduced gradients of one backward agree with stock's to
the reduce's tolerances (gloo sums in another order)."""
import numpy as np
import pytest
import torch

from tests.fsdp import workers
from tide.launch import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("preset", ["tiny", "tiny_moe"])
def test_shard_dim1_runs_on_tide_like_stock(preset, world_size):
    exact = world_size == 2
    for rank, r in enumerate(run_ranks(workers.shard_dims, world_size, preset, 3 if exact else 0, timeout=300)):
        stats = r["tide"]["stats"]
        assert set(stats["all_gather"]) == {"tide"} and set(stats["reduce_scatter"]) == {"tide"}, (rank, stats)
        stock, tide_ = r["stock"], r["tide"]
        assert len(stock["grads"]) == len(tide_["grads"]) > 0
        if exact:
            assert tide_["losses"] == stock["losses"], (tide_["losses"], stock["losses"])
            for key in ("params", "grads"):
                for i, (a, b) in enumerate(zip(tide_[key], stock[key])):
                    assert np.array_equal(a, b), f"rank {rank} {key} {i}: max |diff| {np.abs(a - b).max():.3e}"
        else:
            for i, (a, b) in enumerate(zip(tide_["grads"], stock["grads"])):
                torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=workers.GRAD_ATOL,
                                           rtol=workers.GRAD_RTOL, msg=f"rank {rank} grad {i}")
