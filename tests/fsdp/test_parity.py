"""TIDE vs stock FSDP2 on CPU/gloo with 2, 3 and 4 ranks (tolerances: see tests/fsdp/workers.py)."""
import pytest
import torch

from tests.fsdp import workers
from tide.launch import run_ranks


def assert_parity(result: dict, loss_atol: float, grad_atol: float = workers.GRAD_ATOL) -> None:
    stock, tide_ = result["stock"], result["tide"]
    torch.testing.assert_close(torch.tensor(tide_["losses"]), torch.tensor(stock["losses"]), atol=loss_atol, rtol=0)
    assert len(stock["params"]) == len(tide_["params"])
    for a, b in zip(tide_["params"], stock["params"]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=workers.PARAM_ATOL,
                                   rtol=workers.PARAM_RTOL)
    assert len(stock["grads"]) == len(tide_["grads"]) > 0
    for a, b in zip(tide_["grads"], stock["grads"]):
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=grad_atol, rtol=workers.GRAD_RTOL)


def assert_all_tide(stats: dict) -> None:
    """Every all-gather and reduce of the run took the TIDE path (and there were some)."""
    for kind in ("all_gather", "reduce_scatter"):
        assert set(stats[kind]) == {"tide"} and stats[kind]["tide"] > 0, stats


@pytest.fixture(scope="module", params=[2, 3, 4])
def parity_run(request, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp(f"ckpt_ws{request.param}")
    return request.param, run_ranks(workers.parity, request.param, str(ckpt), timeout=300)


def test_bf16_prefetch_reshard(parity_run):
    ws, results = parity_run
    for rank_result in results:
        r = rank_result["bf16_prefetch"]
        assert_parity(r, workers.LOSS_ATOL_BF16)
        assert_all_tide(r["tide"]["stats"])
        # 3 groups gather in forward, the 2 resharded blocks again in backward: 5 per step.
        assert r["tide"]["stats"]["all_gather"]["tide"] == 5 * 5
        # Stock really runs the layout-conversion ops (so the counter works); TIDE never calls them.
        assert all(n > 0 for n in r["stock"]["copy_ops"].values()), r["stock"]["copy_ops"]
        assert all(n == 0 for n in r["tide"]["copy_ops"].values()), r["tide"]["copy_ops"]


def test_fp32_tied_accumulation_no_reshard(parity_run):
    ws, results = parity_run
    for rank_result in results:
        r = rank_result["fp32_tied_accum"]
        assert_parity(r, workers.LOSS_ATOL_FP32)
        assert_all_tide(r["tide"]["stats"])
        # reshard_after_forward=False: one gather per group and micro-batch (backward reshards), and
        # without no_sync every micro-batch reduces.
        assert r["tide"]["stats"]["all_gather"]["tide"] == 3 * 5 * 2
        assert r["tide"]["stats"]["reduce_scatter"]["tide"] == 3 * 5 * 2
        assert r["hooks"]["tide"] == r["hooks"]["stock"] > 0


def test_bf16_no_sync_divide_factor(parity_run):
    ws, results = parity_run
    for rank_result in results:
        r = rank_result["bf16_no_sync_factor"]
        assert_parity(r, workers.LOSS_ATOL_BF16)
        assert_all_tide(r["tide"]["stats"])
        # no_sync: only the last of 2 micro-batches reduces.
        assert r["tide"]["stats"]["reduce_scatter"]["tide"] == 3 * 5


def test_state_dict_roundtrip(parity_run):
    ws, results = parity_run
    for r in (res["state_dict"] for res in results):
        assert r["loaded_equal"]
        assert r["continued"][0] == r["continued"][1]
        assert r["params_equal"]
        assert_all_tide(r["stats"])
