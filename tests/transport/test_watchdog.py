"""The transport watchdog's bookkeeping, report and exit, driven on CPU by completion handles that a test
sets (on CUDA they read each op's completion word in pinned host memory; tests/cuda/test_faults.py runs
the real thing)."""
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tide.launch import run_ranks_outcomes
from tide import timeouts
from tide.transport import watchdog
from tide.timeouts import TideTimeoutError
from tide.transport.watchdog import Watchdog


class Done:
    """A completion handle: ``query()`` is true once the test sets it."""

    def __init__(self):
        self.flag = threading.Event()

    def query(self):
        return self.flag.is_set()


def test_completed_ops_are_dropped_and_never_fire():
    dog = Watchdog(poll_s=0.02)
    handles = [Done() for _ in range(5)]
    for i, h in enumerate(handles):
        dog.track(h, f"op{i}", "'g'", timeout_s=0.5, describe=lambda: pytest.fail("no report for completed ops"))
    for h in handles:
        h.flag.set()
    deadline = time.monotonic() + 5
    while dog.pending() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert dog.pending() == 0
    time.sleep(0.7)  # past the timeout: nothing fires for ops that completed in time
    assert dog.error is None
    dog.check()


_EXPIRY = textwrap.dedent("""
    import sys, threading, time
    from tide.timeouts import TideTimeoutError
    from tide.transport.watchdog import Watchdog

    class Never:
        def query(self):
            return False

    class Soon:
        def __init__(self):
            self.t = time.monotonic() + 0.2
        def query(self):
            return time.monotonic() > self.t

    def describe():
        yield "  this rank issued all-gather uses [4] per lane"  # known without the driver
        if sys.argv[1] == "unreadable":
            raise RuntimeError("copy failed")
        if sys.argv[1] == "blocks":  # as when the driver is wedged: the exit must not wait for the report
            threading.Event().wait()
        if sys.argv[1] == "holds_the_gil":  # wedged inside a call that keeps the GIL: no Python thread runs
            import re
            re.match(r"(a+)+$", "a" * 60 + "b")  # exponential backtracking, never returns in this test
        yield ("  peer 1 (global rank 1) is behind: all-gather slot 0: free at use 3, pieces at use 3, "
               "this rank at use 4 (1 behind)")

    dog = Watchdog(poll_s=0.05, grace_s=1.0)
    dog.track(Soon(), "reduce_scatter_params_", "'0' (ranks [0, 1], this rank 0)", 0.5, describe)
    dog.track(Never(), "all_gather_into_params_", "'0' (ranks [0, 1], this rank 0)", 0.5, describe)
    start = time.monotonic()
    while True:  # the training thread: its next op raises, then it blocks as on a stalled GPU
        try:
            dog.check()
        except TideTimeoutError as e:
            print("RAISED after %.1f s" % (time.monotonic() - start), flush=True)
            time.sleep(60)
        time.sleep(0.01)
""")


@pytest.mark.parametrize("flags", ["readable", "unreadable", "blocks", "holds_the_gil"])
def test_an_op_that_never_completes_is_reported_raised_and_ends_the_process(flags):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _EXPIRY, flags], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    err = proc.stderr
    assert "tide: all_gather_into_params_ on group '0' (ranks [0, 1], this rank 0) did not complete" in err, err
    assert "reduce_scatter_params_" not in err.split("Thread")[0]  # the op that completed is not reported
    if flags == "holds_the_gil":
        # Only the backstop can run: it prints every stack and exits, report + grace + 1 s after expiry.
        assert proc.returncode == watchdog.BACKSTOP_EXIT_CODE, (proc.returncode, err)
        assert took < 30, took
        assert "Timeout (" in err and "in describe" in err, err
        return
    assert proc.returncode == watchdog.EXIT_CODE, (proc.returncode, err)
    assert took < 30, took  # timeout 0.5 s + grace 1 s, plus the interpreter's start
    assert "RAISED after" in proc.stdout, proc.stdout
    if flags == "readable":
        assert "peer 1 (global rank 1) is behind: all-gather slot 0" in err, err
    elif flags == "unreadable":
        assert "flag words unreadable: RuntimeError: copy failed" in err, err
    else:
        assert f"flag words unreadable: the report did not finish in {watchdog.REPORT_S:g} s" in err, err
    assert "this rank issued all-gather uses [4] per lane" in err, err  # the lines before a blocking call too
    assert f"exits with code {watchdog.EXIT_CODE}" in err
    assert "Thread" in err  # every thread's stack follows the report


