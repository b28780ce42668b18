"""Every call of the reference backend agreed by its ranks before anything is issued, and every wait
bounded and named (CPU tensors; the CUDA transport has no per-call host exchange).

A call goes through four steps on each rank:

1. **Local checks** (``tide.meta.checks``: shapes, dtypes, world size, requires-grad, overlapping
   outputs). A failure is not raised yet: it is this rank's outcome.
2. **One call on a group at a time.** A second thread that calls while a TIDE call on the group is in
   flight on this rank raises :class:`TideConcurrentCallError` at once, before anything is exchanged (so
   the backend never sees two TIDE collectives of one group at once).
3. **The exchange.** Each rank publishes its call's record in the group's store under the call's number
   (the group's n-th TIDE call on this rank): the op, the tensors' shapes and dtypes and the flags (a
   CRC32 of the whole, and its first characters in words), the identity the caller declared
   (``tide.call_identity``: FSDP2's module, phase and count, a training step), the calling thread's name
   and its count of calls on the group, and the outcome of step 1. It then reads every peer's record of
   that number. A rank's failed check raises on every rank (naming the rank and its error; the failing
   rank raises its own); records that differ raise on every rank, naming both sides' calls in words.
   Nothing was issued, so the group stays usable.
4. **The collectives**, each wait bounded by the call's timeout.

The exchange never waits unbounded. A daemon thread (:class:`_Watcher`, started with the first call that
waits) looks every :data:`POLL_S` at the exchanges in progress: a missing peer whose process has ended
(its pid, published at its first call on the group, gone or a zombie on this host) gets a tombstone in
place of its record at once, and every missing peer gets one when the call's timeout has passed
(``TIDE_TIMEOUT_S``, else the process group's timeout). Tombstones are written with compare-and-set, so
a record and a tombstone never both land: a peer that arrives after its tombstone raises too, with
nothing issued. Waiting ranks raise :class:`TidePeerError` (a peer died) or
:class:`tide.timeouts.TideTimeoutError` with the report the CUDA watchdog gives: the op, the
group, every rank's state (process state, the call it is at or its last call in words) and who is behind.
A collective that fails because a peer died raises :class:`TidePeerError` naming that rank, with the
backend's error kept as the cause; one that does not complete within the timeout raises
``TideTimeoutError``. After either, the group is marked broken: its pending or failed collectives make it
unusable, and every later TIDE call on it raises at once.

A rank whose ``group_name`` names no group it knows (or whose typed call's ``group`` is no process group)
cannot reach that group's exchange: it leaves a notice in the default group's store (:func:`notify_refusal`),
which a waiting peer's watcher turns into the tombstone of its call; every rank raises with its error and
the ranks stay in step. Ranks that are threads of one process (torch's threaded test backend) share this
process's state, so their calls are refused at once, on every thread.

What cannot be caught: two direct calls with the same op, layout and declared identity are the same
call to every rank (as with NCCL), so a rank that skipped one pairs its next call with the skipped one,
and only the rank left with an unmatched call ends (as above, naming each peer's last call). Declare an
identity that tells them apart (a training loop's step) to have the skip caught at once on every rank.

State is per group object (``tide/ops/call_groups.py``): a re-created group of the same name starts
afresh. The exchange and its reports are ``tide/ops/call_exchange.py``, the watcher
``tide/ops/call_watcher.py``. Cost of an agreed call: three store round trips (compare-and-set, a wait and
a read) on a connection per thread and store server, plus one deferred delete on the watcher's.

The CUDA transport has the other fault system: each new plan agreed once (``tide/transport/issue.py``),
then no host exchange; an op that never completes is ended by the watchdog (``tide/transport/watchdog.py``,
with the issued board ``board.py`` and ``flag_report.py``), which reports who is behind and ends the process.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

from tide.meta import checks
from tide.ops import call_exchange
from tide.ops.call_exchange import DESC_CHARS, EXC_TYPES, TidePeerError, collective_failed, peer_lines, record_words
from tide.ops.call_groups import GroupState, notify_refusal, state_of, threaded_ranks
from tide.agreement import CallRecord, different_calls, first_difference
from tide.timeouts import TideTimeoutError, did_not_complete

__all__ = ["Call", "TideConcurrentCallError", "TidePeerError", "agreed", "refuse", "refuse_without_group",
           "resolve_group", "world_size_error"]

class TideConcurrentCallError(RuntimeError):
    """A TIDE call on a group while another thread's TIDE call on it was in flight on this rank."""


def resolve_group(op: str, group_name: str) -> dist.ProcessGroup:
    """The process group registered as ``group_name``."""
    try:
        return _resolve_process_group(group_name)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"tide.{op}: group_name {group_name!r} does not name a registered process group") from e


def world_size_error(op: str, world_size: int, group: dist.ProcessGroup) -> ValueError | None:
    if group.size() == world_size:
        return None
    return ValueError(f"tide.{op}: world_size={world_size} but group {group.group_name!r} has {group.size()} ranks")



