"""HSDP on TIDE (CPU, gloo): TIDE-RS over the shard group, then stock's all-reduce of the fp32 shard gradients
across the replicate group (tide/fsdp/replicate.py), against stock FSDP2 trained from the same seed on
the same data. Every reduce takes the TIDE path. With two ranks per shard group the runs are stock's bit
for bit over 3 AdamW steps (a sum of two is the same in any order, and the divide by 2 is exact). With
three, TIDE sums in rank order where gloo sums in another: the reduced gradients of one backward agree to
the reduce's tolerances (tests/fsdp/workers.py), and training steps are not compared, since AdamW turns
an ulp on a near-zero gradient into a full step of that element."""
import numpy as np
import pytest
import torch

from tests.fsdp import workers
from tide.launch import run_ranks


def _assert_bitexact(r: dict) -> None:
    stock, tide_ = r["stock"], r["tide"]
    if "losses" in stock:
        assert tide_["losses"] == stock["losses"], (tide_["losses"], stock["losses"])
    for key in ("params", "grads"):
        for i, (a, b) in enumerate(zip(tide_.get(key, []), stock.get(key, []))):
            assert np.array_equal(a, b), f"{key} {i}: max |diff| {np.abs(a - b).max():.3e}"


@pytest.mark.parametrize("replicas, world_size", [(2, 4), (2, 6)])
@pytest.mark.parametrize("case", ["plain", "partial", "hook", "force_sum"])
def test_hsdp_reduces_on_tide_like_stock(replicas, world_size, case):
    exact = world_size // replicas == 2
    for rank, r in enumerate(run_ranks(workers.hsdp, world_size, replicas, case, 3 if exact else 0, timeout=400)):
        stats = r["tide"]["stats"]
        assert set(stats["all_gather"]) == {"tide"} and set(stats["reduce_scatter"]) == {"tide"}, (rank, stats)
        if exact:
            _assert_bitexact(r)
        else:
            _assert_grads_close(r)


def _assert_grads_close(r: dict) -> None:
    stock, tide_ = r["stock"], r["tide"]
    assert len(stock["grads"]) == len(tide_["grads"]) > 0
    for i, (a, b) in enumerate(zip(tide_["grads"], stock["grads"])):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=workers.GRAD_ATOL,
                                   rtol=workers.GRAD_RTOL, msg=f"grad {i}")