def test_check_raises_the_recorded_error():
    dog = Watchdog()
    dog.check()
    dog.error = TideTimeoutError("tide: x did not complete")
    with pytest.raises(TideTimeoutError, match="did not complete"):
        dog.check()


def _group_timeout(rank, world_size):
    import torch.distributed as dist

    return timeouts.timeout_for(dist.group.WORLD)


def test_timeout_is_the_groups_unless_tide_timeout_s_says_otherwise(monkeypatch):
    [outcome] = run_ranks_outcomes(_group_timeout, 1, pg_timeout=17.0, timeout=120)
    assert outcome.status == "ok" and outcome.detail == 17.0, outcome
    monkeypatch.setenv("TIDE_TIMEOUT_S", "2.5")
    assert timeouts.timeout_for(None) == 2.5
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv("TIDE_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="TIDE_TIMEOUT_S must be a number > 0"):
            timeouts.timeout_for(None)


class InFlight:
    """An arena's in-flight list as the extension reports it: (ticket, op, seconds since it began, still
    issuing) of the oldest op not completed, or None (csrc/transport/driver.h)."""

    def __init__(self):
        self.entry = None

    def oldest(self):
        return self.entry


def test_an_arenas_oldest_eager_op_expires_only_past_its_timeout_and_not_once_forgotten():
    dog = Watchdog(poll_s=60.0)  # the thread sleeps: the test polls by hand
    a, b = InFlight(), InFlight()
    dog.track_in_flight(a, "'a'", 2.0, lambda: ["report a"], owner="arena-a")
    dog.track_in_flight(b, "'b'", 5.0, lambda: ["report b"], owner="arena-b")
    assert dog._oldest_in_flight(now=100.0) == []
    a.entry = (4, "reduce_scatter_params_", 1.5, True)  # still issuing (a launch may block): pending
    b.entry = (9, "all_gather_into_params_", 4.0, False)
    assert dog._oldest_in_flight(now=100.0) == []
    a.entry = (4, "reduce_scatter_params_", 2.5, True)
    late, = dog._oldest_in_flight(now=100.0)
    assert (late.op, late.group, late.issued, late.replaying) == ("reduce_scatter_params_", "'a'", 97.5, False)
    assert list(late.describe()) == ["report a"]
    dog.forget("arena-a")
    assert dog._oldest_in_flight(now=100.0) == []
    b.entry = (9, "all_gather_into_params_", 6.0, False)
    assert [p.group for p in dog._oldest_in_flight(now=100.0)] == ["'b'"]
    dog.forget("arena-b")  # else the dog's thread, at its next poll, finds b expired and ends this process


def test_an_expiry_calls_its_hooks_before_the_report(monkeypatch):
    dog, order = Watchdog(poll_s=60.0, grace_s=0.0), []
    dog.on_expiry(lambda: order.append("hook" if dog.error is not None else "hook before the error"))
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: order.append(("exit", code)))
    monkeypatch.setattr(watchdog.faulthandler, "dump_traceback_later", lambda *a, **kw: None)
    monkeypatch.setattr(watchdog.faulthandler, "dump_traceback", lambda *a, **kw: None)
    p = watchdog._Pending(None, "all_gather_into_params_", "'g'", 1.0, lambda: order.append("report") or ["line"],
                          issued=0.0)
    dog._expire(p, now=2.0)
    assert order == ["hook", "report", ("exit", watchdog.EXIT_CODE)] and dog.error is not None


_HAND_OVER = textwrap.dedent("""
    import tide.ops.cuda as cuda
    from tide.transport import watchdog

    class Ext:  # the extension's hand-over entry points, recorded
        calls = []
        def hand_over_kernels(self, **kernels):
            self.calls.append(("kernels", sorted(kernels)))
        def steady_enable(self, on):
            self.calls.append(("steady", on))
        def steady_calls(self):
            return {}
        def steady_reset_calls(self):
            pass

    ext = Ext()
    cuda.hand_over(ext)
    cuda.hand_over(ext)  # once per process
    for hook in watchdog.WATCHDOG._on_expiry:  # what an expiry runs
        hook()
    print(ext.calls)
""")


def test_the_handover_registers_the_kernels_once_and_an_expiry_turns_the_cpp_path_off():
    """In a process of its own: the hand-over drops the Python CUDA kernels of this process."""
    out = subprocess.run([sys.executable, "-c", _HAND_OVER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    kernels = ["all_gather", "all_gather_into_params_", "reduce_scatter", "reduce_scatter_params_"]
    assert out.stdout.strip() == str([("kernels", kernels), ("steady", True), ("steady", False)]), out.stdout
