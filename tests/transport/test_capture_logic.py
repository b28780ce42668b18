"""What decides captured against eager issue, on CPU with stand-ins (capture itself needs CUDA:
tests/cuda/test_capture.py runs it): the replay mark an op is issued with, the watchdog's view of
captured ops, slot events and leases kept within their capture, mappings a graph writes through kept."""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from tests.transport.test_lease import NBYTES, RANK, WORLD, RecordingIpc, handle_of, publish_peers
from tide.ops import cuda as cuda_ops
from tide.transport import issue, lease, watchdog
from tide.transport.lease import Leases
from tide.transport.slots import SlotLeases


class Context:
    """The capture id the extension would answer: 0 eager, else the capture's."""

    def __init__(self) -> None:
        self.id = 0

    def __call__(self) -> int:
        return self.id


class Stream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


# ------------------------------------------------------------------------------------------ issue
class Ext:
    def __init__(self) -> None:
        self.claimed = 0

    def replay_claim(self, device):
        self.claimed += 1
        return 40 + self.claimed

    def replay_states(self, device, first, count):
        return [(0, 0)] * count

    def op_completed(self, device, op):
        return True


def _arena(ext):
    return types.SimpleNamespace(ext=ext, device=torch.device("cuda", 0), label="g", timeout_s=9.0,
                                 store_prefix="tide/arena/0_1/1")