def _fingerprint(rec: dict) -> tuple:
    return rec["op"], rec["crc"], rec["id"], rec["thread"], rec["tcount"]


def _mismatch(op: str, state: GroupState, n: int, mine: dict, p: int, theirs: dict) -> RuntimeError:
    ranks = f"tide.{op}: ranks of {state.describe()}"
    tail = ". Nothing was exchanged: a rank skipped, added or reordered a TIDE call"
    if mine["crc"] != theirs["crc"] or mine["op"] != theirs["op"]:
        where = first_difference(mine["desc"], theirs["desc"])
        if mine["desc"] == theirs["desc"]:
            where = f"beyond their first {DESC_CHARS} characters"
        return RuntimeError(different_calls(ranks, n, state.rank, record_words(mine), p, record_words(theirs))
                            + f"; their op or layouts first differ at {where}{tail}")

    def which(rec: dict) -> str:
        words = rec["id"] or "no declared identity"
        if mine["thread"] != theirs["thread"] or mine["tcount"] != theirs["tcount"]:
            words += f", from thread {rec['thread']!r} (its call {rec['tcount']} on the group)"
        return words

    layout = mine["desc"] if len(mine["desc"]) <= 300 else mine["desc"][:300] + "..."
    return RuntimeError(different_calls(ranks, n, state.rank, f"[{which(mine)}]", p, f"[{which(theirs)}]")
                        + f", both {layout}{tail}")



def _judge(op: str, state: GroupState, n: int, records: dict[int, dict], refused_here: bool) -> None:
    """Raise on every rank alike (this rank's own check error is raised by the caller): a peer's check error,
    or calls that differ."""
    if refused_here:
        return
    refused = [p for p, r in sorted(records.items()) if r["error"]]
    if refused:
        p = refused[0]
        kind, msg = records[p]["error"]
        others = f" (and rank(s) {refused[1:]})" if refused[1:] else ""
        raise EXC_TYPES.get(kind, RuntimeError)(
            f"tide.{op}: rank {p}{others} of {state.describe()} refused call {n}, so no rank issued it: {msg}")
    mine = records[state.rank]
    for p, theirs in sorted(records.items()):
        if _fingerprint(theirs) != _fingerprint(mine):
            raise _mismatch(op, state, n, mine, p, theirs)


# ---------------------------------------------------------------------------------------------- the call
class Call:
    """An agreed call's group, and its bounded waits."""

    __slots__ = ("op", "group", "state", "n", "records")

    def __init__(self, op: str, group: dist.ProcessGroup, state: GroupState | None, n: int,
                 records: dict | None = None) -> None:
        self.op, self.group, self.state, self.n, self.records = op, group, state, n, records

    def wait(self, works: Sequence) -> None:
        """Wait for the call's collectives, each bounded by the call's timeout (unbounded off CPU, as before).
        A collective that fails raises :class:`TidePeerError` naming the peer that ended (the backend's
        error as the cause); one past the timeout raises ``TideTimeoutError``. Either breaks the group."""
        if self.state is None:
            for w in works:
                w.wait()
            return
        state = self.state
        deadline = time.monotonic() + state.timeout_s
        for w in works:
            try:
                w.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                if not w.is_completed():
                    headline = did_not_complete(self.op, state.describe(), state.timeout_s,
                                                "its collectives were issued", state.timeout_s)
                    err = TideTimeoutError(
                        f"{headline}, though every rank had agreed to call {self.n}: a peer stalled inside it. The "
                        f"group cannot be used again.\n{peer_lines(state, self.n, self.records, state.store)}")
                else:
                    err = collective_failed(self.op, state, self.n, self.records, e)
                state.broken = str(err)
                try:
                    raise err from e
                finally:
                    del err  # no cycle through this frame



