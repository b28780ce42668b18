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
:class:`tide.transport.watchdog.TideTimeoutError` with the report the CUDA watchdog gives: the op, the
group, every rank's state (process state, the call it is at or its last call in words) and who is behind.
A collective that fails because a peer died raises :class:`TidePeerError` naming that rank, with the
backend's error kept as the cause; one that does not complete within the timeout raises
``TideTimeoutError``. After either, the group is marked broken: its pending or failed collectives make it
unusable, and every later TIDE call on it raises at once.

A rank whose ``group_name`` names no group it knows cannot reach that group's exchange: it leaves a notice
in the default group's store (:func:`notify_refusal`), which a waiting peer's watcher turns into the
tombstone of its call; every rank raises with its error and the ranks stay in step.

What cannot be caught: two direct calls with the same op, layout and declared identity are the same
call to every rank (as with NCCL), so a rank that skipped one pairs its next call with the skipped one,
and only the rank left with an unmatched call ends (as above, naming each peer's last call). Declare an
identity that tells them apart (a training loop's step) to have the skip caught at once on every rank.

State is per group object (a re-created group of the same name starts afresh): its store keys carry the
process's count of group objects of that name and ``TORCHELASTIC_RESTART_COUNT``, so a store that
outlives a group (one passed to ``init_process_group`` again, torchrun's agent store) never shows a new
group an old group's records. Cost of an agreed call: three store round trips (compare-and-set, a wait
and a read) on a connection per thread and store server (:class:`_Server`), plus one deferred delete on
the watcher's.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
import zlib
from collections import Counter
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group, _world

from tide import procfs, trace
from tide.meta import call_site, checks
from tide.agreement import call_desc, first_difference
from tide.timeouts import TideTimeoutError, timeout_for

POLL_S = 0.25  # how often the watcher looks at exchanges in progress (a dead peer is named within this)
BACKSTOP_S = 5.0  # a wait's own bound past the timeout, should the watcher not run
DESC_CHARS = 2000  # the description's characters a record carries in words (the CRC covers all of it)
SCAN_BACK = 8  # how many calls back a report looks for a peer's last record
HOST = socket.gethostname()
_TIMEOUT_WORDS = "TIDE_TIMEOUT_S, else the process group's timeout"


class TidePeerError(RuntimeError):
    """A peer of a TIDE call ended, or the connection to it (or to the group's store) failed; the
    backend's error, if any, is the ``__cause__``."""


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


# ---------------------------------------------------------------------------------------------- per-group state
class _Server:
    """This process's connections to one store server (a TCPStore's host and port): one for the watcher
    and one per thread that issues TIDE calls, shared by every group whose store it serves (each group's
    keys carry its name and instance). Clients only: they keep no server alive. A new connection costs a
    handshake with the server; opening two per group made a run of many short-lived groups wait 5 s
    on the server now and then."""

    def __init__(self, root) -> None:
        self.watch = root.clone()  # made from the server's store once; every later one from this client
        self._local = threading.local()
        self.world = _world_ref()

    def main(self, timeout_s: float):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.watch.clone()
        conn.set_timeout(timedelta(seconds=timeout_s + BACKSTOP_S))
        return conn


_servers: dict[tuple, _Server] = {}


def _world_ref():
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    return weakref.ref(world) if world is not None else (lambda: None)


def _server_for(base) -> _Server:
    """The connections to the server of store ``base`` (a group's PrefixStore chain), without its prefixes
    (the keys are TIDE's own, every group's apart); new ones when the default group was re-created since
    (its store, at the same address, may be another server)."""
    root = getattr(base, "_underlying_non_prefix_store", base)
    host, port = getattr(root, "host", None), getattr(root, "port", None)
    key = (host, port) if host is not None else (id(root),)
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    with _states_lock:
        server = _servers.get(key)
        if server is None or server.world() is not world:
            server = _servers[key] = _Server(root)
            server.watch.set_timeout(timedelta(seconds=60))
    return server


class _GroupState:
    """What this rank knows of one group object: its call count, the call in flight, whether it broke, and
    its store connections (one for this rank's calls, one for the watcher)."""

    def __init__(self, group: dist.ProcessGroup, index: int) -> None:
        self.name = group.group_name
        self.rank, self.size = group.rank(), group.size()
        self.timeout_s = timeout_for(group)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"tide/calls/{restart}/{self.name}/{index}"
        self.index = index
        self._group = weakref.ref(group)  # its store is looked up when this rank first connects
        self._server: _Server | None = None
        self.calls = 0  # TIDE calls agreed (or refused) on this group by this rank
        self.lock = threading.Lock()  # held by the call in flight
        self.count_lock = threading.Lock()
        self.in_flight: str = ""
        self.broken: str = ""  # the failure that broke the group (text: an exception kept here would keep
        # its frames, and through them this state and its store, alive in a reference cycle)
        self.thread_calls: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Thread -> its calls here
        self.who: dict[int, dict] = {}  # peer rank -> {"host", "pid"}, once read
        self.published = False
        self.kept: list[int] = []  # own call numbers whose record slots are still in the store
        try:
            self.global_ranks = dist.get_process_group_ranks(group)
        except (RuntimeError, ValueError):
            self.global_ranks = None
        self._notice_server: _Server | None = None  # the default group's store's (notices)

    def connect(self) -> None:
        """Find (or open) this process's connections to the group's store server at the first call, and the
        default group's for notices (:class:`_Server`). Error paths use only connections already open:
        connecting to a store whose server has ended retries for the store's whole timeout."""
        if self._server is None:
            group = self._group()
            entry = _world.pg_map.get(group) if group is not None else None
            base = entry[1] if entry is not None else dist.PrefixStore(
                f"tide/{self.name}/", dist.distributed_c10d._get_default_store())
            self._server = _server_for(base)
            world = _world_store()
            if world is not None and self.global_ranks is not None:
                self._notice_server = _server_for(world)

    def store(self):
        """This thread's connection (its timeout the call's plus :data:`BACKSTOP_S`)."""
        if self._server is None:
            raise RuntimeError("tide: no connection to the group's store yet")
        return self._server.main(self.timeout_s)

    def watch_store(self):
        """The watcher's connection (a thread's may be blocked in a read)."""
        if self._server is None:
            raise RuntimeError("tide: no connection to the group's store yet")
        return self._server.watch

    def key(self, n: int, rank: int) -> str:
        return f"{self.prefix}/rec/{n}/{rank}"

    def who_key(self, rank: int) -> str:
        return f"{self.prefix}/who/{rank}"

    def describe(self) -> str:
        return f"group {self.name!r} ({self.size} ranks)"

    def peer(self, p: int, store) -> tuple[dict | None, str]:
        """Peer ``p``'s {"host", "pid"} (None if it never published them) and its process state in words."""
        who = self.who.get(p)
        if who is None:
            key = self.who_key(p)
            if store.check([key]):
                who = self.who[p] = json.loads(store.get(key))
        if who is None:
            return None, "no process id published: it has not reached a TIDE call on this group"
        if who["host"] != HOST:
            return who, f"on host {who['host']}, state unknown here"
        return who, procfs.state(who["pid"])

    def notice(self, p: int, since_wall: float) -> dict | None:
        """Peer ``p``'s notice of a call it refused without naming a group (:func:`notify_refusal`), if it
        is from the last timeout before ``since_wall`` and no wait of this process has acted on it yet (the
        first group that misses the peer takes it: the group it meant, unless it was waited for nowhere)."""
        if self._notice_server is None:
            return None
        store = self._notice_server.watch
        g = self.global_ranks[p]
        key = _notice_key(g)
        if not store.check([key]):
            return None
        notice = json.loads(store.get(key))
        with _states_lock:
            if notice["wall"] < since_wall - self.timeout_s or _used_notices.get(g, 0) >= notice["seq"]:
                return None
            _used_notices[g] = notice["seq"]
        store.set(f"{key}/taken/{notice['seq']}", str(self.rank))  # the refusing rank waits for this
        return notice

    def last_record(self, p: int, before: int, store) -> dict | None:
        """Peer ``p``'s latest record (or tombstone) of a call before ``before``, looking :data:`SCAN_BACK` back."""
        for k in range(before - 1, max(0, before - 1 - SCAN_BACK), -1):
            key = self.key(k, p)
            if store.check([key]):
                return json.loads(store.get(key))
        return None


def _ended(state: str) -> bool:
    return state == "gone" or state.startswith(("Z", "X"))


def _world_store():
    """The default group's store, or None."""
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    entry = _world.pg_map.get(world) if world is not None else None
    return entry[1] if entry is not None else None


def _notice_key(global_rank: int) -> str:
    return f"tide/notices/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{global_rank}"


_notices = 0  # notices this process has left
_used_notices: dict[int, int] = {}  # global rank -> the seq of its last notice a wait of this process took


def notify_refusal(op: str, group_name: str, error: BaseException) -> None:
    """This rank refused a call whose ``group_name`` names no group it knows, so it cannot tell that group's
    ranks through the call's exchange: it leaves a notice in the default group's store instead, and waits
    (at most the default group's TIDE timeout) until a peer's wait has taken it. A peer waiting for this
    rank's call reads it (the watcher, every :data:`POLL_S`), replaces this rank's record of that call with
    it, and raises with this rank's error; this rank's next call on that group finds the replaced slot and
    takes the next one, so the ranks stay in step. (A peer that reaches the call more than a timeout later
    pairs it with this rank's next call, as with a skipped call.) Nothing without a default group of
    several ranks."""
    global _notices
    store = _world_store()
    if store is None or dist.get_world_size() == 1:
        return
    _notices += 1
    notice = {"seq": _notices, "op": op, "group_name": group_name, "type": type(error).__name__,
              "error": str(error), "pid": os.getpid(), "wall": time.time(), "thread": threading.current_thread().name}
    key = _notice_key(dist.get_rank())
    try:
        conn = _server_for(store).main(timeout_for(dist.group.WORLD))
        conn.set(key, json.dumps(notice))
        conn.wait([f"{key}/taken/{notice['seq']}"], timedelta(seconds=timeout_for(dist.group.WORLD)))
    except RuntimeError:  # no store, or nobody waited for this rank: its peers end at their timeout, if at all
        pass


_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ProcessGroup -> _GroupState
_instances: Counter = Counter()  # group name -> group objects of that name seen by this process
_states_lock = threading.Lock()


def _state(group: dist.ProcessGroup) -> _GroupState:
    state = _states.get(group)
    if state is None:
        with _states_lock:
            state = _states.get(group)
            if state is None:
                _instances[group.group_name] += 1
                state = _states[group] = _GroupState(group, _instances[group.group_name])
    return state


# ---------------------------------------------------------------------------------------------- records in words
def _record_words(rec: dict) -> str:
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


def _fingerprint(rec: dict) -> tuple:
    return rec["op"], rec["crc"], rec["id"], rec["thread"], rec["tcount"]


def _mismatch(op: str, state: _GroupState, n: int, mine: dict, p: int, theirs: dict) -> RuntimeError:
    head = f"tide.{op}: ranks of {state.describe()} issued different calls at call {n}: "
    tail = ". Nothing was exchanged: a rank skipped, added or reordered a TIDE call"
    if mine["crc"] != theirs["crc"] or mine["op"] != theirs["op"]:
        where = first_difference(mine["desc"], theirs["desc"])
        if mine["desc"] == theirs["desc"]:
            where = f"beyond their first {DESC_CHARS} characters"
        return RuntimeError(f"{head}this rank {state.rank} issued {_record_words(mine)}, rank {p} issued "
                            f"{_record_words(theirs)}; their op or layouts first differ at {where}{tail}")

    def which(rec: dict) -> str:
        words = rec["id"] or "no declared identity"
        if mine["thread"] != theirs["thread"] or mine["tcount"] != theirs["tcount"]:
            words += f", from thread {rec['thread']!r} (its call {rec['tcount']} on the group)"
        return words

    layout = mine["desc"] if len(mine["desc"]) <= 300 else mine["desc"][:300] + "..."
    return RuntimeError(f"{head}this rank {state.rank} issued [{which(mine)}], rank {p} issued [{which(theirs)}], "
                        f"both {layout}{tail}")


_EXC_TYPES = {"ValueError": ValueError, "TypeError": TypeError}


# ---------------------------------------------------------------------------------------------- the watcher
class _Watch:
    __slots__ = ("state", "n", "op", "deadline", "peers", "since_wall")

    def __init__(self, state: _GroupState, n: int, op: str, deadline: float) -> None:
        self.state, self.n, self.op, self.deadline = state, n, op, deadline
        self.since_wall = time.time()
        self.peers = [p for p in range(state.size) if p != state.rank]


class _Watcher:
    """The daemon thread that bounds every exchange: tombstones for ended peers at once, for every missing
    peer at the deadline; and the deferred deletes of records every peer has read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: list[_Watch] = []
        self._deletes: list[tuple[_GroupState, str]] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, w: _Watch) -> None:
        with self._lock:
            self._watches.append(w)
            self._start()
        self._wake.set()

    def unwatch(self, w: _Watch) -> None:
        with self._lock:
            if w in self._watches:
                self._watches.remove(w)

    def delete(self, state: _GroupState, keys: Sequence[str]) -> None:
        """Delete ``keys`` from ``state``'s store soon, on the watcher's connection (off the call's path). Held
        weakly: a group destroyed meanwhile keeps neither its store nor its server alive."""
        ref = weakref.ref(state)
        with self._lock:
            self._deletes.extend((ref, k) for k in keys)
            self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tide-calls-watcher", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                busy = bool(self._watches or self._deletes)
            if not busy:
                self._wake.wait()
            self._wake.clear()
            time.sleep(POLL_S)
            self._once()

    def _once(self) -> None:
        # A method of its own, so that nothing of a round outlives it in the thread's frame (a state held
        # there would keep a destroyed group's store, and its server, alive).
        with self._lock:
            watches, deletes, self._deletes = list(self._watches), self._deletes, []
        for w in watches:
            try:
                self._poll(w)
            except Exception:  # a failed store: the waiting call sees it too, and raises
                pass
        for ref, key in deletes:
            state = ref()
            if state is None:
                continue
            try:
                state.watch_store().delete_key(key)
            except Exception:  # a record left behind costs a key; a dead store needs no cleaning
                pass

    def _poll(self, w: _Watch) -> None:
        state = w.state
        store = state.watch_store()
        keys = [state.key(w.n, p) for p in w.peers]
        if store.check(keys):
            return
        late = time.monotonic() >= w.deadline
        for p, key in zip(w.peers, keys):
            if store.check([key]):
                continue
            who, life = state.peer(p, store)
            if late:
                tomb = {"tomb": "timeout", "by": state.rank, "n": w.n, "after_s": state.timeout_s}
            elif who is not None and _ended(life):
                tomb = {"tomb": "ended", "by": state.rank, "n": w.n, "pid": who["pid"], "life": life}
            else:
                notice = state.notice(p, w.since_wall)
                if notice is None:
                    continue
                tomb = {"tomb": "refused", "by": state.rank, "n": w.n, **notice}
            store.compare_set(key, "", json.dumps(tomb))
            if trace.ENABLED:
                trace.event(f"calls: {w.op} call {w.n} on group {state.name}: rank {p}'s record replaced ({tomb['tomb']})")


_WATCHER = _Watcher()


# ---------------------------------------------------------------------------------------------- the exchange
def _store_error(op: str, state: _GroupState, n: int, e: BaseException) -> TidePeerError:
    lines = _peer_lines(state, n, None, state.store)
    err = TidePeerError(f"tide: {op} on {state.describe()}: the group's store failed at call {n} (its server, in "
                        f"the process that created it, may have ended): {type(e).__name__}: {e}\n{lines}")
    state.broken = str(err)
    return err


def _peer_lines(state: _GroupState, n: int, records: dict | None, store_of: Callable) -> str:
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
                    where = f"behind by {n - last['n']} call(s): its last call is {last['n']}, {_record_words(last)}"
        except Exception as e:  # the store is gone: say what is known
            who = state.who.get(p)
            life = procfs.state(who["pid"]) if who and who["host"] == HOST else "state unknown"
            where = f"unknown (the store failed: {type(e).__name__})"
        pid = f"pid {who['pid']}, " if who else ""
        lines.append(f"  rank {p} ({pid}{life}): {where}")
    return "\n".join(lines)


def _exchange(op: str, state: _GroupState, rec: dict) -> dict[int, dict]:
    """Publish ``rec`` as this rank's record of call ``rec["n"]`` and return every rank's; raises when a
    peer ended, the timeout passed, or this rank came after its own tombstone."""
    n = rec["n"]
    if state.size == 1:
        return {state.rank: rec}
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
            # This slot was this rank's call that named no group (its notice): that call is this number.
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
    if got != mine:  # a peer replaced this rank's record before it came: nothing may be issued
        tomb = json.loads(got)
        if tomb["tomb"] == "timeout":
            raise TideTimeoutError(
                f"tide: {op} on {state.describe()}: this rank {state.rank} reached call {n} after rank {tomb['by']} "
                f"had given up waiting for it ({tomb['after_s']:g} s: {_TIMEOUT_WORDS}); nothing was exchanged. "
                f"Rank {tomb['by']} raised a timeout naming this rank as behind.")
        if tomb["tomb"] == "refused":  # another process's notice landed in this slot: the pid was reused
            raise TidePeerError(f"tide: {op} on {state.describe()}: rank {tomb['by']} took a notice of another "
                                f"process (pid {tomb['pid']}) for this rank's at call {n}; nothing was exchanged")
        raise TidePeerError(f"tide: {op} on {state.describe()}: rank {tomb['by']} took this rank {state.rank} for "
                            f"ended at call {n} ({tomb.get('life')}); nothing was exchanged")
    records = {state.rank: rec}
    peers = [p for p in range(state.size) if p != state.rank]
    start = time.monotonic()
    watch = _Watch(state, n, op, start + state.timeout_s)
    _WATCHER.watch(watch)
    try:
        values = store.multi_get([state.key(n, p) for p in peers])
    except RuntimeError as e:
        if time.monotonic() - start < state.timeout_s + BACKSTOP_S - 0.5:
            raise _store_error(op, state, n, e) from e
        values = [store.compare_set(state.key(n, p), "", json.dumps(
            {"tomb": "timeout", "by": state.rank, "n": n, "after_s": state.timeout_s})) for p in peers]
    finally:
        _WATCHER.unwatch(watch)
    records.update((p, json.loads(v)) for p, v in zip(peers, values))
    tombs = {p: r for p, r in records.items() if "tomb" in r}
    if not tombs:
        if len(state.who) < len(peers):  # every peer has published its pid before its record: keep them all,
            try:                         # so that a peer is named even after the store is gone
                for p, v in zip(peers, store.multi_get([state.who_key(p) for p in peers])):
                    state.who[p] = json.loads(v)
            except RuntimeError as e:
                raise _store_error(op, state, n, e) from e
        done, state.kept = state.kept[:-1], state.kept[-1:]
        if done:  # every peer published call n, so every peer has read this rank's earlier records
            _WATCHER.delete(state, [state.key(k, state.rank) for k in done])
        return records
    waited = time.monotonic() - start
    lines = _peer_lines(state, n, records, state.store)
    me = f"  this rank {state.rank} (pid {os.getpid()}): at call {n}: {_record_words(rec)}"
    ended = sorted(p for p, r in tombs.items() if r["tomb"] == "ended")
    refused = sorted(p for p, r in tombs.items() if r["tomb"] == "refused")
    if refused and not ended:
        p = refused[0]
        t = tombs[p]
        raise _EXC_TYPES.get(t["type"], RuntimeError)(
            f"tide.{op}: rank {p} of {state.describe()} refused call {n}, so no rank issued it: it called "
            f"tide.{t['op']} with group_name {t['group_name']!r}, which names no group it knows: {t['error']}")
    if ended:
        msg = (f"tide: {op} on {state.describe()}: rank(s) {ended} ended (process gone) without reaching call {n}; "
               f"nothing was exchanged, and the group cannot be used again.\n{me}\n{lines}")
        state.broken = msg
        raise TidePeerError(msg)
    raise TideTimeoutError(
        f"tide: {op} on {state.describe()} did not complete {waited:.1f} s after it was issued (timeout "
        f"{state.timeout_s:g} s: {_TIMEOUT_WORDS}): rank(s) {sorted(tombs)} are behind (a peer died, stalled, or "
        f"issued a different sequence of TIDE ops). Nothing was exchanged.\n{me}\n{lines}")


def _judge(op: str, state: _GroupState, n: int, records: dict[int, dict], refused_here: bool) -> None:
    """Raise on every rank alike (this rank's own check error is raised by the caller): a peer's check error,
    or calls that differ."""
    if refused_here:
        return
    refused = [p for p, r in sorted(records.items()) if r["error"]]
    if refused:
        p = refused[0]
        kind, msg = records[p]["error"]
        others = f" (and rank(s) {refused[1:]})" if refused[1:] else ""
        raise _EXC_TYPES.get(kind, RuntimeError)(
            f"tide.{op}: rank {p}{others} of {state.describe()} refused call {n}, so no rank issued it: {msg}")
    mine = records[state.rank]
    for p, theirs in sorted(records.items()):
        if _fingerprint(theirs) != _fingerprint(mine):
            raise _mismatch(op, state, n, mine, p, theirs)


# ---------------------------------------------------------------------------------------------- the call
class Call:
    """An agreed call's group, and its bounded waits."""

    __slots__ = ("op", "group", "state", "n", "records")

    def __init__(self, op: str, group: dist.ProcessGroup, state: _GroupState | None, n: int,
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
                    err = TideTimeoutError(
                        f"tide: {self.op} on {state.describe()} did not complete {state.timeout_s:g} s after its "
                        f"collectives were issued (timeout {state.timeout_s:g} s: {_TIMEOUT_WORDS}), though every "
                        f"rank had agreed to call {self.n}: a peer stalled inside it. The group cannot be used "
                        f"again.\n{_peer_lines(state, self.n, self.records, state.store)}")
                else:
                    err = _collective_failed(self.op, state, self.n, self.records, e)
                state.broken = str(err)
                try:
                    raise err from e
                finally:
                    del err  # no cycle through this frame


def _collective_failed(op: str, state: _GroupState, n: int, records: dict | None, e: BaseException) -> TidePeerError:
    """The error of a collective the backend failed: the peer(s) whose process ended, once /proc says so (a
    process that closed its sockets takes a moment to become a zombie)."""
    ended: list[int] = []
    deadline = time.monotonic() + 2.0
    while True:
        try:
            store = state.store()
            ended = [p for p in range(state.size) if p != state.rank and _ended(state.peer(p, store)[1])]
        except Exception:
            ended = [p for p, who in state.who.items() if who["host"] == HOST and _ended(procfs.state(who["pid"]))]
        if ended or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    who = f"rank(s) {ended} ended (process gone)" if ended else "no peer's process is known to have ended"
    return TidePeerError(
        f"tide: {op} on {state.describe()}: its collective failed at call {n}: {who}; the group cannot be used "
        f"again. The backend said: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}\n"
        f"{_peer_lines(state, n, records, state.store)}")


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
                notify_refusal(op, group_name, e if error is None else error)
            raise
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
        state = self._state = _state(group)
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
        desc = call_desc(op, desc_lists, extra)
        rec = {"n": n, "op": op, "desc": desc[:DESC_CHARS], "cut": len(desc) > DESC_CHARS,
               "crc": zlib.crc32(desc.encode()), "id": call_site.describe(call_site.current()),
               "thread": thread.name, "tcount": tcount,
               "error": [type(error).__name__, str(error)] if error is not None else None}
        try:
            records = _exchange(op, state, rec)
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


def refuse(op: str, group_name: str, world_size: int, tensor_lists, error: BaseException) -> None:
    """Raise ``error`` (a check of ``op`` failed before its call could be built) on every rank: on CPU the
    refusal goes through the call's exchange as the mutating op's would, so peers that are issuing their
    call raise too instead of waiting. Always raises."""
    holder = [error]
    del error

    def check():
        raise holder.pop()

    lists = [list(ts) for ts in tensor_lists]
    named = tuple((f"arg{i}", ts) for i, ts in enumerate(lists))
    try:
        group = resolve_group(op, group_name)
    except ValueError:
        if all(t.device.type == "cpu" for ts in lists for t in ts):
            notify_refusal(op, group_name, holder[0])
        _raise(holder.pop())
    try:
        if not any(lists):  # no tensor says where the call runs: exchange when the group runs CPU collectives
            group._get_backend(torch.device("cpu"))
            named = (("arg0", [torch.empty(0)]),)
    except RuntimeError:
        _raise(holder.pop())
    agreed(op, group_name, world_size, lists, (), named, check).__enter__()  # raises the refusal