@pytest.mark.parametrize("capturing", [False, True])
def test_a_call_is_issued_with_a_replay_mark_exactly_under_capture(capturing, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # as a CUDA build (this may be a CPU one)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    tracked = []
    monkeypatch.setattr(watchdog.WATCHDOG, "track_captured", lambda *a, **kw: tracked.append((a, kw)))
    ext, calls = Ext(), []

    def call(**kw):
        calls.append(kw)
        return "tide", 17

    assert issue.watched(_arena(ext), "reduce_scatter_params_", call, issue.capturing(), plan="p") == "tide"
    if capturing:
        assert calls == [{"plan": "p", "mark": 41}] and ext.claimed == 1
        (args, kw), = tracked
        assert args[2] == 41 and args[3] == "reduce_scatter_params_" and kw == {"owner": "tide/arena/0_1/1"}
    else:  # an eager op is listed by the extension itself (the arena's in-flight list)
        assert calls == [{"plan": "p"}] and ext.claimed == 0 and tracked == []


def test_a_refused_captured_call_is_not_watched(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    tracked = []
    monkeypatch.setattr(watchdog.WATCHDOG, "track_captured", lambda *a, **kw: tracked.append(a))
    assert issue.watched(_arena(Ext()), "all_gather_into_params_", lambda **kw: ("bad_args", 0), True) == "bad_args"
    assert tracked == []


class Driven:
    """The arena and driver a call's actions reach, recorded; the gate answers ``answers`` in turn."""

    def __init__(self, answers) -> None:
        self.answers, self.done = list(answers), []
        self.native = object()  # the extension's arena, which the gate finds bound to the group name
        self.arena = types.SimpleNamespace(region=lambda: self.done.append("lease"), native=self.native)

    def call(self, op="reduce_scatter_params_", world_size=2):
        return cuda_ops._Call(op, "g", world_size, gate=self._gate,
                              issue=lambda a, captured, *found: self.done.append(("issue", a, captured, found)),
                              new_plan=lambda a: self.done.append("plan"), refuse=self._refuse)

    def _gate(self, arena):
        self.done.append("gate")
        verdict, *found = self.answers.pop(0)
        return (verdict, None if verdict == "no_arena" else self.native, *found)

    def _refuse(self, arena):
        raise ValueError("tide.reduce_scatter_params_: grads[0] is on cpu")


@pytest.fixture
def kernels(monkeypatch):
    """The Python kernels' surroundings: the route of group "g" (an arena of ranks 0 and 1), binding and
    counting recorded."""
    counted, bound = [], []
    monkeypatch.setattr(cuda_ops.counters, "count_op", lambda op, *why, **kw: counted.append((op, why, kw)))
    serving = types.SimpleNamespace(bind=lambda route: bound.append(route) or route.arena is not None)
    monkeypatch.setattr(cuda_ops._transport, "serving", serving, raising=False)
    monkeypatch.setattr(cuda_ops._transport, "WATCHDOG", types.SimpleNamespace(check=lambda: None), raising=False)
    route = types.SimpleNamespace(arena=None, multinode=False, ranks=(0, 1))
    monkeypatch.setattr(cuda_ops.routes, "of_name", lambda name: route)
    return types.SimpleNamespace(counted=counted, bound=bound, route=route)


def test_the_python_kernels_issue_with_what_the_gate_found(kernels):
    """``transport`` (the steady path off) and ``capturing`` issue with the plan and slot handed over, the
    latter with a replay mark; nothing is asked again."""
    d = Driven([])
    kernels.route.arena = d.arena
    assert cuda_ops._serve(d.call(), "transport", d.native, ("plan", 1)) is True
    assert cuda_ops._serve(d.call(), "capturing", d.native, ("plan", 0)) is True
    assert d.done == [("issue", d.arena, False, ("plan", 1)), ("issue", d.arena, True, ("plan", 0))]
    assert kernels.counted == [] and kernels.bound == []


def test_a_missing_binding_lease_or_plan_is_made_once_and_the_gate_asked_again(kernels):
    d = Driven([("no_lease", None), ("no_plan", None), ("capturing", "plan")])
    kernels.route.arena = d.arena
    assert cuda_ops._serve(d.call(), "no_arena", None, (None,)) is True
    assert kernels.bound == [kernels.route]
    assert d.done == ["gate", "lease", "gate", "plan", "gate", ("issue", d.arena, True, ("plan",))]
    d = Driven([("no_plan", None)])  # the gate names the plan missing again after it was made: a bug, not a loop
    kernels.route.arena = d.arena
    with pytest.raises(AssertionError, match=r"gate answered 'no_plan' again"):
        cuda_ops._serve(d.call(), "no_plan", d.native, (None,))


def test_the_reference_backend_runs_for_what_the_transport_cannot_take_counted_with_why(kernels):
    """A capture must not bake in an eager lease (nor eager work use a graph's), outputs outside the plan's
    places, a group whose ranks no arena serves (a multi-node group: its schedule)."""
    d = Driven([("outputs_not_in_slot", None, -1)])
    kernels.route.arena = d.arena
    op = "all_gather_into_params_"
    assert cuda_ops._serve(d.call(op), "lease_across_capture", d.native, (None, -1)) is False
    # The plan is made; the outputs lie elsewhere.
    assert cuda_ops._serve(d.call(op), "no_plan", d.native, (None, -1)) is False
    assert d.done == ["plan", "gate"]
    kernels.route.arena = None
    assert cuda_ops._serve(d.call(op), "no_arena", None, (None, -1)) is False
    kernels.route.multinode = True
    assert cuda_ops._serve(d.call(op), "no_arena", None, (None, -1)) is False
    assert kernels.counted == [(op, ("lease_across_capture",), {}), (op, ("outputs_not_in_slot",), {}),
                               (op, ("no_arena",), {}), (op, (), {"multinode": True})]


def test_a_name_bound_to_another_groups_arena_is_bound_again_or_refused(kernels):
    """A process group re-created under the name of one whose arena is still enabled: the gate found that
    arena; the name is bound to its own group's arena and the gate asked again, or, without one, refused."""
    d = Driven([("transport", "plan")])
    kernels.route.arena = d.arena
    assert cuda_ops._serve(d.call(), "no_plan", object(), (None,)) is True
    assert kernels.bound == [kernels.route] and d.done == ["gate", ("issue", d.arena, False, ("plan",))]
    kernels.route.arena = None
    with pytest.raises(RuntimeError, match=r"bound to the arena of a process group destroyed under that name, "
                                           r"and the group of that name now has none: .* before destroy_process_group"):
        cuda_ops._serve(d.call(), "transport", object(), ("plan",))


def test_argument_errors_are_raised_naming_the_op(kernels):
    d = Driven([])
    kernels.route.arena = d.arena
    with pytest.raises(ValueError, match=r"tide\.reduce_scatter_params_: world_size=4 but group 'g' has 2 ranks"):
        cuda_ops._serve(d.call(world_size=4), "world_size", d.native, (None,))
    with pytest.raises(ValueError, match=r"grads\[0\] is on cpu"):
        cuda_ops._serve(d.call(), "refused", d.native, ("plan",))
    with pytest.raises(AssertionError, match=r"refused an argument \(grad\)"):
        cuda_ops._serve(d.call(), "grad", d.native, (None,))


# ------------------------------------------------------------------------------------------ watchdog
def test_a_captured_op_expires_only_when_one_replay_stays_active_past_its_timeout():
    c = watchdog._Captured(mark=3, op="all_gather_into_params_", group="g", timeout_s=5.0, describe=lambda: [],
                           owner="a")
    assert not c.stalled(0, 0, now=0.0)  # idle between replays
    assert not c.stalled(1, 0, now=1.0)  # replay 1 began
    assert not c.stalled(1, 0, now=5.5)  # 4.5 s in
    assert not c.stalled(1, 1, now=7.0)  # replay 1 finished, replay 2 is active: its own clock
    assert not c.stalled(0, 2, now=20.0)
    assert not c.stalled(1, 2, now=21.0)
    assert c.stalled(1, 2, now=26.5)  # one replay active for 5.5 s


def test_the_watchdog_reads_every_captured_op_of_a_device_in_one_call_and_forgets_an_arena():
    dog = watchdog.Watchdog()
    dog._start = lambda: None  # no thread: polled by hand
    words = {5: (1, 0), 6: (0, 3), 9: (1, 7)}
    reads = []

    def read(device, first, count):
        reads.append((device, first, count))
        return [words.get(k, (0, 0)) for k in range(first, first + count)]

    for mark in (5, 6, 9):
        dog.track_captured(read, 0, mark, "reduce_scatter_params_", "g", 2.0, lambda: ["report"], owner="arena-a")
    assert dog._stalled_captured(now=0.0) is None and reads == [(0, 5, 5)]
    late = dog._stalled_captured(now=2.5)
    assert late is not None and late.issued == 0.0 and "replaying" in late.op and late.done is None
    dog.forget("arena-a")
    assert dog.captured() == 0 and dog._stalled_captured(now=9.0) is None


# ------------------------------------------------------------------------------------------ slots
def test_slot_uses_go_to_the_extensions_events_by_raw_stream():
    """The events themselves, and the rule that a stream waits only for a use of its own context, are the
    extension's (csrc/transport/arena.h; the all-gather waits for them itself; the capture tests run them on
    CUDA)."""
    calls = []
    events = types.SimpleNamespace(slot_used=lambda **kw: calls.append(("used", kw)),
                                   slot_uses=lambda slot: 3 if slot == 1 else 0)
    slots, s = SlotLeases(2, events=events), types.SimpleNamespace(cuda_stream=0x7F00)
    slots.used(1, s)
    assert calls == [("used", {"slot": 1, "stream": 0x7F00})]
    assert slots.uses(1) == 3 and slots.uses(0) == 0


# ------------------------------------------------------------------------------------------ leases
class LeaseRule:
    """The extension's lease bookkeeping as the Leases feed it: the region's context at each lease (the
    symmetric one's is every context), and its rule (Arena::held_in) for the current context."""

    EVERY = -1

    def __init__(self, ctx) -> None:
        self.ctx, self.held, self.context = ctx, False, 0

    def set_region(self, region, bases, context) -> None:
        self.held, self.context = region is not None, context

    def held_here(self) -> bool:
        return self.held and self.context in (self.EVERY, self.ctx())


def _leases(ctx):
    store, ipc, syncs, rule = dist.HashStore(), RecordingIpc(), [], LeaseRule(ctx)
    leases = Leases(ipc, None, store, "tide/test", RANK, WORLD, torch.device("cpu"), NBYTES, 5.0, "test",
                    set_region=rule.set_region, sync_pushes=lambda: syncs.append(True), context=ctx,
                    held_here=rule.held_here)
    return store, ipc, leases, syncs


def test_a_lease_held_across_a_capture_boundary_is_refused():
    ctx = Context()
    store, _, leases, _ = _leases(ctx)
    publish_peers(store, 1, generation=0)
    leases.acquire()
    ctx.id = 5
    assert leases.held_elsewhere()
    with pytest.raises(RuntimeError, match="leased outside the CUDA-graph capture and is still held"):
        leases.acquire()
    leases.release()
    publish_peers(store, 2, generation=0)
    leases.acquire()  # leased inside the capture
    ctx.id = 0
    with pytest.raises(RuntimeError, match="leased inside a CUDA-graph capture"):
        leases.acquire()


def test_mappings_a_graph_writes_through_are_never_closed():
    ctx = Context()
    store, ipc, leases, syncs = _leases(ctx)
    ctx.id = 3  # the first lease inside a capture: the graph writes through these mappings at every replay
    publish_peers(store, 1, generation=1)
    leases.acquire()
    leases.release()
    ctx.id = 0
    for n in range(2, lease.MAPPINGS_PER_PEER + 4):  # eager leases in ever new segments
        publish_peers(store, n, generation=n)
        leases.acquire()
        leases.release()
    kept = {leases._mapped[p][handle_of(p, 1)] for p in range(WORLD) if p != RANK}
    assert len(kept) == 2 and not kept & set(ipc.closed) and ipc.closed and len(syncs) == len(ipc.closed)


def test_no_mapping_is_closed_during_a_capture():
    ctx = Context()
    store, ipc, leases, syncs = _leases(ctx)
    for n in range(1, lease.MAPPINGS_PER_PEER + 1):
        publish_peers(store, n, generation=n)
        leases.acquire()
        leases.release()
    ctx.id = 8  # one more segment per peer, inside a capture: closing would wait for pushes a capture holds
    publish_peers(store, lease.MAPPINGS_PER_PEER + 1, generation=99)
    leases.acquire()
    assert ipc.closed == [] and syncs == []
