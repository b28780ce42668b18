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
from tide.timeouts import timeout_for

BACKSTOP_S = 5.0  # a wait's own bound past the timeout, should the watcher not run
SCAN_BACK = 8  # how many calls back a report looks for a peer's last record
HOST = socket.gethostname()
_states_lock = threading.Lock()  # guards the tables of registry this module owns


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
        server = registry.call_servers.get(key)
        if server is None or server.world() is not world:
            server = registry.call_servers[key] = _Server(root)
            server.watch.set_timeout(timedelta(seconds=60))
    return server




class GroupState:
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
            if notice["wall"] < since_wall - self.timeout_s or registry.used_notices.get(g, 0) >= notice["seq"]:
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


def process_ended(state: str) -> bool:
    return state == "gone" or state.startswith(("Z", "X"))


def _world_store():
    """The default group's store, or None."""
    world = dist.GroupMember.WORLD if dist.is_initialized() else None
    entry = _world.pg_map.get(world) if world is not None else None
    return entry[1] if entry is not None else None


def _notice_key(global_rank: int) -> str:
    return f"tide/notices/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{global_rank}"


def notify_refusal(op: str, group_name: str, error: BaseException) -> None:
    """This rank refused a call whose ``group_name`` names no group it knows, so it cannot tell that group's
    ranks through the call's exchange: it leaves a notice in the default group's store instead, and waits
    (at most the default group's TIDE timeout) until a peer's wait has taken it. A peer waiting for this
    rank's call reads it (the watcher, every :data:`POLL_S`), replaces this rank's record of that call with
    it, and raises with this rank's error; this rank's next call on that group finds the replaced slot and
    takes the next one, so the ranks stay in step. (A peer that reaches the call more than a timeout later
    pairs it with this rank's next call, as with a skipped call.) Nothing without a default group of
    several ranks."""
    store = _world_store()
    if store is None or dist.get_world_size() == 1:
        return
    registry.notices_left[0] += 1
    notice = {"seq": registry.notices_left[0], "op": op, "group_name": group_name, "type": type(error).__name__,
              "error": str(error), "pid": os.getpid(), "wall": time.time(), "thread": threading.current_thread().name}
    key = _notice_key(dist.get_rank())
    try:
        conn = _server_for(store).main(timeout_for(dist.group.WORLD))
        conn.set(key, json.dumps(notice))
        conn.wait([f"{key}/taken/{notice['seq']}"], timedelta(seconds=timeout_for(dist.group.WORLD)))
    except RuntimeError:  # no store, or nobody waited for this rank: its peers end at their timeout, if at all
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

