"""The issued board (tide/transport/board.py) across real processes on CPU: every rank maps rank 0's
file, the name is gone once all have, a rank's mirrored words reach its peers, and the report names a
peer that died behind or level with this rank, and its process's state, with no CUDA call."""
import ctypes
import os
import time

import pytest
import torch.distributed as dist

from tide.launch import run_ranks_outcomes
from tide.transport import board

K = 2  # all-gather lanes (an arena with one slot: slot 0 and the direct lane)


class _DictStore(dict):
    """The three calls of a c10d store the board makes, in one process."""

    def set(self, k, v):
        self[k] = v.encode()

    def get(self, k, default=None):
        return dict.get(self, k, default)

    def add(self, k, n):
        self[k] = dict.get(self, k, 0) + n
        return self[k]


def _mirror(b: board.IssuedBoard, ag_uses, rs_rounds) -> None:
    """What the extension's publish_progress_to mirror writes (csrc/transport/arena.cpp), from Python."""
    words = (ctypes.c_uint32 * (K + b.world)).from_address(b.progress_address())
    for i, v in enumerate([*ag_uses, *rs_rounds]):
        words[i] = v


def _ended(pid) -> bool:
    return board.procfs.ended(board.procfs.state(pid))


def _ranks(rank, world, peer_ag_uses, peer_dies):
    store = dist.distributed_c10d._get_default_store()
    b = board.IssuedBoard.rendezvous(store, "tide/test/board", rank, world, K)
    assert b is not None
    dist.barrier()
    assert not os.path.exists(b.path), "the board's name outlives the rendezvous"
    if rank == 1:
        _mirror(b, peer_ag_uses, [3, 3])
        dist.barrier()
        if peer_dies:
            os._exit(3)
        dist.barrier()
        return "peer"
    _mirror(b, [4, 3], [3, 3])
    dist.barrier()
    if peer_dies:
        deadline = time.monotonic() + 10
        while not _ended(b.records()[1].pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        dist.barrier()
    records = b.records()
    assert [r.pid for r in records][0] == os.getpid() and all(r.mapped for r in records)
    assert records[1].ag_uses == list(peer_ag_uses) and records[1].rs_rounds == [3, 3]
    lines = board.report(records, 0, [5, 9])
    b.close()
    return lines


@pytest.mark.parametrize("peer_ag_uses,peer_dies,expect", [
    ([3, 3], True, "1 all-gather use(s) behind this rank"),
    ([4, 3], True, "issued as far as this rank"),
    ([4, 3], False, "issued as far as this rank"),
    ([5, 3], False, "1 all-gather use(s) ahead of this rank"),
])
def test_peers_issued_work_and_process_state_reach_the_report(peer_ag_uses, peer_dies, expect):
    outcomes = run_ranks_outcomes(_ranks, 2, peer_ag_uses, peer_dies, timeout=60, pg_timeout=30)
    assert outcomes[0].status == "ok", outcomes[0]
    (line,) = outcomes[0].detail
    assert line.startswith("  peer 1 (global rank 9), process ") and expect in line, line
    assert ("(gone)" in line or "(Z (zombie))" in line) == peer_dies, line
    if peer_dies:
        assert outcomes[1].status == "exited" and outcomes[1].detail == 3, outcomes[1]


def test_counts_in_another_order_are_not_taken_for_level():
    """A peer that used slot 1 where this rank used slot 0 issued as many all-gathers, but not the same."""
    mine = board.Record(pid=1, mapped=True, ag_uses=[4, 3], rs_rounds=[2, 2])
    peer = board.Record(pid=2, mapped=True, ag_uses=[3, 4], rs_rounds=[2, 2])
    (line,) = board.report([mine, peer], 0, [0, 1], state=lambda pid: "S (sleeping)")
    assert "all-gather use(s) in another order than this rank's [4, 3]" in line and "[3, 4]" in line, line


def test_a_board_that_cannot_reserve_its_pages_leaves_no_file(monkeypatch, tmp_path):
    """A full /dev/shm: the pages are reserved at creation, so it fails there (no SIGBUS at a later write),
    and the half-made file goes."""
    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(board, "_DIR", str(tmp_path))
    monkeypatch.setattr(board.os, "posix_fallocate", full)

    assert board.IssuedBoard.rendezvous(_DictStore(), "k", 0, 2, K) is None
    assert list(tmp_path.iterdir()) == []


def test_a_peer_without_a_record_is_named():
    rec = board.Record(pid=0, mapped=False, ag_uses=[0, 0], rs_rounds=[0, 0])
    mine = board.Record(pid=os.getpid(), mapped=True, ag_uses=[1, 0], rs_rounds=[0, 0])
    assert board.report([mine, rec], 0, [0, 1]) == [
        "  peer 1 (global rank 1): no record on the issued board (another host, or it could not map the board)"]


def test_a_board_that_cannot_be_created_is_none_on_every_rank(monkeypatch, tmp_path):
    monkeypatch.setattr(board, "_DIR", str(tmp_path / "missing"))
    store = _DictStore()
    assert board.IssuedBoard.rendezvous(store, "k", 0, 2, K) is None
    assert board.IssuedBoard.rendezvous(store, "k", 1, 2, K) is None


# ------------------------------------------------------------------------------------------ leases on the board
def _boards(world: int) -> list:
    """Every rank's mapping of one board, in this process (threads play the ranks)."""
    store = _DictStore()
    maps = [board.IssuedBoard.rendezvous(store, "b", 0, world, K)]
    maps += [board.IssuedBoard.rendezvous(store, "b", r, world, K) for r in range(1, world)]
    return maps


def test_lease_values_cross_the_board_in_rank_order_lease_after_lease():
    import threading

    world = 3
    maps = _boards(world)
    got = [dict() for _ in range(world)]

    def rank(r):
        for n in range(2, 8):  # both slots, each reused: a rank publishes n + 2 only after reading n + 1
            got[r][n] = maps[r].exchange_lease(n, f"handle{r}:{n * 100 + r}", 5.0, "lease")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    for r in range(world):
        for n in range(2, 8):
            assert got[r][n] == [f"handle{p}:{n * 100 + p}" for p in range(world)], (r, n, got[r][n])


def test_a_peer_that_never_publishes_its_lease_is_named_after_the_timeout():
    maps = _boards(3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"lease #2: rank\(s\) \[1, 2\] did not reach this call within 0.3 s"):
        maps[0].exchange_lease(2, "x:0", 0.3, "lease #2")
    assert time.monotonic() - start < 2


def test_the_two_lease_channels_number_their_leases_apart():
    import threading

    maps = _boards(2)
    got = {}

    def rank(r):  # lease 2 on each channel, then lease 3 on channel 1 only
        got[r] = [maps[r].exchange_lease(n, f"{r}:{c}:{n}", 5.0, "lease", channel=c)
                  for n, c in ((2, 0), (2, 1), (3, 1))]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    want = [[f"{p}:{c}:{n}" for p in range(2)] for n, c in ((2, 0), (2, 1), (3, 1))]
    assert got == {0: want, 1: want}, got


def test_a_long_value_is_cut_to_the_slot():
    maps = _boards(2)
    value = "error:" + "e" * 400
    import threading

    t = threading.Thread(target=maps[1].exchange_lease, args=(2, "h:1", 5.0, "lease"))
    t.start()
    out = maps[0].exchange_lease(2, value, 5.0, "lease")
    t.join(5)
    assert out[0] == value[:248] and out[1] == "h:1"
