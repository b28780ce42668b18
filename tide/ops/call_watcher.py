"""The daemon thread that bounds every exchange of the reference backend's agreed calls
(``tide/ops/calls.py``): it looks every :data:`POLL_S` at the exchanges in progress and writes a tombstone,
with compare-and-set, in place of a missing peer's record: at once for a peer whose process has ended or
that left a notice of a refused call, at the call's deadline for every other. It also deletes, off the
calls' path, records every peer has read.
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Sequence

from tide import procfs, trace
from tide.ops.call_groups import GroupState

POLL_S = 0.25  # how often the watcher looks at exchanges in progress (a dead peer is named within this)


class Watch:
    __slots__ = ("state", "n", "op", "deadline", "peers", "since_wall")

    def __init__(self, state: GroupState, n: int, op: str, deadline: float) -> None:
        self.state, self.n, self.op, self.deadline = state, n, op, deadline
        self.since_wall = time.time()
        self.peers = [p for p in range(state.size) if p != state.rank]


class Watcher:
    """The daemon thread that bounds every exchange: tombstones for ended peers at once, for every missing
    peer at the deadline; and the deferred deletes of records every peer has read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watches: list[Watch] = []
        self._deletes: list[tuple[GroupState, str]] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, w: Watch) -> None:
        with self._lock:
            self._watches.append(w)
            self._start()
        self._wake.set()

    def unwatch(self, w: Watch) -> None:
        with self._lock:
            if w in self._watches:
                self._watches.remove(w)

    def delete(self, state: GroupState, keys: Sequence[str]) -> None:
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

    def _poll(self, w: Watch) -> None:
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
            elif who is not None and procfs.ended(life):
                tomb = {"tomb": "ended", "by": state.rank, "n": w.n, "pid": who["pid"], "life": life}
            else:
                notice = state.notice(p, w.since_wall)
                if notice is None:
                    continue
                tomb = {"tomb": "refused", "by": state.rank, "n": w.n, **notice}
            store.compare_set(key, "", json.dumps(tomb))
            if tomb["tomb"] == "refused":
                state.notice_taken(p, notice)
            if trace.ENABLED:
                trace.event(f"calls: {w.op} call {w.n} on group {state.name}: rank {p}'s record replaced "
                            f"({tomb['tomb']})")


WATCHER = Watcher()
