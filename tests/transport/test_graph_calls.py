"""The graph calls' comparison on the issued board (tide/transport/graph_calls.py), across real processes on CPU:
ranks issuing the same calls pass; where one rank's call differs, a rank refuses it naming both calls, the board
marks the refusal for the peers' reports, and no call number is passed by ranks whose calls differ."""
import torch
import torch.distributed as dist

from tide.launch import run_ranks
from tide.transport import board, graph_calls


class _Arena:
    """The arena fields the check reads."""

    def __init__(self, b, rank, world):
        self.board, self.rank, self.world_size = b, rank, world
        self.label = f"'0' (ranks {list(range(world))}, this rank {rank})"
        self.graph_calls = 0
        self.ext = type("Ext", (), {"memory_fence": staticmethod(lambda: None)})


def _calls(rank, world, swap_rank):
    store = dist.distributed_c10d._get_default_store()
    b = board.IssuedBoard.rendezvous(store, "tide/test/graph_calls", rank, world, 2)
    arena = _Arena(b, rank, world)
    calls = [[torch.zeros(3, 5, dtype=torch.bfloat16)], [torch.zeros(2, 7)], [torch.zeros(4)]]
    if rank == swap_rank:
        calls[1], calls[2] = calls[2], calls[1]
    passed, error = [], None
    for shards in calls:
        dist.barrier()  # every rank at the same call: each compares against what the others published
        if error is not None:
            continue  # a rank that refused issues nothing more
        try:
            graph_calls.check(arena, "all_gather_start", shards)
            passed.append(arena.graph_calls)
        except graph_calls.TideGraphCallError as e:
            error = str(e)
    dist.barrier()
    records = b.records()
    return {"passed": passed, "error": error, "refused": [r.refused_call for r in records],
            "report": board.report(records, rank, list(range(world)), state=lambda pid: "S (sleeping)")}


def test_the_same_calls_pass_on_every_rank():
    for r in run_ranks(_calls, 3, -1, timeout=120):
        assert r["passed"] == [1, 2, 3] and r["error"] is None and r["refused"] == [0, 0, 0], r


def test_a_call_that_differs_is_refused_by_name_and_never_passed_by_both_sides():
    results = run_ranks(_calls, 3, 2, timeout=120)
    refusing = [r for r in results if r["error"]]
    assert refusing, results
    for r in refusing:
        assert "issued different graph calls at call 2" in r["error"], r["error"]
        assert "all_gather_start((2, 7) float32)" in r["error"] and "all_gather_start((4,) float32)" in r["error"]
    passed_2 = {rank for rank, r in enumerate(results) if 2 in r["passed"]}
    assert 2 not in passed_2 or passed_2 == {2}, results  # ranks whose call 2 differ never both issue it
    refused = results[0]["refused"]
    assert any(refused), results
    peer = next(rank for rank, n in enumerate(refused) if n)
    viewer = next(rank for rank in range(3) if rank != peer)
    assert any(f"peer {peer} (global rank {peer}) refused its graph call 2" in line
               for line in results[viewer]["report"]), results[viewer]["report"]