class agreed:  # noqa: N801 (a context manager, used like a function)
    """Steps 1-3 of the module doc for one call, then the block (the collectives) with the call in flight.

    ``check()`` runs the op's argument checks (``tide.meta.checks``); ``outputs`` / ``inputs`` are
    ``(name, tensors)`` pairs for the requires-grad and overlap checks, ``may_alias(rank)`` the in-place
    allowance, ``flags(group)`` the extra fields of the description (``desc_lists``'s tensors make its
    layout). Yields a :class:`Call`."""

    __slots__ = ("_args", "_state", "_held")

    def __init__(self, op: str, group_name: str, world_size: int, desc_lists, outputs, inputs,
                 check: Callable[[], None], flags: Callable = lambda group: (), may_alias: Callable | None = None):
        self._args = (op, group_name, world_size, desc_lists, outputs, inputs, check, flags, may_alias)
        self._state = None
        self._held = False

    def __enter__(self) -> Call:
        op, group_name, world_size, desc_lists, outputs, inputs, check, flags, may_alias = self._args
        # A check's error is kept without its traceback (this frame in it, and it in this frame, would be a
        # reference cycle keeping the call's state, and a destroyed group's store, alive until a gc run).
        error = None
        try:
            check()
        except (ValueError, TypeError) as e:
            error = e.with_traceback(None)
        first = next((t for _, ts in (*inputs, *outputs) for t in ts), None)
        try:
            group = resolve_group(op, group_name)
        except ValueError as e:
            if first is None or first.device.type == "cpu":
                notify_refusal(op, _unknown_group_words(group_name), e if error is None else error)
            raise
        if threaded_ranks(group):  # every thread refuses alike, at once: nothing to agree
            raise RuntimeError(f"tide.{op}: the ranks of group {group.group_name!r} are threads of one process "
                               f"(torch's threaded test backend); TIDE's ops need a process per rank")
        if error is None:
            error = world_size_error(op, world_size, group)
        extra = ()
        if error is None:
            try:
                checks.check_no_grad(op, (*inputs, *outputs))
                checks.check_no_overlap(op, outputs, inputs, may_alias(group.rank()) if may_alias else None)
                extra = tuple(flags(group))
            except (ValueError, TypeError) as e:
                error = e.with_traceback(None)
        if first is not None and first.device.type != "cpu":  # no exchange off CPU (it would stall on the GPU)
            if error is not None:
                box = [error]
                del error  # this frame is in the raised error's traceback: holding it would make a cycle
                _raise(box.pop())
            return Call(op, group, None, 0)
        state = self._state = state_of(group)
        thread = threading.current_thread()
        with state.count_lock:  # counted before the in-flight check: a refused call is a call of its thread
            tcount = state.thread_calls[thread] = state.thread_calls.get(thread, 0) + 1
        if state.broken:
            raise RuntimeError(f"tide.{op}: {state.describe()} cannot be used after an earlier failure of a TIDE "
                               f"call on it: {state.broken.splitlines()[0]}")
        if not state.lock.acquire(blocking=False):
            raise TideConcurrentCallError(
                f"tide.{op}: {state.describe()} already has a TIDE call in flight on this rank ({state.in_flight}); "
                f"thread {thread.name!r} may not issue another until it returns: issue a group's TIDE calls from one "
                f"thread at a time (nothing was issued)")
        self._held = True
        state.calls += 1
        n = state.calls
        state.in_flight = f"tide.{op}, call {n}, from thread {thread.name!r}"
        call = CallRecord.of(op, n, desc_lists, extra)
        rec = {"n": n, "op": op, "desc": call.desc[:DESC_CHARS], "cut": len(call.desc) > DESC_CHARS,
               "crc": call.digest, "id": call.identity,
               "thread": thread.name, "tcount": tcount,
               "error": [type(error).__name__, str(error)] if error is not None else None}
        try:
            records = call_exchange.exchange(op, state, rec)
            _judge(op, state, n, records, error is not None)
        except BaseException:
            self._release()
            raise
        if error is not None:
            self._release()
            box = [error]
            del error  # as above
            _raise(box.pop())
        return Call(op, group, state, n, records)

    def __exit__(self, *exc) -> None:
        self._release()

    def _release(self) -> None:
        if self._held:
            self._held = False
            self._state.in_flight = ""
            self._state.lock.release()


def _raise(error: BaseException) -> None:
    """Raise ``error`` from a frame that does not keep it (a frame in an exception's own traceback that holds
    it in a local makes a cycle, which would keep the call's state, and a destroyed group's store, alive
    until the garbage collector runs)."""
    try:
        raise error
    finally:
        del error


def _unknown_group_words(group_name: str) -> str:
    return f"with group_name {group_name!r}, which names no group it knows"


def refuse(op: str, group_name: str, world_size: int, tensor_lists, error: BaseException) -> None:
    """Raise ``error`` (a check of ``op`` failed before its call could be built) on every rank: on CPU the
    refusal goes through the call's exchange as the mutating op's would, so peers that are issuing their
    call raise too instead of waiting. Meta tensors say nothing of where the call runs: a call with no other
    tensor is exchanged when the group runs CPU collectives. Always raises."""
    holder = [error]
    del error

    def check():
        raise holder.pop()

    lists = [list(ts) for ts in tensor_lists]
    placed = [t for ts in lists for t in ts if t.device.type != "meta"]
    try:
        group = resolve_group(op, group_name)
    except ValueError:
        if all(t.device.type == "cpu" for t in placed):
            notify_refusal(op, _unknown_group_words(group_name), holder[0])
        _raise(holder.pop())
    try:
        if not placed:  # no tensor says where the call runs: exchange when the group runs CPU collectives
            group._get_backend(torch.device("cpu"))
            placed = [torch.empty(0)]
    except RuntimeError:
        _raise(holder.pop())
    agreed(op, group_name, world_size, lists, (), (("arg0", placed),), check).__enter__()  # raises the refusal


def refuse_without_group(op: str, what: str, tensors, error: BaseException) -> None:
    """Raise ``error``, a refusal of ``op`` made before any group was known (``what`` says why, in words),
    after telling the peers through the default group's store when ``tensors`` are on the CPU (:func:`notify_refusal`).
    Always raises."""
    holder = [error]
    del error
    if all(t.device.type in ("cpu", "meta") for t in tensors):
        notify_refusal(op, what, holder[0])
    _raise(holder.pop())
