"""The lease bookkeeping of tide/transport/lease.py on CPU: what is exchanged, mapped, closed and deleted
at each lease. The extension's three IPC calls are recorded by a stand-in (CUDA IPC needs GPUs; the GPU
tests in tests/cuda/test_transport.py run the real ones), and the peers' keys are put in a real store as
the peers would."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tide.transport import lease
from tide.transport.lease import Leases

WORLD, RANK, NBYTES = 3, 1, 4096
MY_HANDLE = b"\x01" * 64


class RecordingIpc:
    """ipc_export / ipc_open / ipc_close as the extension answers them, recorded."""

    def __init__(self) -> None:
        self.opened, self.closed, self.export_error = [], [], ""
        self._next_base = 1 << 40

    def ipc_export(self, tensor):
        return (MY_HANDLE, 256, self.export_error)

    def ipc_open(self, handle, device):
        self.opened.append(handle)
        self._next_base += 1 << 30
        return self._next_base

    def ipc_close(self, base, device):
        self.closed.append(base)


def handle_of(peer: int, generation: int) -> bytes:
    return bytes([peer, generation]) * 32


def make(store, ipc, bases, syncs):
    return Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), NBYTES, 5.0, "test",
                  set_region=lambda region, b, context: bases.append(b), sync_pushes=lambda: syncs.append(True))


def publish_peers(store, n: int, generation: int, offset: int = 64) -> None:
    for p in range(WORLD):
        if p != RANK:
            store.set(f"tide/test/lease{n}/{p}", f"{handle_of(p, generation).hex()}:{offset}")


def test_a_lease_exchanges_maps_and_releases():
    store, ipc, bases, syncs = dist.HashStore(), RecordingIpc(), [], []
    leases = make(store, ipc, bases, syncs)
    publish_peers(store, 1, generation=0)
    region = leases.acquire()
    assert region.nbytes == NBYTES and leases.count == 1 and leases.mode == "allocator"
    assert store.get(f"tide/test/lease1/{RANK}").decode() == f"{MY_HANDLE.hex()}:256;board=0"  # no board here
    mine, peers = bases[-1][RANK], [b for p, b in enumerate(bases[-1]) if p != RANK]
    assert mine == region.data_ptr() and len(ipc.opened) == 2 and all(b % (1 << 30) == 64 for b in peers)
    assert leases.acquire() is region and leases.count == 1  # held: no new lease
    leases.release()
    assert leases.held is None and bases[-1] == [0] * WORLD  # no op may address the released region


def test_the_extension_holds_the_region_from_each_lease_to_its_release_and_the_close():
    store, ipc, seen = dist.HashStore(), RecordingIpc(), []
    leases = Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), NBYTES, 5.0, "test",
                    set_region=lambda region, b, context: seen.append((region, b[RANK], context)),
                    sync_pushes=lambda: None, context=lambda: 7)
    publish_peers(store, 1, generation=0)
    region = leases.acquire()
    assert seen == [(region, region.data_ptr(), 7)]  # leased inside capture 7: its id goes along
    leases.release()
    publish_peers(store, 2, generation=0)
    again = leases.acquire()
    leases.close()
    assert seen[1] == (None, 0, 0) and seen[2][0] is again and seen[3] == (None, 0, 0)


def test_a_handle_seen_before_is_not_mapped_again_and_old_keys_go():
    store, ipc, bases, syncs = dist.HashStore(), RecordingIpc(), [], []
    leases = make(store, ipc, bases, syncs)
    for n in (1, 2, 3):
        publish_peers(store, n, generation=0, offset=64 * n)
        leases.acquire()
        leases.release()
    assert len(ipc.opened) == 2 == leases.maps_opened and ipc.closed == [] and syncs == []  # the same segments
    assert [b % (1 << 30) for b in bases[-2]][:1] == [192]  # the new offset in the mapped segment
    assert not store.check([f"tide/test/lease1/{RANK}"]) and store.check([f"tide/test/lease2/{RANK}"])


def test_the_oldest_mapping_closes_after_the_pushes_drain():
    store, ipc, bases, syncs = dist.HashStore(), RecordingIpc(), [], []
    leases = make(store, ipc, bases, syncs)
    for n in range(1, lease.MAPPINGS_PER_PEER + 2):  # one more handle per peer than are kept
        publish_peers(store, n, generation=n)
        leases.acquire()
        leases.release()
    assert len(ipc.opened) == 2 * (lease.MAPPINGS_PER_PEER + 1)
    assert len(ipc.closed) == 2 and len(syncs) == 2  # one per peer, each after a drain
    leases.close()
    assert len(ipc.closed) == 2 * (lease.MAPPINGS_PER_PEER + 1)  # close unmaps the rest


def test_a_peer_that_never_leases_is_named_after_the_timeout_and_the_arena_leases_no_more():
    store, ipc, bases = dist.HashStore(), RecordingIpc(), []
    leases = Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), NBYTES, 0.5, "grp",
                    set_region=lambda region, b, context: bases.append(b), sync_pushes=lambda: None)
    store.set("tide/test/lease1/0", f"{handle_of(0, 0).hex()}:0")  # rank 2 never gets there
    with pytest.raises(RuntimeError, match=r"lease #1 of the arena of grp: rank\(s\) \[2\] did not reach"):
        leases.acquire()
    store.set("tide/test/lease1/2", f"{handle_of(2, 0).hex()}:0")  # too late: the numbers may differ now
    with pytest.raises(RuntimeError, match="cannot lease again"):
        leases.acquire()
    assert leases.count == 1


def test_a_lease_that_peers_never_reach_names_the_graph_calls_they_refused():
    """A peer whose compiled graph issued another collective refuses it (tide/transport/graph_calls.py) and
    never comes to the lease this rank waits in: the timeout names that refusal, as the issued board shows."""
    from tide.transport.board import Record

    class RefusingBoard:
        def records(self):
            return [Record(pid=10 + p, mapped=True, ag_uses=[0], rs_rounds=[0], refused_call=1 if p == 2 else 0)
                    for p in range(WORLD)]

    store, ipc = dist.HashStore(), RecordingIpc()
    leases = Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), NBYTES, 0.5, "grp",
                    set_region=lambda region, b, context: None, sync_pushes=lambda: None, board=RefusingBoard())
    store.set("tide/test/lease1/0", f"{handle_of(0, 0).hex()}:0;board=1")
    refusal = (r"; peer 2 refused its graph call 1 "
               r"\(the ranks' compiled graphs issue their collectives in different orders\)")
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2\] did not reach .*" + refusal):
        leases.acquire()


def test_an_export_failure_after_the_first_lease_is_an_error_naming_the_ranks():
    store, ipc, bases, syncs = dist.HashStore(), RecordingIpc(), [], []
    leases = make(store, ipc, bases, syncs)
    publish_peers(store, 1, generation=0)
    leases.acquire()
    leases.release()
    store.set("tide/test/lease2/0", "error:cannot share")
    store.set("tide/test/lease2/2", f"{handle_of(2, 0).hex()}:0")
    with pytest.raises(RuntimeError, match=r"lease #2 .* rank\(s\) \[0\] cannot export the region: cannot share"):
        leases.acquire()


def test_the_time_spent_leasing_includes_waiting_for_the_peers():
    import threading

    store, ipc, bases, syncs = dist.HashStore(), RecordingIpc(), [], []
    leases = make(store, ipc, bases, syncs)
    late = threading.Timer(0.3, publish_peers, (store, 1, 0))  # the peers reach their lease 0.3 s later
    late.start()
    leases.acquire()
    late.join()
    # most of the 0.3 s (the timer runs from before the lease's own clock starts); without the wait, ~0
    assert 0.2 <= leases.seconds < 5.0, leases.seconds
    held = leases.seconds
    leases.acquire()  # held: no lease, no time
    assert leases.seconds == held


class RecordingBoard:
    """The issued board's lease exchange, answering for the peers as they would."""

    def __init__(self) -> None:
        self.leases = []

    def exchange_lease(self, n, value, timeout_s, what, channel=0):
        self.leases.append((n, channel))
        return [value if p == RANK else f"{handle_of(p, 0).hex()}:{64 * n}" for p in range(WORLD)]


