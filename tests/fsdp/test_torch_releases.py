"""What changed in FSDP2 between torch releases, each on the torch that has it (CI runs tests/fsdp on
every minor release from 2.11 to 2.15): mixed gradient dtypes in one group and per-parameter sharded
gradient dtypes (2.15), the Slot-Reuse hook's decision on every release, keep_unsharded_storage (2.15)."""
import numpy as np
import pytest

from tests.fsdp import workers
from tests.fsdp.test_parity import assert_all_tide, assert_parity
from tide.fsdp import compat
from tide.launch import run_ranks

ON_2_15 = compat.torch_version() >= (2, 15)


@pytest.fixture(scope="module")
def grad_dtype_run():
    return run_ranks(workers.grad_dtypes, 2, timeout=240)


def test_every_reduce_takes_tide_and_matches_stock(grad_dtype_run):
    for r in grad_dtype_run:
        assert_all_tide(r["tide"]["stats"])
        np.testing.assert_allclose(r["tide"]["losses"], r["stock"]["losses"], atol=workers.LOSS_ATOL_BF16, rtol=0)
        assert [d for d, _ in r["tide"]["grads"]] == [d for d, _ in r["stock"]["grads"]]
        for (_, a), (_, b) in zip(r["tide"]["grads"], r["stock"]["grads"]):
            np.testing.assert_allclose(a, b, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not ON_2_15, reason="torch 2.15+: gradients of several dtypes in one group")
def test_norm_weights_fp32_grads_beside_bf16_ones_take_tide(grad_dtype_run):
    for r in grad_dtype_run:
        assert ["torch.bfloat16", "torch.float32"] in r["seen"], r["seen"]


@pytest.mark.skipif(not ON_2_15, reason="torch 2.15+: Tensor.grad_dtype and per-parameter sharded_grad_dtype")
def test_a_bf16_grad_dtype_keeps_its_sharded_grad_in_bf16(grad_dtype_run):
    for r in grad_dtype_run:
        dtypes = [d for d, _ in r["tide"]["grads"]]
        assert dtypes.count("torch.bfloat16") == 1 and dtypes.count("torch.float32") == len(dtypes) - 1, dtypes


def test_the_slot_reuse_hook_moves_finished_grads_and_keeps_accumulating_ones():
    for r in run_ranks(workers.slot_reuse_decisions, 2, timeout=180):
        assert any(moved for moved, _ in r["plain"]), r["plain"]
        assert all(moved == same_dtype for moved, same_dtype in r["plain"]), r["plain"]
        assert len(r["no_sync"]) > 0 and not any(moved for moved, _ in r["no_sync"]), r["no_sync"]


@pytest.mark.skipif(not ON_2_15, reason="torch 2.15+: FSDPModule.set_keep_unsharded_storage")
def test_keep_unsharded_storage_gathers_on_stock_with_its_reason():
    for r in run_ranks(workers.keep_unsharded_storage, 2, timeout=180):
        stats = r["tide"]["stats"]
        assert stats["all_gather"].get("stock:keep_unsharded_storage", 0) > 0 and "tide" in stats["all_gather"], stats
        assert set(stats["reduce_scatter"]) == {"tide"}, stats
        assert_parity(r, workers.LOSS_ATOL_BF16)
