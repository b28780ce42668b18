"""FSDP2 tensor extensions (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) on TIDE-AG (CPU, gloo;
tide/fsdp/extensions.py), with the tests' own extension (tests/fsdp/int8_weights.py): each rank's shard
goes out as int8 rows and fp32 per-row scales (a dtype change and a second metadata tensor), and the
unsharded bf16 weight is rebuilt from every rank's. Against stock FSDP2 from the same seed and data:
bit for bit at W = 2 over 3 AdamW steps; at W = 3 one backward's gradients within the reduce's tolerances
(gloo sums in another order). Every all-gather takes TIDE's path, with no copy-in."""
import pytest

from tests.fsdp import workers
from tide.launch import run_ranks


@pytest.mark.parametrize("world_size", [2, 3])
def test_extension_weights_gather_on_tide_like_stock(world_size):
    exact = world_size == 2
    for rank, r in enumerate(run_ranks(workers.extensions, world_size, 3 if exact else 0, timeout=300)):
        stock, tide_ = r["stock"], r["tide"]
        assert set(tide_["stats"]["all_gather"]) == {"tide"}, (rank, tide_["stats"])
        assert set(tide_["stats"]["reduce_scatter"]) == {"tide"}, (rank, tide_["stats"])
        # Both runs went through the hooks as often; only stock packed a copy-in buffer.
        assert tide_["hook_calls"] == stock["hook_calls"] and tide_["hook_calls"]["pre"] > 0, r
        assert tide_["hook_calls"]["post"] > 0
        if exact:  # the trained steps are the ones whose FSDP2 copy ops are counted
            assert stock["copy_ops"]["all_gather_copy_in"] > 0 and tide_["copy_ops"]["all_gather_copy_in"] == 0
        workers.assert_like_stock(rank, tide_, stock, exact)
