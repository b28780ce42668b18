"""Bounded waits for the CUDA transport: a host thread that ends a process whose TIDE op never completes.

TIDE's waits are stream memory operations on flag words: a peer that dies or issues a different
sequence leaves them waiting forever, and no kernel spins that could time out. So every TIDE op ends with
a stream memop on the caller's stream that writes its sequence number into a pinned host word, and one
daemon thread per process (started with the first arena) polls those words: plain memory reads, no CUDA
call. An arena's eager ops are listed in C++ from before each issues anything (its in-flight list,
csrc/transport/driver.h), whether Python or the ops' C++ kernels issued them; other work (the
direct NCCL rails) is tracked one :class:`Completion` at a time. (``cudaEventQuery`` blocked on the GPU
machine: the training thread's launches had filled the stalled streams' queue and spun in the driver under
a lock the query needed.) When an op has not completed ``timeout_s`` after it was issued
(``TIDE_TIMEOUT_S``, else the process group's timeout), the thread

1. writes a report to stderr: the op, the group, how long, and which peers' flag words are behind this
   rank's issued work and by how much (``tide/transport/flag_report.py``), plus every thread's stack;
2. makes the next TIDE op or FSDP2 collective of the training thread raise :class:`TideTimeoutError`
   with that report (the ops' C++ kernels hand every call to Python from then on: the expiry hooks);
3. ends the process with exit code :data:`EXIT_CODE` after a grace of min(:data:`GRACE_S`, timeout)
   seconds, whatever the training thread is doing (it may be blocked on the stalled GPU): like stock
   FSDP2 under ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, continuing after a failed collective is not safe.

An op captured into a CUDA graph runs at every replay, with no host call to track it: it has a replay
mark instead (``csrc/transport/replays.h``: pinned words its first stream operation sets active and its
last, a one-thread kernel, counts done and clears). The thread watches every captured op for the
arena's life; one that stays active with its done count unchanged for ``timeout_s`` expires the same way.

The report gets at most :data:`REPORT_S`, so a survivor of a dead peer ends within timeout + poll +
report + grace < timeout + 15 s. A report wedged in a call that keeps the GIL (a torch CUDA call blocked
in the driver) would stall every Python thread, this one too; so before anything else the thread arms a
backstop that needs no GIL (``faulthandler``'s own thread): one second after the grace it prints every
thread's stack and ends the process with :data:`BACKSTOP_EXIT_CODE`. The cost on the healthy path is one
stream memop and one list append per op.

CPU tensors (the reference backend) have the other fault system: every call agreed by its ranks through
the group's store before anything is issued, each wait bounded by a watcher thread, errors raised and the
group left usable where nothing was issued (``tide/ops/calls.py``, with ``call_exchange.py``,
``call_groups.py`` and ``call_watcher.py``).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tide import trace
from tide.timeouts import TideTimeoutError, did_not_complete

EXIT_CODE = 124
BACKSTOP_EXIT_CODE = 1  # faulthandler's exit status, when the watchdog's own thread could not run
GRACE_S = 10.0
POLL_S = 0.25
# The most the flag report may take before the report goes out without the rest: its lines that need no
# CUDA call (the issued board) come first, so a copy of the flag words blocked in a wedged driver costs only
# this, and the exit stays well inside timeout + 15 s (24.6 s with 4 s here, on the GPU machine).
REPORT_S = 2.0


def _trace_slow(completed: list, pending: list, now: float) -> None:
    """Trace lines for ops pending past trace.LATE_S (once each), and for those when they complete."""
    for p in pending:
        if not p.traced_late and now - p.issued > trace.LATE_S:
            p.traced_late = True
            trace.event(f"watchdog: {p.op} on group {p.group} still pending {now - p.issued:.1f} s after its issue")
    for p in completed:
        if p.traced_late:
            trace.event(f"watchdog: {p.op} on group {p.group} completed {now - p.issued:.1f} s after its issue")


@dataclass
class _Pending:
    done: Any  # query() -> bool, true once the op has completed (no CUDA call); None: an in-flight or captured op
    op: str
    group: str
    timeout_s: float
    describe: Callable[[], Iterable[str]]  # yields the flag report's lines, called once on expiry
    issued: float = field(default_factory=time.monotonic)
    traced_late: bool = False
    replaying: bool = False  # a captured op, in a replay of its graph


@dataclass
class _InFlight:
    in_flight: Any  # the extension's InFlight of one arena
    group: str
    timeout_s: float
    describe: Callable[[], Iterable[str]]
    owner: object
    late: tuple | None = None  # (ticket, op, issued) of the oldest op traced as late


@dataclass
class _Captured:
    mark: int  # the op's replay mark (csrc/transport/replays.h)
    op: str
    group: str
    timeout_s: float
    describe: Callable[[], Iterable[str]]
    owner: object  # what the mark belongs to (an arena's key): forgotten together
    since: float | None = None  # when it was first seen active with its current done count
    done: int = -1

    def stalled(self, active: int, done: int, now: float) -> bool:
        """Whether the op, seen (``active``, ``done``) at ``now``, has been in one replay past its timeout."""
        if not active:
            self.since = None
            return False
        if self.since is None or done != self.done:
            self.since, self.done = now, done
            return False
        return now - self.since > self.timeout_s


class Watchdog:
    """Tracks issued ops until they complete; on expiry reports, fails the next op, then ends the process."""

    def __init__(self, *, poll_s: float = POLL_S, grace_s: float = GRACE_S, exit_code: int = EXIT_CODE) -> None:
        self.poll_s, self.grace_s, self.exit_code = poll_s, grace_s, exit_code
        self.error: TideTimeoutError | None = None
        self._pending: list[_Pending] = []
        self._captured: dict[int, list[_Captured]] = {}  # device -> its captured ops
        self._in_flight: list[_InFlight] = []  # every arena's eager ops
        self._on_expiry: list[Callable[[], None]] = []
        self._read_marks: Callable[[int, int, int], list] | None = None  # (device, first, count) -> (active, done)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def track(self, done: Any, op: str, group: str, timeout_s: float, describe: Callable[[], Iterable[str]]) -> None:
        """Watch one issued op: ``done.query()`` turns true when it has completed."""
        if trace.ENABLED:
            trace.event(f"watchdog: tracking {op} on group {group}")
        with self._lock:
            self._pending.append(_Pending(done, op, group, timeout_s, describe))
        self._start()

    def track_captured(self, read_marks: Callable[[int, int, int], list], device: int, mark: int, op: str,
                       group: str, timeout_s: float, describe: Callable[[], Iterable[str]], owner: object) -> None:
        """Watch one op captured into a CUDA graph, at every replay, until :meth:`forget` (``owner``):
        ``read_marks(device, first, count)`` reads the (active, done) words of replay marks."""
        with self._lock:
            self._read_marks = read_marks
            self._captured.setdefault(device, []).append(_Captured(mark, op, group, timeout_s, describe, owner))
        self._start()

    def track_in_flight(self, in_flight, group: str, timeout_s: float, describe: Callable[[], Iterable[str]],
                        owner: object) -> None:
        """Watch one arena's eager ops until :meth:`forget` (``owner``): ``in_flight.oldest()`` names the
        oldest not completed (csrc/transport/driver.h)."""
        with self._lock:
            self._in_flight.append(_InFlight(in_flight, group, timeout_s, describe, owner))
        self._start()

    def on_expiry(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when an op expires: once the error is set, before the report."""
        self._on_expiry.append(hook)

    def forget(self, owner: object) -> None:
        """Stop watching the ops of ``owner`` (its arena closed: its graphs cannot replay)."""
        with self._lock:
            for device, ops in list(self._captured.items()):
                self._captured[device] = [c for c in ops if c.owner is not owner]
            self._in_flight = [w for w in self._in_flight if w.owner is not owner]

    def captured(self) -> int:
        with self._lock:
            return sum(map(len, self._captured.values()))

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tide-watchdog", daemon=True)
                self._thread.start()

    def _stalled_captured(self, now: float) -> _Pending | None:
        """The captured op stalled longest in a replay past its timeout, as a pending op, or None."""
        worst = None
        for device, ops in self._captured.items():
            if not ops:
                continue
            first = min(c.mark for c in ops)
            states = self._read_marks(device, first, max(c.mark for c in ops) - first + 1)
            for c in ops:
                if c.stalled(*states[c.mark - first], now) and (worst is None or c.since < worst.since):
                    worst = c
        if worst is None:
            return None
        return _Pending(None, f"{worst.op} (captured in a CUDA graph, replaying)", worst.group, worst.timeout_s,
                        worst.describe, issued=worst.since, replaying=True)

    def check(self) -> None:
        """Raise the watchdog's error, if an op has timed out (the training thread calls this per op)."""
        if self.error is not None:
            raise self.error

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _run(self) -> None:
        while True:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self._lock:
                still, completed = [], []
                for p in self._pending:
                    (completed if p.done.query() else still).append(p)
                self._pending = still
                late = [p for p in self._pending if now - p.issued > p.timeout_s]
                late += [p for p in (self._stalled_captured(now), *self._oldest_in_flight(now)) if p is not None]
            if trace.ENABLED:
                _trace_slow(completed, still, now)
                self._trace_in_flight(now)
            if late:
                self._expire(min(late, key=lambda p: p.issued), now)
                return

    def _oldest_in_flight(self, now: float) -> list[_Pending]:
        """Each arena's oldest eager op past its timeout, as a pending op."""
        late = []
        for w in self._in_flight:
            oldest = w.in_flight.oldest()
            if oldest is not None and oldest[2] > w.timeout_s:
                late.append(_Pending(None, oldest[1], w.group, w.timeout_s, w.describe, issued=now - oldest[2]))
        return late

    def _trace_in_flight(self, now: float) -> None:
        """Trace lines for an arena's oldest op pending past trace.LATE_S, and for it once it completed."""
        for w in self._in_flight:
            oldest = w.in_flight.oldest()
            ticket = oldest[0] if oldest is not None else None
            if w.late is not None and w.late[0] != ticket:
                trace.event(f"watchdog: {w.late[1]} on group {w.group} "
                            f"completed {now - w.late[2]:.1f} s after its issue")
                w.late = None
            if oldest is not None and w.late is None and oldest[2] > trace.LATE_S:
                w.late = (ticket, oldest[1], now - oldest[2])
                trace.event(f"watchdog: {oldest[1]} on group {w.group} still pending {oldest[2]:.1f} s after its issue")

    def _expire(self, p: _Pending, now: float) -> None:
        # The report gets a bounded time of its own, and a backstop that needs no GIL is armed first: a
        # flag report that blocks in the driver, with or without the GIL, cannot keep the process alive.
        grace = min(self.grace_s, p.timeout_s)
        faulthandler.dump_traceback_later(REPORT_S + grace + 1, exit=True)
        since = "it began this replay" if p.replaying else "it was issued"
        headline = (f"{did_not_complete(p.op, f'group {p.group}', now - p.issued, since, p.timeout_s)}. A peer "
                    "died, stalled, or issued a different sequence of TIDE ops.")
        # The headline goes out at once: a training thread that raises and ends early still leaves it.
        sys.stderr.write(headline + "\n")
        sys.stderr.flush()
        self.error = TideTimeoutError(f"{headline} (the flag report follows on stderr)")
        for hook in self._on_expiry:  # after the error is set: a call they send back to Python raises it
            hook()
        detail = _bounded_call(p.describe, REPORT_S)
        report = (f"{headline}\n{detail}\ntide: the next TIDE op or FSDP2 collective raises this; the process "
                  f"exits with code {self.exit_code} in {grace:g} s.")
        self.error = TideTimeoutError(report)
        sys.stderr.write(f"{detail}\ntide: the next TIDE op or FSDP2 collective raises this; the process exits "
                         f"with code {self.exit_code} in {grace:g} s.\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        time.sleep(grace)
        sys.stderr.flush()
        os._exit(self.exit_code)


def _bounded_call(describe: Callable[[], Iterable[str]], seconds: float) -> str:
    """The lines ``describe()`` yields within ``seconds``, then a line saying why the rest is missing: it
    raised, or did not finish in time (the lines before a blocking call still go out)."""
    lines: list[str] = []
    finished = threading.Event()

    def call() -> None:
        try:
            for line in describe():
                lines.append(line)
        except Exception as e:  # the report must not keep the process alive
            lines.append(f"  flag words unreadable: {type(e).__name__}: {e}")
        finished.set()

    worker = threading.Thread(target=call, name="tide-watchdog-report", daemon=True)
    worker.start()
    worker.join(seconds)
    done = finished.is_set()  # before the lines are read: a line added after this is not lost unmarked
    got = list(lines)
    if not done:
        got.append(f"  flag words unreadable: the report did not finish in {seconds:g} s")
    return "\n".join(got)


WATCHDOG = Watchdog()


class Completion:
    """One op's completion, for the watchdog, tracked from before its issue: the op's word in the
    extension's pinned host ring (csrc/transport/driver.h), read with no CUDA call. Until the issuing
    call returns it is pending, since a launch can block on a stream whose queue is full behind a dead
    peer's flags. It holds no arena: a closed arena is never kept alive, or destroyed, by the
    watchdog's thread."""

    __slots__ = ("_ext", "_device", "_op", "_issuing")

    def __init__(self, ext, device: int) -> None:
        self._ext, self._device, self._op, self._issuing = ext, device, None, True

    def issued(self, op: int | None) -> None:
        """The issuing call returned: ``op`` is the id its completion word gets, or None if it issued nothing."""
        self._op, self._issuing = op, False

    def query(self) -> bool:
        if self._issuing:
            return False
        return self._op is None or self._ext.op_completed(self._device, self._op)
