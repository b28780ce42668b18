"""One issue order on every rank in compiled training on CUDA (skipped without CUDA): the uneven SimpleFSDP model
of tests/compile/simple_fsdp.py (three LayerNorm-Linear-GELU blocks, every Linear's rows uneven on 3 and 4 ranks,
bf16 parameters, an ``avg`` fp32 reduce, AdamW) compiled by Inductor after ``tide.compile.enable()`` on the CUDA
transport, ranks sharing one GPU over gloo; each run compiles afresh (a cache directory of its own per rank),
since Inductor's choices differ from run to run.

- Every rank's generated code holds TIDE's ops in the same order, and every rank issues the same calls (op,
  shapes, flags) in the same order, as published call by call on the issued board, in every run, at W = 3
  and W = 4, on the transport (the board refuses a call that differs from a peer's).
- With the ordering dependencies removed, the runs show what they guard against: where Inductor orders a
  rank's calls otherwise, that rank's graph call is refused by name, never mixed into a peer's (the peers that
  issued end through the watchdog).
- Ranks that issue graph calls in different orders by hand: one refuses, naming both calls; the others end
  in the watchdog's report, which names the refusal.
"""
from __future__ import annotations

import concurrent.futures
import os
import re

import pytest
import torch

from tests.cuda import ranks
from tide.launch import run_ranks_outcomes

pytestmark = pytest.mark.cuda

RUNS = 10
STEPS = 3
TIMEOUT_S = 60  # above the ranks' compile-time skew with several runs compiling at once
_CALL = re.compile(r"torch\.ops\.tide\.(all_gather_start|reduce_scatter_start)\.default\(")


def code_order(code: str) -> list[str]:
    """TIDE's ops in one generated wrapper, in issue order."""
    return [m.group(1) for m in map(_CALL.search, code.splitlines()) if m]


def issued_calls(arena) -> list[str]:
    """The graph calls this rank issued on ``arena``, in order, as it published them on the issued board (op,
    shapes, dtypes and flags: the same on every rank for the same call)."""
    board = arena.board
    return [board.call_of(arena.rank, n)[1] for n in range(1, arena.graph_calls + 1)]


def order_run(rank: int, world_size: int, seed: int, cache_dir: str, pinned: bool) -> dict:
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code
    from torch.distributed.device_mesh import init_device_mesh

    import tide
    import tide.compile
    from tests.compile import simple_fsdp
    from tide.compile import schedule

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, f"rank{rank}")
    if not pinned:
        schedule.pin = lambda graph, calls: 0
    torch._dynamo.reset()
    mesh = init_device_mesh("cuda", (world_size,))
    model = simple_fsdp.build_uneven(mesh, seed)
    tide.compile.prepare(model, param_dtype=torch.bfloat16)
    tide.compile.enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    compiled = torch.compile(lambda x, y: simple_fsdp.uneven_loss(model(x), y), dynamic=False)
    losses, codes = [], []
    with config.patch(emulate_precision_casts=True):
        for step in range(STEPS):
            tide.compile.release()
            batch = simple_fsdp.uneven_batch(seed + step, rank, "cuda")

            def forward_backward():
                loss = compiled(*batch)
                loss.backward()
                return loss

            if step == 0:
                loss, codes = run_and_get_code(forward_backward)
            else:
                loss = forward_backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
    torch.cuda.synchronize()
    from tide import transport

    (arena,) = transport.arenas()
    return {"orders": [code_order(code) for code in codes], "calls": issued_calls(arena), "losses": losses,
            "stats": tide.stats()["ops"]}


def _failed(k: int, outcomes) -> str:
    """Every rank's end in words, for the message of a run that did not end well."""
    return f"run {k}:\n" + "\n".join(f"rank {o.rank}: {o.status}: {str(o.detail)[-3000:]}" for o in outcomes)


def _runs(world_size: int, pinned: bool, tmp_path, runs: int = RUNS, parallel: int = 4) -> list[list]:
    """``runs`` fresh compiled runs (``parallel`` at a time), each rank's outcome."""
    env = {**ranks.ENV, "TIDE_TIMEOUT_S": str(TIMEOUT_S), "TORCHINDUCTOR_COMPILE_THREADS": "1"}

    def one(k):
        return run_ranks_outcomes(order_run, world_size, 7919 * k + world_size, str(tmp_path / f"w{world_size}_{k}"),
                                  pinned, device_type="cuda", env=env, timeout=400, pg_timeout=180)

    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(one, range(runs)))


@pytest.mark.parametrize("world_size", [3, 4])
def test_every_rank_issues_one_order_in_every_run(ext, world_size, tmp_path):
    for k, outcomes in enumerate(_runs(world_size, True, tmp_path)):
        assert all(o.status == "ok" for o in outcomes), _failed(k, outcomes)
        orders = [o.detail["orders"] for o in outcomes]  # TIDE's ops in each rank's generated code
        assert all(order == orders[0] for order in orders), (k, orders)
        calls = [o.detail["calls"] for o in outcomes]  # what each rank issued, call by call, with its layout
        assert all(c == calls[0] for c in calls) and len(calls[0]) == STEPS * sum(map(len, orders[0])), (k, calls)
        stats = outcomes[0].detail["stats"]
        assert stats.get("all_gather_start:slot", 0) > 0 and stats.get("reduce_scatter_start:allocator", 0) > 0, stats
        assert not any(":reference" in key for key in stats), stats


def test_without_the_dependencies_a_misordered_call_is_refused_not_mixed(ext, tmp_path, capfd):
    """What the ordering dependencies guard against: runs without them either agree, or a rank's call is refused
    by name and its peers end (their watchdog), none hangs and none finishes with another order than a peer."""
    refused = 0
    for k, outcomes in enumerate(_runs(3, False, tmp_path, runs=6, parallel=3)):
        assert not any(o.status == "hung" for o in outcomes), _failed(k, outcomes)
        if all(o.status == "ok" for o in outcomes):
            orders = [o.detail["orders"] for o in outcomes]
            assert all(order == orders[0] for order in orders), (k, orders)
            continue
        errors = [str(o.detail) for o in outcomes if o.status == "error"]
        assert any("issued different graph calls at call" in e for e in errors), _failed(k, outcomes)
        refused += 1
    print(f"unpinned runs at W = 3: {refused} of 6 refused a misordered call")


def test_graph_calls_in_different_orders_are_refused_and_reported(ext, capfd):
    outcomes = run_ranks_outcomes(ranks.swapped_graph_calls, 3, device_type="cuda",
                                  env={**ranks.ENV, "TIDE_TIMEOUT_S": "5"}, timeout=90, pg_timeout=60)
    assert all(o.status in ("error", "exited") for o in outcomes), outcomes
    errors = [str(o.detail) for o in outcomes if o.status == "error"]
    refusals = [e for e in errors if "issued different graph calls" in e]
    assert refusals, outcomes
    message = refusals[0]
    assert "ranks of group" in message and "issued different graph calls at call 1" in message, message
    assert "all_gather_start((3, 5) bfloat16" in message and "all_gather_start((2, 7) float32" in message, message
    # A rank that issued waits for the refusing ranks: in the data region's lease, which names them when its
    # timeout passes, or in the transfer, which the watchdog ends (below).
    for error in errors:
        assert error in refusals or "refused its graph call 1" in error, error
    exited = [o for o in outcomes if o.status == "exited"]
    if exited:  # a peer that issued its call waits for the refusing rank's part until the watchdog ends it
        err = capfd.readouterr().err
        assert "refused its graph call 1" in err, err[-3000:]
