"""Defence in depth for the graph ops on the CUDA transport: every rank's calls of ``all_gather_start`` and
``reduce_scatter_start`` on an arena compared call by call, before anything of the call is issued.

A compiled graph issues its calls in one order on every rank by construction (tide/compile/schedule.py).
Should a rank still issue another call than its peers at the same point (a graph compiled differently on one
rank, a call left out), its peers' pushes of one bucket would land where another bucket of the same size is
expected: the sums would mix them, or the waits end only at the watchdog. So each call is numbered per arena
(n = 1, 2, ...) and described by its op, shapes, dtypes and flags (the same on every rank: shards are padded,
gradients unpadded), compared by digest. A rank publishes (n, digest, the description's start) on the issued
board (host memory its peers map, tide/transport/board.py), fences, and reads what the peers published for n:

- a peer that has published n with another digest: this rank refuses the call (:class:`TideGraphCallError`,
  naming both calls, nothing issued) and marks the refusal on the board;
- a peer that has not published n yet compares when it gets there, against this rank's record.

Of any two ranks, the later to publish sees the earlier's record (the fence between publishing and reading
makes the two unable to miss each other), so ranks whose calls differ never all issue: at least one
refuses, and the peers that did issue wait for its part of the transfer, which never comes, so nothing is
mixed. The transport's watchdog ends those after ``TIDE_TIMEOUT_S``, its report naming the rank that
refused (tide/transport/issue.py). A call on a board that a peer could not map, or further than the ring
(:data:`tide.transport.board.GRAPH_CALLS`) ahead of a peer, is not compared.
"""
from __future__ import annotations

from tide import agreement


class TideGraphCallError(RuntimeError):
    """A graph op whose call differs from the call a peer issued at the same point."""


def check(arena, op: str, tensors, flags=()) -> None:
    """Number this rank's next graph call on ``arena`` and compare it with its peers' (see the module doc);
    raises :class:`TideGraphCallError` when a peer's differs."""
    board = arena.board
    if board is None:
        return
    arena.graph_calls += 1
    n = arena.graph_calls
    call = agreement.CallRecord.of(op, n, (tensors,), flags)
    board.publish_call(n, call.digest, call.desc)
    arena.ext.memory_fence()
    for peer in range(arena.world_size):
        theirs = board.call_of(peer, n) if peer != arena.rank else None
        if theirs is not None and theirs[0] != call.digest:
            board.refuse_call(n)
            raise TideGraphCallError(
                agreement.different_calls(f"tide.{op}: ranks of group {arena.label}", n, arena.rank, call.desc, peer,
                                          theirs[1], kind="graph calls") + ". Nothing of it was issued here; the "
                "peers that issued it wait until TIDE_TIMEOUT_S. The ranks' compiled graphs issue their "
                "collectives in different orders (a graph compiled on some ranks only, or without "
                "tide.compile's pass on some)")
