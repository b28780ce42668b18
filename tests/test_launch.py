"""run_ranks turns a failing or hanging rank into a prompt test failure."""
import time

import pytest
import torch.distributed as dist

from tide.launch import RankError, run_ranks


def _rank_and_size(rank, world_size):
    return rank, world_size, dist.get_world_size()


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise KeyError("boom on rank 1")
    dist.barrier()  # rank 0 waits in a collective that rank 1 never joins


def _hangs(rank, world_size):
    time.sleep(3600)


class _FailingFlush:
    """A stdout whose flush fails at exit: the process ends non-zero after handing its result over."""

    def write(self, text):
        return len(text)

    def flush(self):
        raise SystemExit(5)


def _dies_after_returning(rank, world_size):
    import sys

    if rank == 1:
        sys.stdout = _FailingFlush()
    return rank


def test_results_come_back_in_rank_order():
    assert run_ranks(_rank_and_size, 3) == [(0, 3, 3), (1, 3, 3), (2, 3, 3)]


def test_an_exception_on_one_rank_fails_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 failed:(.|\n)*KeyError: 'boom on rank 1'"):
        run_ranks(_rank1_raises, 2, timeout=120)
    assert time.monotonic() - t0 < 60  # the blocked peer is killed, not waited for


def test_a_hang_times_out_and_shows_where_each_rank_waited(capfd):
    # The deadline counts from the start of the ranks. The first run of a process also starts the server
    # CPU ranks fork from (it imports torch: 10 s and more on a loaded 2-core machine); once it is up, a
    # rank joins its group and reaches _hangs within a second or two.
    assert run_ranks(_rank_and_size, 2, timeout=120) == [(0, 2, 2), (1, 2, 2)]
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] of 2 did not finish within 10 s"):
        run_ranks(_hangs, 2, timeout=10)
    err = capfd.readouterr().err
    assert err.count('in _hangs') == 2, err  # each rank's stack, printed before it was killed


def test_a_rank_dying_after_its_result_is_reported():
    with pytest.raises(RankError, match=r"every rank returned its result, but rank 1 exited with code [1-9][0-9]*$"):
        run_ranks(_dies_after_returning, 2, timeout=120)


def _prints_and_reads(rank, world_size, name):
    import os

    print(f"rank {rank} says hello", flush=True)
    return os.environ.get(name)


def test_ranks_get_the_callers_environment_and_output_of_the_moment(capfd, monkeypatch):
    """CPU ranks fork from a server that an earlier run started: each still gets the environment the caller
    has now, and writes to the caller's stdout of now."""
    with capfd.disabled():  # the server is up, with the environment and stdout of before
        run_ranks(_rank_and_size, 2, timeout=120)
    monkeypatch.setenv("TIDE_LAUNCH_TEST_VARIABLE", "now")
    assert run_ranks(_prints_and_reads, 2, "TIDE_LAUNCH_TEST_VARIABLE", timeout=120) == ["now", "now"]
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out, out
