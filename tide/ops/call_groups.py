"""Per-group state of the reference backend's agreed calls (``tide/ops/calls.py``): this process's
connections to each store server, what a rank knows of one group object (its call count, the call in flight,
whether it broke, its peers' process ids), and the notices of calls refused without a group.

State is per group object (a re-created group of the same name starts afresh): its store keys carry the
process's count of group objects of that name and ``TORCHELASTIC_RESTART_COUNT``, so a store that outlives a
group (one passed to ``init_process_group`` again, torchrun's agent store) never shows a new group an old
group's records.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from tide import procfs, registry
from tide.timeouts import group_timeout, timeout_for

BACKSTOP_S = 5.0  # a wait's own bound past the timeout, should the watcher not run
CONNECT_S = 4.0  # a new store connection's attempts end after this (a live server answers in milliseconds)
NOTICE_WAIT_S = 2.0  # how long a rank that refused without a group waits for a peer to take its notice
SCAN_BACK = 8  # how many calls back a report looks for a peer's last record
HOST = socket.gethostname()
_states_lock = threading.Lock()  # guards the tables of registry this module owns


class _Server:
    """This process's connections to one store server (a TCPStore's host and port): one for the watcher
    and one per thread that issues TIDE calls, shared by every group whose store it serves (each group's
    keys carry its name and instance). Clients only: they keep no server alive. A new connection costs a
    handshake with the server; opening two per group made a run of many short-lived groups wait 5 s
    on the server now and then."""

    def __init__(self, root, timeout_s: float) -> None:
        self.watch = _client(root, timeout_s)  # made from the server's store once; every later one from this client
        self._local = threading.local()
        self.world = _world_ref()

    def main(self, timeout_s: float):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = _client(self.watch, timeout_s + BACKSTOP_S)
        conn.set_timeout(timedelta(seconds=timeout_s + BACKSTOP_S))
        return conn


def _client(store, timeout_s: float):
    """A new client of ``store``'s server, its timeout ``timeout_s``, whose attempts to connect end after
    :data:`CONNECT_S` (the store retries once after its timeout): ``clone()`` would retry for the store's own
    timeout, and a server that has ended (its process gone) never answers."""
    if isinstance(store, dist.TCPStore):
        client = dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                               timeout=timedelta(seconds=min(timeout_s, CONNECT_S)), use_libuv=store.libuvBackend)
        client.set_timeout(timedelta(seconds=timeout_s))
        return client
    return store.clone()


def _world_ref():
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    return weakref.ref(world) if world is not None else (lambda: None)


def _server_for(base, timeout_s: float) -> _Server:
    """The connections to the server of store ``base`` (a group's PrefixStore chain), without its prefixes
    (the keys are TIDE's own, every group's apart); new ones when the default group was re-created since
    (its store, at the same address, may be another server). A first connection gives up after ``timeout_s``."""
    root = getattr(base, "_underlying_non_prefix_store", base)
    host, port = getattr(root, "host", None), getattr(root, "port", None)
    key = (host, port) if host is not None else (id(root),)
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    with _states_lock:
        server = registry.call_servers.get(key)
        if server is None or server.world() is not world:
            server = registry.call_servers[key] = _Server(root, timeout_s + BACKSTOP_S)
            server.watch.set_timeout(timedelta(seconds=60))
    return server




class GroupState:
    """What this rank knows of one group object: its call count, the call in flight, whether it broke, and
    its store connections (one for this rank's calls, one for the watcher)."""

    def __init__(self, group: dist.ProcessGroup, index: int) -> None:
        self.name = group.group_name
        self.rank, self.size = group.rank(), group.size()
        try:
            self.timeout_s = timeout_for(group)
        except ValueError:  # an invalid TIDE_TIMEOUT_S: the call that found it is refused, bounded by the group's
            self.timeout_s = group_timeout(group)
        restart = restart_count()
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
            self._server = _server_for(base, self.timeout_s)
            world = _world_store()
            if world is not None and self.global_ranks is not None:
                self._notice_server = _server_for(world, self.timeout_s)
                publish_process()

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
            else:
                who = self._process_of(p)
        if who is None:
            return None, "no process id published: it has not reached a TIDE call or tide.fsdp.enable"
        if who["host"] != HOST:
            return who, f"on host {who['host']}, state unknown here"
        return who, procfs.state(who["pid"])

    def _process_of(self, p: int) -> dict | None:
        """Peer ``p``'s {"host", "pid"} as its process published them at its first TIDE use
        (:func:`publish_process`), for a peer that has not reached a call on this group."""
        if self._notice_server is None:
            return None
        store, key = self._notice_server.watch, _process_key(self.global_ranks[p])
        return json.loads(store.get(key)) if store.check([key]) else None

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
            if (notice.get("withdrawn") or notice["wall"] < since_wall - self.timeout_s
                    or registry.used_notices.get(g, 0) >= notice["seq"]):
                return None
            registry.used_notices[g] = notice["seq"]
        return notice

    def notice_taken(self, p: int, notice: dict) -> None:
        """Tell peer ``p``, waiting in :func:`notify_refusal`, that its notice took the place of its record.
        Only once that tombstone is in place: a peer released earlier could publish its next call into the
        slot first and be paired with this call."""
        self._notice_server.watch.set(f"{_notice_key(self.global_ranks[p])}/taken/{notice['seq']}", str(self.rank))

    def last_record(self, p: int, before: int, store) -> dict | None:
        """Peer ``p``'s latest record (or tombstone) of a call before ``before``, looking :data:`SCAN_BACK` back."""
        for k in range(before - 1, max(0, before - 1 - SCAN_BACK), -1):
            key = self.key(k, p)
            if store.check([key]):
                return json.loads(store.get(key))
        return None



def threaded_ranks(group: dist.ProcessGroup) -> bool:
    """Whether ``group``'s ranks are threads of this process (torch's ``threaded`` test backend): TIDE's call
    agreement, counters and transport are per process, so TIDE does not serve such a group."""
    name = getattr(group, "getBackendName", None)  # the threaded group is a Python ProcessGroup that defines it
    if name is not None and name() == "threaded":
        return True
    try:
        return dist.get_backend(group) == "threaded"
    except (ValueError, RuntimeError):
        return False


def _world_store():
    """The default group's store, or None."""
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    entry = _world.pg_map.get(world) if world is not None else None
    return entry[1] if entry is not None else None


def restart_count() -> str:
    """torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``, "0" outside it): every store key TIDE writes
    carries it, so a store that outlives a restart never shows the new processes the old ones' keys."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _notice_key(global_rank: int) -> str:
    return f"tide/notices/{restart_count()}/{global_rank}"


def _process_key(global_rank: int) -> str:
    return f"tide/processes/{restart_count()}/{global_rank}"


def _world_timeout_s() -> float:
    """The default group's TIDE timeout; its own timeout when ``TIDE_TIMEOUT_S`` is invalid here (the refusal
    being told may be that very error)."""
    try:
        return timeout_for(dist.group.WORLD)
    except ValueError:
        return group_timeout(dist.group.WORLD)


def publish_process() -> None:
    """Publish this process's host and pid in the default group's store, once per default group, so that a
    peer whose wait misses this rank on a group it has not called on yet can tell whether it ended. Called at
    the first TIDE call and by ``tide.fsdp.enable``; nothing without a default group of several ranks."""
    store, world = _world_store(), dist.GroupMember.WORLD if dist.is_initialized() else None
    if store is None or dist.get_world_size() == 1 or registry.process_published[0]() is world:
        return
    try:
        timeout_s = _world_timeout_s()
        _server_for(store, timeout_s).main(timeout_s).set(_process_key(dist.get_rank()),
                                                        json.dumps({"host": HOST, "pid": os.getpid()}))
    except RuntimeError:  # no store: a peer's report then says the pid is unknown
        return
    registry.process_published[0] = weakref.ref(world)


def notify_refusal(op: str, what: str, error: BaseException) -> None:
    """This rank refused a call without a group it could agree through (``what`` says why, in words: a
    ``group_name`` that names no group it knows, a ``group`` that is no process group), so it cannot tell
    that group's ranks through the call's exchange: it leaves a notice in the default group's store instead,
    and waits up to :data:`NOTICE_WAIT_S` until a peer's wait has taken it. A peer waiting for this rank's
    call reads it (the watcher, every :data:`POLL_S`), replaces this rank's record of that call with it, and
    raises with this rank's error; this rank's next call on that group finds the replaced slot and takes the
    next one, so the ranks stay in step. A notice no peer took in that time is withdrawn (every rank may
    have refused alike: none is waiting), so that no later wait takes it for another call; a peer that
    reaches the call after that pairs it with this rank's next call, as with a skipped call. Nothing
    without a default group of several ranks."""
    store = _world_store()
    if store is None or dist.get_world_size() == 1:
        return
    registry.notices_left[0] += 1
    notice = {"seq": registry.notices_left[0], "op": op, "what": what, "type": type(error).__name__,
              "error": str(error), "pid": os.getpid(), "wall": time.time(), "thread": threading.current_thread().name}
    key = _notice_key(dist.get_rank())
    try:
        timeout_s = _world_timeout_s()
        conn = _server_for(store, timeout_s).main(timeout_s)
        conn.set(key, json.dumps(notice))
        try:
            conn.wait([f"{key}/taken/{notice['seq']}"], timedelta(seconds=NOTICE_WAIT_S))
        except RuntimeError:  # not taken in time (the wait's timeout)
            conn.set(key, json.dumps({**notice, "withdrawn": True}))
    except RuntimeError:  # no store: its peers end at their timeout, if at all
        pass


def state_of(group: dist.ProcessGroup) -> GroupState:
    state = registry.call_states.get(group)
    if state is None:
        with _states_lock:
            state = registry.call_states.get(group)
            if state is None:
                registry.call_group_instances[group.group_name] += 1
                state = registry.call_states[group] = GroupState(group, registry.call_group_instances[group.group_name])
    return state

