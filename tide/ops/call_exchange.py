"""The exchange of one agreed call of the reference backend (``tide/ops/calls.py``, step 3 of its module
doc), and the reports of a call that failed: every peer's process state and where it is.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable

from tide import procfs
from tide.agreement import peer_words
from tide.ops.call_groups import BACKSTOP_S, HOST, SCAN_BACK, GroupState
from tide.ops.call_watcher import WATCHER, Watch
from tide.timeouts import TIMEOUT_WORDS, TideTimeoutError, did_not_complete

DESC_CHARS = 2000  # the description's characters a record carries in words (the CRC covers all of it)
EXC_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


class TidePeerError(RuntimeError):
    """A peer of a TIDE call ended, or the connection to it (or to the group's store) failed; the
    backend's error, if any, is the ``__cause__``."""



def record_words(rec: dict) -> str:
    """A record in words: the op and layout, the declared identity, the thread when it matters."""
    if "tomb" in rec:
        return f"nothing (its record was replaced: {rec['tomb']}, by rank {rec['by']})"
    words = rec["desc"] + ("..." if rec.get("cut") else "")
    if rec["id"]:
        words += f" [{rec['id']}]"
    if rec["thread"] != "MainThread":
        words += f" from thread {rec['thread']!r} (its call {rec['tcount']} on the group)"
    if rec["error"]:
        words += f", refused: {rec['error'][1]}"
    return words



def _store_error(op: str, state: GroupState, n: int, e: BaseException) -> TidePeerError:
    lines = peer_lines(state, n, None, state.store)
    err = TidePeerError(f"tide: {op} on {state.describe()}: the group's store failed at call {n} (its server, in "
                        f"the process that created it, may have ended): {type(e).__name__}: {e}\n{lines}")
    state.broken = str(err)
    return err


def peer_lines(state: GroupState, n: int, records: dict | None, store_of: Callable) -> str:
    """One line per peer: its process state and where it is (at this call, or its last call)."""
    lines = []
    for p in range(state.size):
        if p == state.rank:
            continue
        try:
            store = store_of()
            who, life = state.peer(p, store)
            rec = (records or {}).get(p)
            if rec is not None and "tomb" not in rec:
                where = f"at call {n}, like this rank"
            else:
                last = state.last_record(p, n, store)
                if last is None and n == 1:
                    where = "behind: it has issued no TIDE call on this group yet"
                elif last is None:
                    where = f"behind: no call of it within the {SCAN_BACK} before call {n}"
                elif "tomb" in last:
                    where = f"behind: its last call slot, {last['n']}, holds a tombstone ({last['tomb']})"
                else:
                    where = f"behind by {n - last['n']} call(s): its last call is {last['n']}, {record_words(last)}"
        except Exception as e:  # the store is gone: say what is known
            who = state.who.get(p)
            life = procfs.state(who["pid"]) if who and who["host"] == HOST else "state unknown"
            where = f"unknown (the store failed: {type(e).__name__})"
        global_rank = state.global_ranks[p] if state.global_ranks else None
        lines.append(f"  {peer_words(p, global_rank, who['pid'] if who else None, life)}: {where}")
    return "\n".join(lines)


def exchange(op: str, state: GroupState, rec: dict) -> dict[int, dict]:
    """Publish ``rec`` as this rank's record of call ``rec["n"]`` and return every rank's; raises when a
    peer ended, the timeout passed, or this rank came after its own tombstone."""
    if state.size == 1:
        return {state.rank: rec}
    store = _publish(op, state, rec)
    n = rec["n"]
    peers = [p for p in range(state.size) if p != state.rank]
    start = time.monotonic()
    records = {state.rank: rec, **_read_peers(op, state, n, peers, store, start)}
    tombs = {p: r for p, r in records.items() if "tomb" in r}
    if tombs:
        _raise_missing(op, state, rec, records, tombs, time.monotonic() - start)
    if len(state.who) < len(peers):  # every peer has published its pid before its record: keep them all,
        try:                         # so that a peer is named even after the store is gone
            for p, v in zip(peers, store.multi_get([state.who_key(p) for p in peers])):
                state.who[p] = json.loads(v)
        except RuntimeError as e:
            raise _store_error(op, state, n, e) from e
    done, state.kept = state.kept[:-1], state.kept[-1:]
    if done:  # every peer published call n, so every peer has read this rank's earlier records
        WATCHER.delete(state, [state.key(k, state.rank) for k in done])
    return records


def _publish(op: str, state: GroupState, rec: dict):
    """Write ``rec`` into this rank's slot of its call (compare-and-set: a peer's tombstone may be there first)
    and return the thread's store connection. A slot holding this rank's own notice of a call that named no
    group is that call's: ``rec`` takes the next number."""
    n = rec["n"]
    mine = json.dumps(rec)
    try:
        state.connect()
        store = state.store()
        if not state.published:
            store.set(state.who_key(state.rank), json.dumps({"host": HOST, "pid": os.getpid()}))
            state.published = True
        got = store.compare_set(state.key(n, state.rank), "", mine).decode()
        state.kept.append(n)
        while got != mine and json.loads(got).get("pid") == os.getpid() and json.loads(got)["tomb"] == "refused":
            tomb = json.loads(got)
            state.calls += 1
            n = rec["n"] = state.calls
            thread = threading.current_thread()
            if tomb["thread"] == thread.name:
                with state.count_lock:
                    rec["tcount"] = state.thread_calls[thread] = state.thread_calls.get(thread, 0) + 1
            mine = json.dumps(rec)
            got = store.compare_set(state.key(n, state.rank), "", mine).decode()
            state.kept.append(n)
    except RuntimeError as e:
        raise _store_error(op, state, n, e) from e
    if got == mine:
        return store
    tomb = json.loads(got)  # a peer replaced this rank's record before it came: nothing may be issued
    if tomb["tomb"] == "timeout":
        raise TideTimeoutError(
            f"tide: {op} on {state.describe()}: this rank {state.rank} reached call {n} after rank {tomb['by']} "
            f"had given up waiting for it ({tomb['after_s']:g} s: {TIMEOUT_WORDS}); nothing was exchanged. "
            f"Rank {tomb['by']} raised a timeout naming this rank as behind.")
    if tomb["tomb"] == "refused":  # another process's notice landed in this slot: the pid was reused
        raise TidePeerError(f"tide: {op} on {state.describe()}: rank {tomb['by']} took a notice of another "
                            f"process (pid {tomb['pid']}) for this rank's at call {n}; nothing was exchanged")
    raise TidePeerError(f"tide: {op} on {state.describe()}: rank {tomb['by']} took this rank {state.rank} for "
                        f"ended at call {n} ({tomb.get('life')}); nothing was exchanged")


def _read_peers(op: str, state: GroupState, n: int, peers: list[int], store, start: float) -> dict[int, dict]:
    """Every peer's record of call ``n`` (or the tombstone the watcher wrote in its place)."""
    watch = Watch(state, n, op, start + state.timeout_s)
    WATCHER.watch(watch)
    try:
        values = store.multi_get([state.key(n, p) for p in peers])
    except RuntimeError as e:
        if time.monotonic() - start < state.timeout_s + BACKSTOP_S - 0.5:
            raise _store_error(op, state, n, e) from e
        values = [store.compare_set(state.key(n, p), "", json.dumps(
            {"tomb": "timeout", "by": state.rank, "n": n, "after_s": state.timeout_s})) for p in peers]
    finally:
        WATCHER.unwatch(watch)
    return {p: json.loads(v) for p, v in zip(peers, values)}


def _raise_missing(op: str, state: GroupState, rec: dict, records: dict, tombs: dict, waited: float) -> None:
    """Raise for the peers whose records are tombstones: a refusal, a peer that ended, or a timeout."""
    n = rec["n"]
    lines = peer_lines(state, n, records, state.store)
    me = f"  this rank {state.rank}, process {os.getpid()}: at call {n}: {record_words(rec)}"
    ended = sorted(p for p, r in tombs.items() if r["tomb"] == "ended")
    refused = sorted(p for p, r in tombs.items() if r["tomb"] == "refused")
    if refused and not ended:
        p = refused[0]
        t = tombs[p]
        raise EXC_TYPES.get(t["type"], RuntimeError)(
            f"tide.{op}: rank {p} of {state.describe()} refused call {n}, so no rank issued it: it called "
            f"tide.{t['op']} {t['what']}: {t['error']}")
    if ended:
        msg = (f"tide: {op} on {state.describe()}: rank(s) {ended} ended (process gone) without reaching call {n}; "
               f"nothing was exchanged, and the group cannot be used again.\n{me}\n{lines}")
        state.broken = msg
        raise TidePeerError(msg)
    raise TideTimeoutError(
        f"{did_not_complete(op, state.describe(), waited, 'it was issued', state.timeout_s)}: rank(s) "
        f"{sorted(tombs)} are behind (a peer died, stalled, or issued a different sequence of TIDE ops). Nothing was "
        f"exchanged.\n{me}\n{lines}")


def collective_failed(op: str, state: GroupState, n: int, records: dict | None, e: BaseException) -> TidePeerError:
    """The error of a collective the backend failed: the peer(s) whose process ended, once /proc says so (a
    process that closed its sockets takes a moment to become a zombie)."""
    ended: list[int] = []
    deadline = time.monotonic() + 2.0
    while True:
        try:
            store = state.store()
            ended = [p for p in range(state.size) if p != state.rank and procfs.ended(state.peer(p, store)[1])]
        except Exception:
            ended = [p for p, who in state.who.items()
                     if who["host"] == HOST and procfs.ended(procfs.state(who["pid"]))]
        if ended or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    who = f"rank(s) {ended} ended (process gone)" if ended else "no peer's process is known to have ended"
    return TidePeerError(
        f"tide: {op} on {state.describe()}: its collective failed at call {n}: {who}; the group cannot be used "
        f"again. The backend said: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}\n"
        f"{peer_lines(state, n, records, state.store)}")