@pytest.mark.parametrize("peers_mapped_it", [True, False])
def test_leases_after_the_first_go_by_the_board_when_every_rank_mapped_it(peers_mapped_it):
    store, ipc, bases = dist.HashStore(), RecordingIpc(), []
    b = RecordingBoard()
    leases = Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), NBYTES, 5.0, "test",
                    set_region=lambda region, b, context: bases.append(b), sync_pushes=lambda: None, board=b)
    for p in range(WORLD):
        if p != RANK:
            store.set(f"tide/test/lease1/{p}", f"{handle_of(p, 0).hex()}:64;board={int(peers_mapped_it)}")
    leases.acquire()
    assert store.get(f"tide/test/lease1/{RANK}").decode().endswith(";board=1")
    assert all(b % (1 << 30) == 64 for p, b in enumerate(bases[-1]) if p != RANK)  # the flag is not the offset
    leases.release()
    if not peers_mapped_it:  # a peer without the board: every lease stays on the store
        publish_peers(store, 2, generation=0, offset=128)
    leases.acquire()
    assert b.leases == ([(2, 0)] if peers_mapped_it else [])
    assert all(b % (1 << 30) == 128 for p, b in enumerate(bases[-1]) if p != RANK)


def _direct(store, ipc, bases, b=None):
    """Leases as the arena's direct lane makes them (tide/transport/arena.py)."""
    return Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), 0, 5.0, "test",
                  set_region=lambda region, bs, context: bases.append(bs), sync_pushes=lambda: None, board=b,
                  channel=1, symmetric_fallback=False, mappings_per_peer=4)


def test_direct_lane_leases_take_each_calls_size_and_its_own_board_channel():
    store, ipc, bases, b = dist.HashStore(), RecordingIpc(), [], RecordingBoard()
    leases = _direct(store, ipc, bases, b)
    for p in range(WORLD):
        if p != RANK:
            store.set(f"tide/test/lease1/{p}", f"{handle_of(p, 0).hex()}:64;board=1")
    sizes = []
    for nbytes in (4096, 12288, 512):
        sizes.append(leases.acquire(nbytes).nbytes)
        leases.release()
        assert bases[-1] == [0] * WORLD
    assert sizes == [4096, 12288, 512]
    assert b.leases == [(2, 1), (3, 1)]  # after the first (by the store), on channel 1
    assert len(ipc.opened) == WORLD - 1  # the peers' segment recurs: mapped once


def test_direct_lane_without_ipc_gives_none_on_every_call_and_says_why():
    store, ipc, bases = dist.HashStore(), RecordingIpc(), []
    ipc.export_error = "cudaIpcGetMemHandle failed: invalid argument (expandable segments)"
    leases = _direct(store, ipc, bases)
    for p in range(WORLD):
        if p != RANK:
            store.set(f"tide/test/lease1/{p}", f"{handle_of(p, 0).hex()}:64")
    assert leases.acquire(4096) is None
    assert leases.mode.startswith(f"none (rank {RANK} cannot export allocator memory by CUDA IPC")
    assert bases == [] and leases.count == 1
    assert leases.acquire(4096) is None and leases.count == 1  # no further exchange: the ranks agreed at the first
