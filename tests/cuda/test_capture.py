"""TIDE-AG and TIDE-RS captured into CUDA graphs (skipped without CUDA): the ops as graph nodes, replayed
bit for bit; FSDP2 training captured as torchtitan captures it; a peer that dies in a replay or never
replays ends its peers in an error within the timeout + 15 s.

Ranks share one GPU over gloo (symmetric memory) when there are fewer GPUs than ranks, and then nothing
but TIDE ops communicates inside the captured region (gloo cannot be captured: stock FSDP2 is compared
eagerly there); with a GPU per rank the same tests run over NCCL, and the training test also compares stock
FSDP2 captured the same way, bit for bit.
"""
import sys
from pathlib import Path

import pytest
import torch

from tests.cuda import capture_ranks, ranks
from tide.launch import run_ranks, run_ranks_outcomes

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fault_scenarios  # noqa: E402

pytestmark = pytest.mark.cuda

REPLAYS = 20
STEPS = REPLAYS + 2  # an eager step, the captured one (replayed at once), then replays


def _run(fn, world_size, *args, timeout=420):
    backend = "nccl" if torch.cuda.device_count() >= world_size else "gloo"  # NCCL: one GPU per rank
    return run_ranks(fn, world_size, *args, backend=backend, device_type="cuda", env=ranks.ENV, timeout=timeout)


@pytest.mark.parametrize("world_size", [2, 3])
def test_captured_ops_replay_bitexact(ext, world_size):
    for rank, r in enumerate(_run(capture_ranks.captured_ops, world_size, 31 + world_size, REPLAYS)):
        captured = r["captured_stats"]
        # The eager run and the capture: two calls of each op, all on the transport.
        assert captured == {"all_gather_into_params_:tide": 4, "reduce_scatter_params_:tide": 4}, (rank, captured)
        assert not any(":stock" in k for k in r["stats"]), (rank, r["stats"])
        assert r["watched"] == 4 and r["replays"] == REPLAYS, (rank, r)


def test_captured_training_bitexact(ext):
    names = list(capture_ranks.CONFIGS)
    for rank, res in enumerate(_run(capture_ranks.captured_training, 2, names, STEPS, timeout=600)):
        for name in names:
            stock, eager, graph = (res[name][v] for v in ("stock", "tide", "tide_graph"))
            what = f"rank {rank} {name}"
            assert graph["replays"] == STEPS - 1, (what, graph["replays"])
            assert "no longer the gradient the captured step writes" in graph.get("stale_grads", ""), (what, graph)
            assert graph["losses"] == eager["losses"], (what, graph["losses"], eager["losses"])
            for s, (gs, es) in enumerate(zip(graph["grads"], eager["grads"])):
                for i, (g, e) in enumerate(zip(gs, es)):
                    assert g.tobytes() == e.tobytes(), f"{what} step {s} grad {i}: captured != eager TIDE"
            _assert_close_to_stock(what, graph, stock)
            if "stock_graph" in res[name]:  # NCCL: stock captured the same way, bit for bit at W = 2
                stock_graph = res[name]["stock_graph"]
                assert graph["losses"] == stock_graph["losses"], (what, graph["losses"], stock_graph["losses"])
                for s, (gs, ss) in enumerate(zip(graph["grads"], stock_graph["grads"])):
                    for i, (g, e) in enumerate(zip(gs, ss)):
                        assert g.tobytes() == e.tobytes(), f"{what} step {s} grad {i}: captured != stock captured"
            for kind in ("all_gather", "reduce_scatter"):
                assert set(graph["fsdp"][kind]) == {"tide"}, (what, kind, graph["fsdp"])
            assert not any(":stock" in k for k in graph["ops"]), (what, graph["ops"])
            if name.startswith("slot_reuse"):
                assert graph["wiring"].get("rs:slot_reuse", 0) > 0, (what, graph["wiring"])


def _assert_close_to_stock(what, got, stock, steps: int = 4):
    """Within the reduce's tolerances (tests/fsdp/workers.py) over the first ``steps`` steps: later the
    fp32 sum order's last bits, amplified by AdamW, move the two runs apart."""
    from tests.fsdp import workers

    torch.testing.assert_close(torch.tensor(got["losses"][:steps]), torch.tensor(stock["losses"][:steps]),
                               atol=workers.LOSS_ATOL_BF16, rtol=0, msg=f"{what}: losses against stock")
    for s, (gs, ss) in enumerate(zip(got["grads"][:steps], stock["grads"][:steps])):
        for i, (g, e) in enumerate(zip(gs, ss)):
            torch.testing.assert_close(torch.from_numpy(g), torch.from_numpy(e), atol=workers.GRAD_ATOL,
                                       rtol=workers.GRAD_RTOL, msg=f"{what} step {s} grad {i} against stock")


TIMEOUT_S = 5
BOUND = TIMEOUT_S + 15


@pytest.mark.parametrize("scenario", ["dies_in_replay", "never_replays"])
def test_a_peer_that_dies_in_a_replay_or_never_replays(ext, scenario, tmp_path, capfd):
    fault_file = str(tmp_path / "fault")
    outcomes = run_ranks_outcomes(capture_ranks.replay_fault, 2, scenario, fault_file, device_type="cuda",
                                  env={**ranks.ENV, "TIDE_TIMEOUT_S": str(TIMEOUT_S)}, timeout=BOUND + 60,
                                  pg_timeout=120)
    verdict = fault_scenarios.judge(outcomes, fault_file)
    assert verdict["hung"] == [] and verdict["errors"], verdict
    assert verdict["s_to_error"] is not None and verdict["s_to_error"] < BOUND, verdict
    err = capfd.readouterr().err
    assert "captured in a CUDA graph, replaying" in err and "began this replay" in err, err[-3000:]
